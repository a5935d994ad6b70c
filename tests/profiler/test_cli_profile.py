"""`hexiseq profile` in process: a tiny sweep end to end, and bad input (exit 2, one line,
no store created)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import run_main
from profiler_cases import TINY_GRID_POINTS

from hexiseq.store import Store


def test_profile_cpu_with_a_grid_file(tmp_path: Path, tiny_grid_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    argv = ["profile", "--device", "cpu", "--grid", str(tiny_grid_path), "--store", url]
    run = run_main([*argv, "--threads", "1", "--emulation-slowdown", "1.5"])
    assert run.code == 0, run.stderr
    assert f"{TINY_GRID_POINTS} points measured ({TINY_GRID_POINTS} ok)" in run.stdout
    assert run.stderr == ""  # no progress bar when stderr is not a terminal
    with Store.open(url) as store:
        rows = store.profile_measurements()
    assert len(rows) == TINY_GRID_POINTS
    assert {(r.extra["threads"], r.emulation_slowdown) for r in rows} == {(1, 1.5)}
    again = run_main([*argv, "--threads", "1", "--emulation-slowdown", "1.5"])
    assert f"0 points measured (nothing new); {TINY_GRID_POINTS} already" in again.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--device", "gpu"], "argument --device: 'gpu' is not cpu, cuda or cuda:INDEX"),
        (["--device", "cuda", "--emulation-slowdown", "2"], "for --device cpu only"),
        (["--emulation-slowdown", "0.5"], "must be a finite number >= 1"),
        (["--threads", "0"], "must be at least 1"),
        (["--grid", "{missing}"], "cannot be read"),
        (["--grid", "{bad}"], "timing.samples: input should be greater than or equal to 10"),
        (["--store", "mysql://x/y"], "unsupported dialect 'mysql'"),
        (["--device-type", "H100-SXM"], "a CPU profile is of type cpu"),
        (["links", "--nproc", "1"], "a link needs at least 2 ranks"),
        (["--threads", "2", "links", "--nproc", "2"], "--threads is for compute sweeps"),
        (["links", "--nproc", "2", "--device", "cuda:1"], "links run on cpu or cuda"),
        (["links", "--nproc", "2", "--link-class", " "], "--link-class must not be empty"),
        (["links", "--nproc", "2", "--grid", "{no_links}"], "has no links section"),
    ],
)
def test_bad_input_is_one_line_and_creates_no_store(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    bad, no_links = tmp_path / "bad.yaml", tmp_path / "no_links.yaml"
    bad.write_text("name: b\ntiming: {samples: 3}\n", encoding="utf-8")
    no_links.write_text("name: n\nelementwise: {numels: [8]}\n", encoding="utf-8")
    paths = {"missing": tmp_path / "absent.yaml", "bad": bad, "no_links": no_links}
    args = [a.format(**paths) for a in args]
    store_path = tmp_path / "never.db"
    store_args = [] if "--store" in args else ["--store", f"sqlite:///{store_path}"]
    run = run_main(["profile", *store_args, *args])
    assert run.code == 2
    assert run.stderr.count("\n") == 1 and expected in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not store_path.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    store_path = tmp_path / "never.db"
    run = run_main(["profile", "--device", "cuda", "--store", f"sqlite:///{store_path}"])
    assert run.code == 2 and "0 CUDA device(s)" in run.stderr and run.stderr.count("\n") == 1
    assert not store_path.exists()


def test_importing_the_cli_does_not_import_torch() -> None:
    code = "import sys, hexiseq, hexiseq.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "--quick", "--device", "cuda", "links", "--nproc", "2"],
        ["profile", "links", "--nproc", "2", "--quick", "--device", "cuda"],
    ],
)
def test_shared_options_work_before_or_after_links(argv: list[str]) -> None:
    from hexiseq.cli import build_parser

    args = build_parser().parse_args(argv)
    assert (args.profile_target, args.quick, args.device, args.nproc) == ("links", True, "cuda", 2)
    assert args.store is None and args.threads is None  # main(): $HEXISEQ_STORE_URL or default


def test_profile_without_links_has_compute_defaults() -> None:
    from hexiseq.cli import build_parser

    args = build_parser().parse_args(["profile"])
    assert (args.profile_target, args.device, args.quick, args.grid) == (None, "cpu", False, None)
