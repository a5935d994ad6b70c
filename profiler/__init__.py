"""Microbenchmarks on one device and on links, written to the store (docs/design.md §5).

- Compute sweep (`run_compute_sweep`, CLI `hexiseq profile --device ...`): GEMMs of the linear
  layers, attention forward/backward with the runtime's own kernels, an elementwise
  bandwidth kernel; one `hexiseq.profiles.ProfileMeasurement` per point.
- Link sweep (`python -m hexiseq.profiler.links` under torchrun, CLI `hexiseq profile links`):
  p2p ring exchanges, all-to-all, all-gather and reduce-scatter over message sizes.

The grid of sizes is a YAML file (`grids/full.yaml`, `grids/quick.yaml`, or the user's own).
Sweeps resume: points already in the store are skipped. The grid names load without torch;
the sweep names import torch on first use (PEP 562).
"""

from __future__ import annotations

from typing import Any

from ._grid import BUILTIN_GRIDS, Grid, builtin_grid_path, load_grid

_LAZY = {
    "ComputeSweep": "._sweep",
    "SweepSummary": "._sweep",
    "run_compute_sweep": "._sweep",
    "measure_family": "._sweep",
    "DeviceIdentity": "._device",
    "describe_device": "._device",
    "parse_device": "._device",
    "check_device_available": "._device",
    "check_cuda_ranks": "._device",
    "set_threads": "._device",
}

__all__ = ["BUILTIN_GRIDS", "Grid", "builtin_grid_path", "load_grid", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'hexiseq.profiler' has no attribute '{name}'")
