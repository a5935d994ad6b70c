"""A store on a full disk (a small tmpfs; needs root to mount, skipped otherwise): a write is
one `StoreError` line naming the store, the CLI exits with one line, every row written before
stays, and the store writes again once space is freed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_runner import run_main

from hexiseq import StoreError
from hexiseq.search import plan_search
from hexiseq.store import Store


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb") as file:
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError:
            pass
    return filler


def test_a_write_on_a_full_disk_is_one_line_and_loses_nothing(small_disk):
    plan = plan_search("h100x8-a100x8", "llama3-8b", "64k").best
    url = f"sqlite:///{small_disk / 'store.db'}"
    with Store.open(url) as store:
        first = store.save_plan_object(plan, "before")
    filler = _fill(small_disk)
    with Store.open(url) as store:
        with pytest.raises(StoreError, match=rf"store {url}: database or disk is full"):
            for _ in range(200):  # the file's free pages run out within a few plans
                store.save_plan_object(plan, "on a full disk")
        run = run_main(["plan", "--cluster", "h100x8-a100x8", "--model", "llama3-8b",
                        "--seq-len", "64k", "--store", url])  # fmt: skip
        assert run.code == 2 and run.stderr.count("\n") == 1 and "disk is full" in run.stderr
        assert first in {record.id for record in store.list_plans()}
    filler.unlink()
    with Store.open(url) as store:
        assert store.save_plan_object(plan, "after") > first
