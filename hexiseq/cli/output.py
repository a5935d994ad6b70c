"""What the CLI's commands share for scripts: one JSON document on stdout, `--out -`, and
the exit codes (`hexiseq --help` and the README list them).

With `--json` a command prints exactly one JSON document on stdout and no human text; with
`--out -` the plan JSON goes to stdout and the human text to stderr, so a pipe gets only JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from hexiseq.errors import InputError

EXIT_OK = 0
EXIT_INTERNAL_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_NO_PLAN_FITS = 3
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: the status a Unix tool killed by a closed pipe has (`yes | head`)."""

STDOUT = "-"
"""`--out -`: write the plan JSON to stdout."""

EXIT_CODES_EPILOG = f"""\
exit codes:
  {EXIT_OK}    done
  {EXIT_INTERNAL_ERROR}    internal error: a bug (please report the traceback)
  {EXIT_BAD_INPUT}    bad input: one line on stderr says what is wrong and what is allowed
  {EXIT_NO_PLAN_FITS}    no plan fits in memory (plan): one line says how much is missing, where
  {EXIT_BROKEN_PIPE}  stdout was closed early (| head): the command stopped printing, quietly
  run and profile links end with torchrun's code"""


def add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--json`: one JSON document on stdout (`what` it holds), no human text."""
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON document on stdout ({what}) and no human text",
    )


def print_json(document: Any) -> None:
    """`document` as one JSON document on stdout (strict JSON: no NaN or Infinity)."""
    print(json.dumps(document, indent=1, allow_nan=False))


def human_stream(out: str | None) -> TextIO:
    """Where the human text goes: stderr when `--out -` has stdout for the plan JSON."""
    return sys.stderr if out == STDOUT else sys.stdout


def check_out_choice(out: str | None, json_output: bool) -> None:
    """`--out -` and `--json` cannot both have stdout."""
    if out == STDOUT and json_output:
        raise InputError(
            "--out - and --json both write to stdout; give --out a file path, or drop --json"
        )
