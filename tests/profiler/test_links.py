"""`hexiseq profile links` under torchrun (gloo, 2 ranks): rows for every op, resume, and
failures that every rank records instead of hanging (test tier 3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hexiseq.profiles import LINK_OPS, measurement_key
from hexiseq.store import Store

pytestmark = pytest.mark.multiproc
TIMEOUT_S = 180
LINK_POINTS = 2 * (len(LINK_OPS) + 1)  # 1 KiB and 2 KiB; p2p in both directions

INJECT_FAILURES = """\
import sys
from hexiseq.profiler import _link_ops, links

real_link_op = _link_ops._link_op

def failing_link_op(point, rank, world):
    if point.op == "all_gather" and rank == 1:
        raise RuntimeError("injected on rank 1 only")
    if point.op == "reduce_scatter":
        def unsupported(send, out):
            raise RuntimeError("backend does not support reduce_scatter")
        return unsupported
    return real_link_op(point, rank, world)

real_fitting_count = _link_ops._fitting_count

def all_to_all_largest_does_not_fit(points, device, input_sets):
    fitting = real_fitting_count(points, device, input_sets)
    return fitting - 1 if points[0].op == "all_to_all" else fitting

_link_ops._link_op = failing_link_op
_link_ops._fitting_count = all_to_all_largest_does_not_fit
sys.exit(links.main(sys.argv[1:]))
"""


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_link_sweep_writes_every_op_and_resumes(tmp_path: Path, tiny_grid_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'links.db'}"
    command = [sys.executable, "-m", "hexiseq.cli", "profile", "links", "--nproc", "2",
               "--quick", "--grid", str(tiny_grid_path), "--store", url]  # fmt: skip
    first = _run(command)
    assert first.returncode == 0, first.stderr[-2000:]
    with Store.open(url) as store:
        rows = store.profile_measurements()
    assert len(rows) == LINK_POINTS
    assert {r.op for r in rows} == set(LINK_OPS)
    for row in rows:
        assert row.link_class == "intra:cpu"
        assert row.extra == {"backend": "gloo", "world": 2, "rounds": 5}
        assert row.params["world"] == 2 and row.params["message_bytes"] in (1024, 2048)
        if row.status == "ok":  # gloo may lack a collective: then a one-line error row
            assert row.samples == 10 and row.p10_s <= row.median_s <= row.p90_s
        else:
            assert row.status == "error" and row.error and "\n" not in row.error
    assert len({measurement_key(r) for r in rows}) == LINK_POINTS
    second = _run([*command, "--link-class", "intra:cpu"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"0 points measured (nothing new); {LINK_POINTS} already" in second.stdout


def test_failures_on_one_or_all_ranks_are_recorded(tmp_path: Path, tiny_grid_path: Path) -> None:
    script = tmp_path / "inject.py"
    script.write_text(INJECT_FAILURES, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'links.db'}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(script), f"--grid={tiny_grid_path}", f"--store={url}",
               "--link-class=inter"]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-2000:]
    with Store.open(url) as store:
        rows = store.profile_measurements(link_class="inter")
    statuses = {(r.op, r.params["message_bytes"], r.status) for r in rows}
    assert statuses == {
        ("p2p", 1024, "ok"), ("p2p", 2048, "ok"),
        ("all_to_all", 1024, "ok"), ("all_to_all", 2048, "oom"),
        ("all_gather", 1024, "error"), ("all_gather", 2048, "error"),
        ("reduce_scatter", 1024, "error"), ("reduce_scatter", 2048, "error"),
    }  # fmt: skip
    too_big = next(r for r in rows if r.status == "oom")
    assert (
        too_big.error.startswith("MemoryError: needs about") and "not attempted" in too_big.error
    )
    assert too_big.samples == 0 and too_big.median_s is None
    errors = {r.op: r.error for r in rows if r.status == "error"}
    assert errors["all_gather"] == "rank 1: RuntimeError: injected on rank 1 only"
    assert errors["reduce_scatter"] == "RuntimeError: backend does not support reduce_scatter"
