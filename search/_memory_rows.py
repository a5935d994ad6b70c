"""The local stage's memory rows: every phase of the memory model as an affine function of a
class's units, the largest block and a member's state share (`local_milp._Model`), as
arrays and row blocks, each once per search and member kind."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from hexiseq.costmodel import memory_limit_bytes
from hexiseq.costmodel.memory import RankShape, rank_memory

if TYPE_CHECKING:
    from hexiseq.search.local_milp import _Model

ROW_FORMS = ("utilization", "slack", "limits")
"""How `phase_rows` gives a member's limit rows: each followed by its utilization row, each
with its own slack column, or alone."""


def phases_of(
    problem, gpu: str, heads: int, kv_heads: int, quantum: int, size: int, ring_groups: int
):
    """Every phase of the memory model (`costmodel.memory.PHASES`, each with its reserve and
    fragmentation) as ((per segment unit, per largest-block unit, per state share), constant)
    in bytes, where a member holds (u + 1) / size + 1 token units at most and its segment is
    u + 1 units."""
    calibration = problem.cost.memory_calibration(gpu)
    key = (gpu, heads, kv_heads, quantum, size, ring_groups)
    return _phases(problem.model, problem.train, calibration, *key)


@lru_cache(maxsize=1 << 14)
def _phases(
    model, train, calibration, gpu: str, heads: int, kv_heads: int, quantum, size, ring_groups
):
    """`phases_of`, by value: a pure function of the model, the step, the memory calibration
    and the member's shape, so searches of other clusters with these GPUs (and the same search
    run again) share it (on 64 GPUs of 8 types a search asks for 88 of these, 5 memory
    estimates each)."""
    block = 2 * quantum

    def phases(tokens: float, segment: float, largest: float, share: float) -> np.ndarray:
        shape = RankShape(
            tokens * block,
            segment * block,
            heads,
            kv_heads,
            largest * block if ring_groups > 1 else 0,
            gpu == "cpu",
            ring_groups,
        )
        m = rank_memory(model, train, shape, share, calibration)
        return np.array(m.peaks_by_phase(), dtype=float)

    base = phases(0, 0, 0, 0.0)
    per_token = phases(1, 0, 0, 0.0) - base
    per_segment = phases(0, 1, 0, 0.0) - base
    per_largest = phases(0, 0, 1, 0.0) - base
    per_share = phases(0, 0, 0, 1.0) - base
    per_unit = per_token / size + per_segment
    constant = base + per_token * (1.0 / size + 1.0) + per_segment * 1.0
    return tuple(
        ((per_unit[p], per_largest[p], per_share[p]), constant[p]) for p in range(len(base))
    )


def kinds_of(members: list) -> list[int]:
    """A kind index per member: members with the same memory rows and capacity share one."""
    seen: dict[tuple, int] = {}
    return [seen.setdefault((id(phases), capacity), len(seen)) for phases, capacity in members]


def phase_rows(problem, phases, capacity: float, columns: tuple, extra: int | None, form: str):
    """A member's memory rows, phase by phase, as fractions of `capacity`, as entries (row
    from 0, column, value) and row upper bounds. Each phase's limit row, coefficients /
    capacity x (u_c, B, f_cm) <= (95 % of capacity - constant) / capacity, in the `form`
    (ROW_FORMS): "utilization", then the same coefficients minus the `extra` column
    (utilization) <= -constant / capacity; "slack", with -1 x the `extra` column (its
    slack); "limits", alone (`extra` None). The same entries, in the same order, as adding
    each row on its own. Values once per search and member kind (its phases are kept once
    per search, so their identity names them), positions once per shape."""
    values, upper = problem.memo(
        ("phase rows", id(phases), capacity, form),
        lambda: _phase_values(problem, phases, capacity, form),
    )
    row_of, column_of = problem.memo(
        ("phase row positions", len(phases), columns, extra, form),
        lambda: _phase_positions(len(phases), columns, extra, form),
    )
    return row_of, column_of, values, upper


def phase_arrays(problem, phases) -> tuple[np.ndarray, np.ndarray]:
    """`phases` as [phase, 3] coefficients of (u_c, B, f_cm) and [phase] constants, once per
    search (a member's phases are kept once per search, so their identity names them)."""
    return problem.memo(
        ("phase arrays", id(phases)),
        lambda: (
            np.array([c for c, _ in phases], dtype=float).reshape(-1, 3),
            np.array([constant for _, constant in phases], dtype=float),
        ),
    )


def _phase_values(problem, phases, capacity: float, form: str) -> tuple[np.ndarray, np.ndarray]:
    coefficients, constants = phase_arrays(problem, phases)
    scaled = coefficients / capacity  # [phase, 3]
    limits = (memory_limit_bytes(int(capacity)) - constants) / capacity
    minus_one = np.full((len(constants), 1), -1.0)
    if form == "utilization":  # limit row: 3 entries; utilization row: the same 3 and -1
        values = np.hstack([scaled, scaled, minus_one]).ravel()
        return values, np.column_stack([limits, -constants / capacity]).ravel()
    if form == "slack":
        return np.hstack([scaled, minus_one]).ravel(), limits
    return scaled.ravel(), limits


def _phase_positions(
    phases: int, columns: tuple, extra: int | None, form: str
) -> tuple[np.ndarray, np.ndarray]:
    if form == "utilization":
        row_of = np.tile(np.array([0, 0, 0, 1, 1, 1, 1]), phases)
        row_of += np.repeat(2 * np.arange(phases), 7)
        return row_of, np.tile(np.array([*columns, *columns, extra]), phases)
    if form == "slack":
        return np.repeat(np.arange(phases), 4), np.tile(np.array([*columns, extra]), phases)
    return np.repeat(np.arange(phases), 3), np.tile(np.array(columns), phases)


@dataclass(frozen=True)
class GrowingRows:
    """The memory rows of every member kind that grow with its class's units (`_Model`'s
    unit ceilings), stacked: [row] coefficients of (u_c, B, f_cm) in bytes, the bytes left
    under the limit by the constant, the class and the state-share column of each row."""

    per_unit: np.ndarray
    per_largest: np.ndarray
    per_share: np.ndarray
    room: np.ndarray
    owner: np.ndarray
    share: np.ndarray

    @classmethod
    def of(cls, model: _Model) -> GrowingRows:
        blocks = []  # one (coefficients, room, class, share column) per member kind
        for c, members in enumerate(model.kind_members):
            for member in members:
                phases, capacity = model.memory[c][member]
                coefficients, constants = phase_arrays(model.problem, phases)
                grows = coefficients[:, 0] > 0
                room = memory_limit_bytes(int(capacity)) - constants[grows]
                blocks.append((coefficients[grows], room, c, int(model.f[c][member])))
        counts = [len(room) for _, room, _, _ in blocks]
        coefficients = np.concatenate([b[0] for b in blocks] or [np.zeros((0, 3))])
        per_unit, per_largest, per_share = coefficients.T
        return cls(
            per_unit,
            per_largest,
            per_share,
            room=np.concatenate([b[1] for b in blocks] or [np.zeros(0)]),
            owner=np.repeat([b[2] for b in blocks], counts).astype(int),
            share=np.repeat([b[3] for b in blocks], counts).astype(int),
        )
