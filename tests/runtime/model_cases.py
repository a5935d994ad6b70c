"""Model cases for the tier-2 tests: a sharded `LlamaModel` against the single-process model.

Importable by name (the workers run in processes spawned by `run_distributed`) and seeded, so
every rank builds the same layouts, parameters and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as functional

from hexiseq import AttentionLayout, ModelSpec, build_zigzag_layout

TOLERANCE = 1e-5  # relative error (Frobenius norm) of fp32 ranks against the float64 reference


@dataclass(frozen=True)
class ModelCase:
    """One training step to check: a model preset, a layout, the batch and the seeds."""

    model: str
    layout: AttentionLayout
    batch: int
    seed: int
    checkpointing: bool = False
    sharded: bool = False  # model states sharded (runtime.sharding) instead of replicated
    state_fractions: tuple[float, ...] | None = None  # each rank's share; None = even


def zigzag(model: str, groups, segments, token_weights, head_counts) -> AttentionLayout:
    spec = ModelSpec.preset(model)
    return build_zigzag_layout(
        sum(segments), spec.heads, spec.kv_heads, groups, segments, token_weights, head_counts
    )


# Uneven segments, uneven tokens inside a group, uneven heads; 'tiny' has GQA ratio 4 (so
# K/V heads are shared at head boundaries), 'tiny-7h' 7 heads split 4/3, 2/5, ...
CASES: dict[int, list[ModelCase]] = {
    1: [ModelCase("tiny", zigzag("tiny", [[0]], [24], [[1]], [[8]]), 2, 11)],
    2: [
        ModelCase("tiny", zigzag("tiny", [[1, 0]], [36], [[1, 3]], [[5, 3]]), 2, 21),
        ModelCase(
            "tiny-7h", zigzag("tiny-7h", [[0], [1]], [24, 14], [[1], [1]], [[7], [7]]), 1, 22
        ),
        ModelCase(  # activation checkpointing: the recompute repeats the ring
            "tiny-7h", zigzag("tiny-7h", [[1], [0]], [16, 22], [[1], [1]], [[7], [7]]), 2, 23, True
        ),
    ],
    3: [
        ModelCase(
            "tiny", zigzag("tiny", [[2, 0], [1]], [28, 12], [[2, 1], [1]], [[3, 5], [8]]), 2, 31
        ),
        ModelCase(
            "tiny-7h", zigzag("tiny-7h", [[0, 1, 2]], [42], [[1, 2, 4]], [[2, 4, 1]]), 1, 32
        ),
        ModelCase(  # sharded states, even shares
            "tiny",
            zigzag("tiny", [[1], [2, 0]], [20, 20], [[1], [3, 1]], [[8], [2, 6]]),
            1,
            33,
            sharded=True,
        ),
        ModelCase(  # uneven shares over mixed HP group sizes (one rank holds none)
            "tiny",
            zigzag("tiny", [[1], [2, 0]], [20, 20], [[1], [3, 1]], [[8], [2, 6]]),
            2,
            34,
            sharded=True,
            state_fractions=(0.55, 0.45, 0.0),
        ),
    ],
    4: [
        ModelCase(
            "tiny",
            zigzag("tiny", [[3, 1], [0, 2]], [30, 18], [[3, 1], [1, 2]], [[1, 7], [6, 2]]),
            2,
            41,
            checkpointing=True,
            sharded=True,
            state_fractions=(0.1, 0.4, 0.2, 0.3),
        ),
        ModelCase(
            "tiny-7h",
            zigzag(
                "tiny-7h", [[2], [0, 3], [1]], [20, 16, 8], [[1], [1, 1], [1]], [[7], [4, 3], [7]]
            ),
            1,
            42,
        ),
    ],
}


def case_tokens(case: ModelCase) -> torch.Tensor:
    """Fresh random token ids (B, S) of the whole sequence, the same on every rank."""
    vocab = ModelSpec.preset(case.model).vocab
    generator = torch.Generator().manual_seed(case.seed)
    return torch.randint(0, vocab, (case.batch, case.layout.seq_len), generator=generator)


def reference_step(case: ModelCase) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the single-process model on the whole sequence, in float64, with
    the textbook loss: mean cross-entropy of logits[:, :-1] against tokens[:, 1:]."""
    from hexiseq.runtime.model import LocalAttention, build_model

    spec = ModelSpec.preset(case.model)
    model = build_model(spec, LocalAttention(), seed=case.seed, dtype=torch.float64)
    tokens = case_tokens(case)
    logits = model(tokens, torch.arange(case.layout.seq_len))
    loss = functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def sharded_step(case: ModelCase, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and all-reduced gradients of this rank's fp32 `LlamaModel` over `CPHPAttention`."""
    from hexiseq.runtime import CPHPAttention
    from hexiseq.runtime.loss import (
        all_reduce_gradients,
        next_token_labels,
        sharded_next_token_loss,
    )
    from hexiseq.runtime.model import build_model, token_positions
    from hexiseq.runtime.sharding import full_gradients, shard_counts, shard_model_states

    spec = ModelSpec.preset(case.model)
    attention = CPHPAttention(case.layout)
    model = build_model(spec, attention, seed=case.seed, checkpointing=case.checkpointing)
    if case.sharded:
        states = shard_model_states(model, case.state_fractions)
        fractions = case.state_fractions or (1 / case.layout.world_size,) * case.layout.world_size
        planned = sum(shard_counts(u.numel, fractions)[rank] for u in states.units)
        assert sum(p.numel() for p in model.parameters()) == planned  # this rank's share only
        assert abs(planned - fractions[rank] * spec.params) <= len(states.units)
    calls = []
    attention.register_forward_hook(lambda *_: calls.append(1))
    tokens = case_tokens(case)
    positions = token_positions(case.layout, rank)
    logits = model(tokens[:, positions], positions)
    loss = sharded_next_token_loss(logits, next_token_labels(tokens, positions))
    loss.local_share.backward()
    # Checkpointing runs every layer's attention again in the backward pass.
    assert len(calls) == spec.layers * (2 if case.checkpointing else 1)
    if not case.sharded:
        all_reduce_gradients(list(model.parameters()))
    assert loss.labelled_tokens == case.batch * (case.layout.seq_len - 1)
    return loss.global_loss.item(), full_gradients(model)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.norm().item()
    difference = (actual.double() - expected.double()).norm().item()
    return difference / scale if scale > 0 else difference


def check_model_cases(rank: int, world_size: int) -> None:
    """Tier-2 worker: every case of this world size, loss and every parameter gradient."""
    torch.manual_seed(1234 + rank)  # nothing may depend on the global RNG
    for case in CASES[world_size]:
        loss, grads = sharded_step(case, rank)
        want_loss, want_grads = reference_step(case)
        loss_error = abs(loss - want_loss) / abs(want_loss)
        assert loss_error <= TOLERANCE, f"rank {rank} loss error {loss_error:.2e} in {case}"
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            error = relative_error(grad, want_grads[name])
            assert error <= TOLERANCE, f"rank {rank} {name} grad error {error:.2e} in {case}"


@dataclass(frozen=True)
class ReplicaCase:
    """A step over data-parallel replicas: each replica's global ranks, layout and sequences."""

    model: str
    replicas: tuple  # of runtime.replicas.Replica
    seed: int

    @property
    def sequences(self) -> int:
        return sum(replica.sequences for replica in self.replicas)


def replica_tokens(case: ReplicaCase) -> torch.Tensor:
    """Fresh random token ids (N, S) of every sequence of the step, the same on every rank."""
    vocab = ModelSpec.preset(case.model).vocab
    generator = torch.Generator().manual_seed(case.seed)
    seq_len = case.replicas[0].layout.seq_len
    return torch.randint(0, vocab, (case.sequences, seq_len), generator=generator)


def replica_reference(case: ReplicaCase) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the single-process float64 model on the whole batch: the mean
    cross-entropy over every labelled token of every sequence."""
    from hexiseq.runtime.model import LocalAttention, build_model

    spec = ModelSpec.preset(case.model)
    model = build_model(spec, LocalAttention(), seed=case.seed, dtype=torch.float64)
    tokens = replica_tokens(case)
    logits = model(tokens, torch.arange(tokens.shape[1]))
    loss = functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def check_replica_case(rank: int, world_size: int, case: ReplicaCase) -> None:
    """Worker: this rank's replica step (fp32) against the single-process reference."""
    from hexiseq.runtime import CPHPAttention
    from hexiseq.runtime.model import build_model
    from hexiseq.runtime.replicas import check_replicas, own_replica, replica_groups, replica_step
    from hexiseq.runtime.sharding import full_gradients

    torch.manual_seed(4321 + rank)  # nothing may depend on the global RNG
    check_replicas(case.replicas, world_size)
    groups = replica_groups(case.replicas)
    index = own_replica(case.replicas, rank)
    attention = CPHPAttention(case.replicas[index].layout, groups[index])
    model = build_model(ModelSpec.preset(case.model), attention, seed=case.seed)
    step = replica_step(model, case.replicas, rank, replica_tokens(case))
    want_loss, want_grads = replica_reference(case)
    assert step.labelled_tokens == case.sequences * (replica_tokens(case).shape[1] - 1)
    loss_error = abs(step.loss - want_loss) / abs(want_loss)
    assert loss_error <= TOLERANCE, f"rank {rank} loss error {loss_error:.2e}"
    grads = full_gradients(model)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        error = relative_error(grad, want_grads[name])
        assert error <= TOLERANCE, f"rank {rank} {name} grad error {error:.2e}"
