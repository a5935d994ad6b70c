"""Cache capacities: read from sysfs as lscpu does, recorded in every compute row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hexiseq.profiler import ComputeSweep, run_compute_sweep
from hexiseq.profiler._device import parse_cache_size, read_cache_bytes
from hexiseq.store import Store


def _fake_cache(root: Path, entries: list[tuple[int, str, str]]) -> Path:
    for index, (level, kind, size) in enumerate(entries):
        folder = root / f"index{index}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    return root


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48K", 48 * 1024),
        ("2048K", 2 * 1024**2),
        ("480M", 480 * 1024**2),
        ("1G", 1024**3),
        ("65536", 65536),
    ],  # fmt: skip
)
def test_cache_sizes_parse_as_sysfs_writes_them(text: str, expected: int) -> None:
    assert parse_cache_size(text) == expected


def test_l2_and_last_level_are_read_skipping_instruction_caches(tmp_path: Path) -> None:
    sysfs = _fake_cache(
        tmp_path,
        [
            (1, "Data", "48K"),
            (1, "Instruction", "64K"),
            (2, "Unified", "2048K"),
            (3, "Unified", "491520K"),
        ],  # fmt: skip
    )
    assert read_cache_bytes(torch.device("cpu"), sysfs) == {
        "l2_bytes": 2 * 1024**2,
        "llc_bytes": 480 * 1024**2,
    }


def test_no_cache_information_is_an_empty_record(tmp_path: Path) -> None:
    assert read_cache_bytes(torch.device("cpu"), tmp_path / "missing") == {}
    sysfs = _fake_cache(tmp_path / "bad", [(2, "Unified", "lots")])
    assert read_cache_bytes(torch.device("cpu"), sysfs) == {}


def test_every_compute_row_records_the_cache_sizes(store: Store, tiny_sweep) -> None:
    cache = {"l2_bytes": 1024**2, "llc_bytes": 32 * 1024**2}
    identity = tiny_sweep.identity.__class__(**{**vars(tiny_sweep.identity), "cache_bytes": cache})
    sweep = ComputeSweep(**{**vars(tiny_sweep), "identity": identity})
    run_compute_sweep(store, sweep, show_progress=False)
    rows = store.profile_measurements()
    assert rows and all(row.extra["l2_bytes"] == 1024**2 for row in rows)
    assert all(row.extra["llc_bytes"] == 32 * 1024**2 for row in rows)
