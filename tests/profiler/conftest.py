"""Shared fixtures of the profiler tests: a tiny grid file and a sweep over it on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from profiler_cases import TINY_GRID

from hexiseq.profiler import ComputeSweep, describe_device, load_grid
from hexiseq.store import Store


@pytest.fixture
def tiny_grid_path(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_GRID, encoding="utf-8")
    return path


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(f"sqlite:///{tmp_path / 'profiles.db'}") as opened:
        yield opened


@pytest.fixture
def tiny_sweep(tiny_grid_path: Path) -> ComputeSweep:
    device = torch.device("cpu")
    return ComputeSweep(
        grid=load_grid(tiny_grid_path),
        grid_name="tiny",
        device=device,
        identity=describe_device(device),
        command="test sweep",
    )
