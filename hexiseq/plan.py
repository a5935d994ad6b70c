"""Plans: a cluster, a model, a training spec, a CP-HP layout and what it is predicted to do.

`Plan.to_json(path)` / `Plan.from_json(path)` round-trip exactly (docs/design.md §4); the document
carries a `schema_version`. An infeasible candidate (a baseline that runs out of memory, or one
the homogeneous systems cannot express) is an `InfeasiblePlan` with the reason and the bytes
each rank is missing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hexiseq.cluster import Cluster
from hexiseq.errors import InputError
from hexiseq.layout import AttentionLayout
from hexiseq.model import ModelSpec, TrainSpec

PLAN_SCHEMA_VERSION = 3
"""The plan document version `to_json` writes. 2 added time parts to `predicted.ranks` and
renamed memory terms; 3 added data-parallel replicas (`replicas`, written when a plan has
more than one, and each assignment's `replica`)."""
READABLE_PLAN_SCHEMA_VERSIONS = (1, 2, 3)
PLAN_KEYS = (
    "schema_version",
    "name",
    "cluster",
    "model",
    "train",
    "layout",
    "assignments",
    "knobs",
    "predicted",
    "replicas",
)
"""The keys of a plan document (`Plan.to_dict`); others are refused on reading."""
"""Versions `from_json` reads: a version-1 document's ranks lack the parts version 2 added,
which then take their defaults (0.0 s); everything else is the same."""


@dataclass(frozen=True, slots=True)
class RankAssignment:
    """What one rank does: its GPU, HP group (ring position), heads, tokens and state share."""

    rank: int
    gpu: str
    node: str
    group: int
    head_range: tuple[int, int]
    tokens: int
    state_fraction: float
    """The rank's share of its replica's model states (the shares of a replica add up to 1)."""
    replica: int = field(default=0, kw_only=True)
    """The data-parallel replica the rank belongs to; `group`, `head_range` and `tokens` are
    in that replica's layout."""

    @property
    def heads(self) -> int:
        return self.head_range[1] - self.head_range[0]


@dataclass(frozen=True, slots=True)
class RankTime:
    """Where one rank's step time goes, in seconds; the parts add up to the step time.

    The last five parts came later: keyword-only with default 0.0, so a plan written before
    them still loads (its step time then sits in the first six)."""

    linear_s: float
    attention_s: float
    all_to_all_s: float
    ring_exposed_comm_s: float
    sharding_exposed_comm_s: float
    idle_s: float
    elementwise_s: float = field(default=0.0, kw_only=True)
    """Norms, RoPE, SwiGLU, residual adds, attention's transposes and softmax merge."""
    cast_s: float = field(default=0.0, kw_only=True)
    """Autocast's weight and activation casts (forward, recompute, backward)."""
    loss_s: float = field(default=0.0, kw_only=True)
    """Logit upcast, log-softmax, nll and their backward."""
    optimizer_s: float = field(default=0.0, kw_only=True)
    """AdamW (and gradient accumulation) on the rank's share of the model states."""
    launch_s: float = field(default=0.0, kw_only=True)
    """Kernel launch overhead beyond the kernels' own work (many short kernels)."""

    @property
    def step_s(self) -> float:
        return sum(getattr(self, key) for key in RankTime.__dataclass_fields__)

    @property
    def busy_s(self) -> float:
        """Time spent computing and communicating (everything but waiting on peers)."""
        return self.step_s - self.idle_s

    def to_dict(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in RankTime.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class RankPrediction(RankTime):
    """One rank's predicted time breakdown (s) and peak memory (bytes) by term."""

    memory_bytes: int
    memory_capacity_bytes: int
    memory_terms: dict[str, int] = field(default_factory=dict)

    @property
    def memory_fraction(self) -> float:
        return self.memory_bytes / self.memory_capacity_bytes


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the simulator predicts for a plan, and which cost model it used per GPU type."""

    step_time_s: float
    tokens_per_s: float
    ranks: tuple[RankPrediction, ...]
    cost_model: dict[str, str]

    @property
    def max_memory_fraction(self) -> float:
        return max(rank.memory_fraction for rank in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The `predicted` part of a plan document (JSON-ready)."""
        return _prediction_to_dict(self)


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica of a plan: a CP-HP mesh over its global `ranks` (layout rank
    i is `ranks[i]`) running its own `layout`, on `sequences` sequences per step."""

    ranks: tuple[int, ...]
    layout: AttentionLayout
    sequences: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "sequences": self.sequences,
            "layout": self.layout.to_dict(),
        }

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> Replica:
        unknown = sorted(set(document) - {"ranks", "sequences", "layout"})
        if unknown:
            raise InputError(
                f"replica: unknown key(s) {', '.join(map(str, unknown))}; a replica has "
                "ranks, sequences, layout"
            )
        ranks, sequences = document["ranks"], document["sequences"]
        if not isinstance(ranks, list) or not all(_whole(rank) for rank in ranks):
            raise InputError(f"replica: ranks must be a list of whole numbers (got {ranks!r})")
        if not _whole(sequences):
            raise InputError(f"replica: sequences must be a whole number (got {sequences!r})")
        return cls(tuple(ranks), AttentionLayout.from_dict(document["layout"]), sequences)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def replica_problems(replicas: tuple[Replica, ...], world_size: int, seq_len: int) -> list[str]:
    """What is wrong with a plan's replicas: every rank in exactly one, each layout made for
    its replica's size and the plan's sequence length, at least one sequence each."""
    ranks = sorted(rank for replica in replicas for rank in replica.ranks)
    if ranks != list(range(world_size)):
        return [f"replicas must hold every rank 0..{world_size - 1} exactly once"]
    problems = []
    for index, replica in enumerate(replicas):
        layout = replica.layout
        if layout.world_size != len(replica.ranks):
            problems.append(
                f"replica {index} has {len(replica.ranks)} ranks but a layout for "
                f"{layout.world_size}"
            )
        if layout.seq_len != seq_len:
            problems.append(
                f"replica {index}'s layout covers {layout.seq_len} tokens, not {seq_len}"
            )
        if replica.sequences < 1:
            problems.append(f"replica {index} takes {replica.sequences} sequences; at least 1")
    return problems


@dataclass(frozen=True)
class Plan:
    """A complete, executable plan (contract, docs/design.md §4).

    `replicas`: the data-parallel replicas, each a CP-HP mesh with its own layout and its own
    sequences per step (together `train.micro_batches`); left empty (or given one), the plan
    is one mesh over the whole cluster and `replicas` is that one, made from
    `attention_layout` and `train` (so `dataclasses.replace` of either keeps it true). A plan
    of several replicas keeps the first replica's layout as `attention_layout` (there is no
    one layout of the world then: `layout()` refuses, and each replica's is
    `replicas[i].layout`)."""

    name: str
    cluster: Cluster
    model: ModelSpec
    train: TrainSpec
    attention_layout: AttentionLayout
    assignments: tuple[RankAssignment, ...]
    knobs: dict[str, Any]
    predicted: Prediction
    replicas: tuple[Replica, ...] = ()

    def __post_init__(self) -> None:
        if len(self.replicas) <= 1:  # one mesh: always the plan's own layout and sequences
            world = tuple(range(self.attention_layout.world_size))
            one = Replica(world, self.attention_layout, self.train.micro_batches)
            object.__setattr__(self, "replicas", (one,))

    @property
    def data_parallel(self) -> bool:
        """Whether the plan runs several data-parallel replicas."""
        return len(self.replicas) > 1

    def layout(self) -> AttentionLayout:
        """The CP-HP layout this plan runs (one mesh over the whole cluster); a plan of
        several replicas has one per replica (`replicas[i].layout`) and raises InputError."""
        if self.data_parallel:
            raise InputError(
                f"plan {self.name} runs {len(self.replicas)} data-parallel replicas, each with "
                "its own layout: read plan.replicas[i].layout"
            )
        return self.attention_layout

    def replica_of(self, rank: int) -> Replica:
        """The replica that holds global `rank`."""
        return self.replicas[self.assignments[rank].replica]

    def rank_layout(self, rank: int) -> tuple[AttentionLayout, int]:
        """The layout global `rank` runs (its replica's) and its rank in that layout."""
        replica = self.replica_of(rank)
        return replica.layout, replica.ranks.index(rank)

    def replica_plan(self, index: int) -> Plan:
        """Replica `index` as a plan of one mesh on its own nodes (its ranks renumbered from
        0, `train.micro_batches` its sequences), with its ranks' part of this plan's
        prediction (their times include the wait for the slowest replica and the
        cross-replica gradient reduction)."""
        replica = self.replicas[index]
        if not self.data_parallel:
            return self
        devices = self.cluster.devices
        nodes = list(dict.fromkeys(devices[rank].node for rank in replica.ranks))
        cluster = self.cluster.subset(nodes, f"{self.cluster.name}[replica {index}]")
        train = dataclasses.replace(self.train, micro_batches=replica.sequences)
        assignments = tuple(
            dataclasses.replace(self.assignments[rank], rank=local, replica=0)
            for local, rank in enumerate(replica.ranks)
        )
        step_s = self.predicted.step_time_s
        predicted = Prediction(
            step_s,
            train.tokens_per_step / step_s,
            tuple(self.predicted.ranks[rank] for rank in replica.ranks),
            dict(self.predicted.cost_model),
        )
        name = f"{self.name} [replica {index}]"
        return Plan(name, cluster, self.model, train, replica.layout, assignments, {}, predicted)

    @property
    def cost_model_summary(self) -> str:
        """One label when every GPU type uses the same kind of model, else per type."""
        labels = set(self.predicted.cost_model.values())
        if len(labels) == 1:
            return labels.pop()
        return "; ".join(f"{gpu}: {label}" for gpu, label in self.predicted.cost_model.items())

    def to_dict(self) -> dict[str, Any]:
        replicas = [r.to_dict() for r in self.replicas] if self.data_parallel else None
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "name": self.name,
            "cluster": self.cluster.to_dict(),
            "model": self.model.to_dict(),
            "train": self.train.to_dict(),
            "layout": self.attention_layout.to_dict(),
            "assignments": [asdict(a) for a in self.assignments],
            "knobs": self.knobs,
            "predicted": _prediction_to_dict(self.predicted),
        } | ({"replicas": replicas} if replicas else {})

    def to_json_text(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_json(self, path: str | Path) -> None:
        """Write the plan as JSON (floats written exactly: `from_json` gives an equal plan),
        atomically: a temporary file beside it, flushed, then renamed over it, so a crash or a
        full disk leaves the old file whole."""
        path = Path(path)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(self.to_json_text() + "\n")
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def from_dict(cls, document: Any, source: str = "plan") -> Plan:
        """Rebuild a plan; `InputError` naming what is missing or wrong otherwise."""
        if not isinstance(document, dict):
            raise InputError(f"{source}: not a hexiseq plan (expected a JSON object)")
        version = document.get("schema_version")
        if type(version) is not int or version not in READABLE_PLAN_SCHEMA_VERSIONS:
            *earlier, last = map(str, READABLE_PLAN_SCHEMA_VERSIONS)
            readable = f"{', '.join(earlier)} and {last}"
            raise InputError(
                f"{source}: schema_version {version!r} is not supported; this hexiseq reads "
                f"versions {readable}"
            )
        unknown = sorted(set(document) - set(PLAN_KEYS))
        if unknown:
            raise InputError(
                f"{source}: unknown key(s) {', '.join(map(str, unknown))}; a plan has "
                f"{', '.join(PLAN_KEYS)}"
            )
        try:
            plan = _plan_from_dict(document, source)
        except KeyError as exc:
            raise InputError(f"{source}: not a hexiseq plan: missing field {exc}") from None
        except InputError as exc:
            message = str(exc)
            prefixed = message if message.startswith(source) else f"{source}: {message}"
            raise InputError(prefixed) from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: not a valid hexiseq plan: {exc}") from None
        _check_consistent(plan, source)
        return plan

    @classmethod
    def from_json_text(cls, text: str, source: str = "plan") -> Plan:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{source}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        return cls.from_dict(document, source)

    @classmethod
    def from_run_json_text(cls, text: str, source: str = "plan") -> Plan:
        """The plan a runtime run recorded, with the recipe it ran (`TrainSpec.runtime_recipe`).

        Runs record the plan with the recipe they ran. A run recorded before the recipe was
        recorded ran the runtime of its day: the `autocast` recipe on one rank, sharded
        states (FSDP2) on more."""
        plan = cls.from_json_text(text, source)
        document = json.loads(text)
        if "runtime_recipe" in document.get("train", {}):
            return plan
        recipe = "autocast" if plan.cluster.world_size == 1 else "sharded"
        return dataclasses.replace(
            plan, train=dataclasses.replace(plan.train, runtime_recipe=recipe)
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        """Read a plan written by `to_json`."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"plan file {path}: cannot be read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise InputError(
                f"plan file {path}: not UTF-8 text (byte {exc.start}); a plan is JSON as "
                "`hexiseq plan --out` writes it"
            ) from None
        return cls.from_json_text(text, source=f"plan file {path}")


@dataclass(frozen=True)
class InfeasiblePlan:
    """A candidate that cannot run: why, and how many bytes each rank lacks (0 if not memory)."""

    name: str
    reason: str
    missing_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def total_missing_bytes(self) -> int:
        return sum(self.missing_bytes.values())


def _plan_from_dict(document: dict[str, Any], source: str) -> Plan:
    cluster = Cluster.from_dict(document["cluster"], source=f"{source}: cluster")
    assignments = tuple(
        RankAssignment(**{**a, "head_range": tuple(a["head_range"])})
        for a in document["assignments"]
    )
    return Plan(
        name=document["name"],
        cluster=cluster,
        model=ModelSpec.from_dict(document["model"]),
        train=TrainSpec.from_dict(document["train"]),
        attention_layout=AttentionLayout.from_dict(document["layout"]),
        assignments=assignments,
        knobs=dict(document["knobs"]),
        predicted=_prediction_from_dict(document["predicted"]),
        replicas=_replicas_from(document),
    )


def _replicas_from(document: dict[str, Any]) -> tuple[Replica, ...]:
    replicas = document.get("replicas")
    if replicas is None:
        return ()
    if not isinstance(replicas, list) or len(replicas) < 2:
        raise InputError("replicas must be a list of at least two (one mesh leaves it out)")
    return tuple(Replica.from_dict(r) for r in replicas)


def _check_consistent(plan: Plan, source: str) -> None:
    """The parts of a plan must describe the same run."""
    world = plan.cluster.world_size
    problems = replica_problems(plan.replicas, world, plan.train.seq_len)
    if not problems and plan.data_parallel:
        problems += _whole_node_problems(plan)
    for replica in plan.replicas:
        layout = replica.layout
        if (layout.num_heads, layout.num_kv_heads) != (plan.model.heads, plan.model.kv_heads):
            problems.append("layout heads differ from the model's")
            break
    sequences = sum(replica.sequences for replica in plan.replicas)
    if sequences != plan.train.micro_batches:
        problems.append(
            f"the replicas take {sequences} sequences per step, train.micro_batches is "
            f"{plan.train.micro_batches}"
        )
    for what, items in (
        ("assignments", plan.assignments),
        ("predicted.ranks", plan.predicted.ranks),
    ):
        if len(items) != world:
            problems.append(f"{len(items)} {what} for {world} devices")
    if any(rank.memory_capacity_bytes <= 0 for rank in plan.predicted.ranks):
        problems.append("a memory_capacity_bytes is not positive")
    if not problems:  # the per-rank checks need matching lengths
        problems += _assignment_problems(plan) + _prediction_problems(plan.predicted)
    if problems:
        raise InputError(f"{source}: inconsistent plan: {'; '.join(problems[:3])}")


def _whole_node_problems(plan: Plan) -> list[str]:
    """A plan's replicas are whole nodes, each replica's ranks in cluster order."""
    devices = plan.cluster.devices
    for index, replica in enumerate(plan.replicas):
        nodes = {devices[rank].node for rank in replica.ranks}
        whole = sorted(d.rank for d in devices if d.node in nodes)
        if list(replica.ranks) != whole:
            return [
                f"replica {index} must hold whole nodes, its ranks in cluster order (ranks "
                f"{whole[0]}..{whole[-1]} of {', '.join(sorted(nodes))})"
            ]
    return []


def _assignment_problems(plan: Plan) -> list[str]:
    """Each rank's assignment must be what its replica's layout and the cluster say, its state
    share a finite non-negative number, and each replica's shares must add up to 1."""
    devices = plan.cluster.devices
    where = {
        rank: (index, local)
        for index, replica in enumerate(plan.replicas)
        for local, rank in enumerate(replica.ranks)
    }
    problems = []
    for index, a in enumerate(plan.assignments):
        device = devices[index]
        replica, local = where[index]
        layout = plan.replicas[replica].layout
        if a.replica != replica:
            problems.append(f"assignment {index} says replica {a.replica}, the plan {replica}")
            continue
        expected = (index, device.gpu, device.node, layout.num_tokens(local))
        if (a.rank, a.gpu, a.node, a.tokens) != expected:
            problems.append(
                f"assignment {index} says rank {a.rank}, {a.gpu} on {a.node}, {a.tokens} tokens; "
                f"the cluster and layout say rank {index}, {device.gpu} on {device.node}, "
                f"{expected[3]} tokens"
            )
        elif tuple(a.head_range) != tuple(layout.head_ranges[local]):
            problems.append(f"assignment {index} heads {a.head_range} differ from the layout's")
        if not (math.isfinite(a.state_fraction) and a.state_fraction >= 0):
            problems.append(f"assignment {index} has state_fraction {a.state_fraction}")
    for replica_index, replica in enumerate(plan.replicas):
        total = math.fsum(plan.assignments[rank].state_fraction for rank in replica.ranks)
        if not problems and abs(total - 1.0) > 1e-6:
            owner = f" of replica {replica_index}" if plan.data_parallel else ""
            problems.append(f"state fractions{owner} add up to {total:g}, not 1")
    return problems


ROUNDING_S = 1e-9  # a part computed as a difference may come out a rounding error below zero


def _prediction_problems(predicted: Prediction) -> list[str]:
    """Predictions must be finite: a positive step time and throughput, non-negative parts."""
    problems = []
    for name in ("step_time_s", "tokens_per_s"):
        value = getattr(predicted, name)
        if not (math.isfinite(value) and value > 0):
            problems.append(f"predicted.{name} is {value}")
    for index, rank in enumerate(predicted.ranks):
        bad = [
            key
            for key, value in rank.to_dict().items()
            if not (math.isfinite(value) and value >= -ROUNDING_S)
        ]
        if bad or not rank.memory_bytes >= 0:
            problems.append(
                f"predicted.ranks[{index}] has {', '.join(bad) or 'memory_bytes'} "
                "negative or not finite"
            )
            break
    return problems


def _prediction_to_dict(prediction: Prediction) -> dict[str, Any]:
    return {
        "step_time_s": prediction.step_time_s,
        "tokens_per_s": prediction.tokens_per_s,
        "cost_model": prediction.cost_model,
        "ranks": [asdict(rank) for rank in prediction.ranks],
    }


def _prediction_from_dict(document: dict[str, Any]) -> Prediction:
    return Prediction(
        step_time_s=float(document["step_time_s"]),
        tokens_per_s=float(document["tokens_per_s"]),
        ranks=tuple(RankPrediction(**rank) for rank in document["ranks"]),
        cost_model=dict(document["cost_model"]),
    )
