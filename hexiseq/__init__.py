"""hexiseq: asymmetric context/head parallelism for long-context training on mixed GPUs.

Public API. `import hexiseq` loads only the core (no torch, no streamlit, no optimizer
libraries); `plan_search`, `SearchResult`, `predict` and the runtime's names load on first
use.
"""

from __future__ import annotations

from typing import Any

from hexiseq.catalog import GpuSpec, gpu_catalog, gpu_spec
from hexiseq.cluster import Cluster, Device, cluster_presets
from hexiseq.errors import HexiseqError, InfeasibleError, InputError, StoreError
from hexiseq.layout import AttentionLayout, build_uniform_layout, build_zigzag_layout
from hexiseq.model import ModelSpec, TrainSpec, model_presets
from hexiseq.plan import InfeasiblePlan, Plan, Replica
from hexiseq.units import parse_seq_len

__version__ = "0.1.0"

_LAZY = {
    "plan_search": "hexiseq.search",
    "SearchResult": "hexiseq.search",
    "predict": "hexiseq.search.predict",
    "CPHPAttention": "hexiseq.runtime",
}

__all__ = [
    "AttentionLayout",
    "Cluster",
    "Device",
    "GpuSpec",
    "HexiseqError",
    "InfeasibleError",
    "StoreError",
    "InfeasiblePlan",
    "InputError",
    "ModelSpec",
    "Plan",
    "Replica",
    "TrainSpec",
    "build_uniform_layout",
    "build_zigzag_layout",
    "cluster_presets",
    "gpu_catalog",
    "gpu_spec",
    "model_presets",
    "parse_seq_len",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    """Load the search and runtime names on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hexiseq' has no attribute '{name}'")
