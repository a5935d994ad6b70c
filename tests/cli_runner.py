"""Run the `hexiseq` CLI in-process with its output captured (shared by the CLI tests)."""

from __future__ import annotations

import contextlib
import io
from typing import NamedTuple

from hexiseq.cli import main


class CliRun(NamedTuple):
    code: int
    stdout: str
    stderr: str


def run_main(argv: list[str]) -> CliRun:
    """`main(argv)` with stdout/stderr captured; argparse's SystemExit turned into the code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return CliRun(code, out.getvalue(), err.getvalue())
