"""What the step simulator carries between events: per-plan constants and per-rank time books."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel.base import CostModel
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec

BREAKDOWN_KEYS = (
    "linear_s",
    "attention_s",
    "all_to_all_s",
    "ring_exposed_comm_s",
    "sharding_exposed_comm_s",
    "idle_s",
)


@dataclass
class SimContext:
    """Per-plan constants the layer simulation reads (arrays indexed by rank)."""

    cluster: Cluster
    model: ModelSpec
    train: TrainSpec
    layout: AttentionLayout
    cost: CostModel
    gpus: list[str]
    nodes: list[str]
    slowdown: np.ndarray
    group_of: np.ndarray


class Ledger:
    """Per-rank accumulators of the breakdown categories."""

    def __init__(self, world_size: int) -> None:
        self.parts = {key: np.zeros(world_size) for key in BREAKDOWN_KEYS}

    def add(self, key: str, seconds: np.ndarray | float) -> None:
        self.parts[key] = self.parts[key] + seconds

    def scaled(self, factor: float) -> Ledger:
        copy = Ledger(len(self.parts["linear_s"]))
        copy.parts = {key: value * factor for key, value in self.parts.items()}
        return copy

    def merge(self, other: Ledger) -> None:
        for key, value in other.parts.items():
            self.parts[key] = self.parts[key] + value

    def total(self) -> np.ndarray:
        return sum(self.parts.values())
