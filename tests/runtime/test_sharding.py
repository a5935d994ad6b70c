"""Sharded model states (`runtime.sharding`): shares, gathers, mixed precision, on CPU.

One process (no process group: one rank holds every shard) checks the mechanics against the
unsharded model on fresh random tokens; the multi-rank cases, uneven shares included, are in
`model_cases` (tier 2) and `test_sharding_bf16_ranks` below.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from hexiseq import ModelSpec
from hexiseq.runtime.loss import chunked_next_token_loss, next_token_labels
from hexiseq.runtime.model import LocalAttention, build_model
from hexiseq.runtime.sharding import shard_counts, shard_model_states

SPEC = ModelSpec.preset("tiny")
SEQ_LEN = 48


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(
        0, SPEC.vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed)
    )


def step(model, batch: torch.Tensor, group=None) -> torch.Tensor:
    positions = torch.arange(SEQ_LEN)
    hidden = model.hidden_states(batch, positions)
    labels = next_token_labels(batch, positions)
    loss = chunked_next_token_loss(
        hidden, model.lm_head.weight, labels, chunk_tokens=17, group=group
    )
    loss.local_share.backward()
    return loss.global_loss


def reference(seed: int, batch: torch.Tensor, checkpointing: bool, group=None):
    """The plain model's loss and gradients on the whole batch (`group`: a process group
    of this rank alone, inside a multi-rank test)."""
    model = build_model(SPEC, LocalAttention(), seed=seed, checkpointing=checkpointing)
    loss = step(model, batch, group)
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("total", "fractions", "expected"),
    [
        (10, [0.5, 0.5], (5, 5)),
        (10, [0.25, 0.75], (3, 7)),  # 2.5 and 7.5: the tie goes to the lower rank's remainder
        (7, [1 / 3] * 3, (3, 2, 2)),
        (9, [0.6, 0.4, 0.0], (5, 4, 0)),
    ],
)
def test_shard_counts_follow_the_fractions_and_add_up(total, fractions, expected):
    assert shard_counts(total, fractions) == expected
    assert sum(shard_counts(total, fractions)) == total


@pytest.mark.parametrize("fractions", [[], [-0.1, 1.1], [0.0, 0.0]])
def test_shard_counts_reject_what_cannot_be_shares(fractions):
    with pytest.raises(ValueError, match="fractions"):
        shard_counts(10, fractions)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_rank_sharded_model_equals_the_plain_model(checkpointing):
    """Same loss and gradients as the unsharded model, and each block's weights gathered
    only while it runs: once in the forward, once more in the backward (re-gathered for its
    saved tensors, or for the checkpoint's recompute); the root stays gathered throughout."""
    batch = tokens(7)
    want_loss, want_grads = reference(3, batch, checkpointing)
    model = build_model(SPEC, LocalAttention(), device="meta", checkpointing=checkpointing)
    states = shard_model_states(model, seed=3, device="cpu")
    root, *blocks = states.units
    positions = torch.arange(SEQ_LEN)
    hidden = model.hidden_states(batch, positions)
    assert root.gathered and not any(unit.gathered for unit in blocks)
    assert [unit.gathers for unit in states.units] == [1] * (SPEC.layers + 1)
    loss = chunked_next_token_loss(
        hidden, model.lm_head.weight, next_token_labels(batch, positions), chunk_tokens=17
    )
    loss.local_share.backward()
    assert [unit.gathers for unit in blocks] == [2] * SPEC.layers
    assert root.gathers == 1 and not root.gathered and model.lm_head.weight is None
    assert relative_error(loss.global_loss, want_loss) <= 1e-5
    grads = states.full_gradients()
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, want_grads[name]) <= 1e-5, name


def test_the_meta_build_draws_the_values_of_the_plain_build():
    model = build_model(SPEC, LocalAttention(), device="meta")
    states = shard_model_states(model, seed=5, device="cpu")
    plain = dict(build_model(SPEC, LocalAttention(), seed=5).named_parameters())
    whole = states.full_parameters()
    assert whole.keys() == plain.keys()
    for name, value in whole.items():
        assert torch.equal(value, plain[name].detach()), name
    assert [p.dtype for p in model.parameters()] == [torch.float32] * (SPEC.layers + 1)


def test_bf16_compute_keeps_fp32_masters_and_gradients():
    """The model computes in bf16 from the gathered weights; masters, their gradients and
    the reduction stay FP32, and the result is the FP32 model's to bf16 accuracy."""
    batch = tokens(8)
    want_loss, want_grads = reference(4, batch, False)
    model = build_model(SPEC, LocalAttention(), device="meta")
    states = shard_model_states(model, compute_dtype=torch.bfloat16, seed=4, device="cpu")
    seen = []
    model.blocks[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loss = step(model, batch)
    assert seen == [torch.bfloat16]
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    assert relative_error(loss, want_loss) <= 1e-2
    grads = states.full_gradients()
    for name, grad in grads.items():
        assert relative_error(grad, want_grads[name]) <= 5e-2, name


def _bf16_uneven_ranks(rank: int, world_size: int) -> None:
    """Two gloo ranks, shares 0.7 / 0.3, each a whole copy of the sequence's half of the
    batch: the reduced gradient is the sum of both ranks' parts, in bf16 compute."""
    batch = tokens(9)
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    want_loss, want_grads = reference(6, batch, False, alone)
    model = build_model(SPEC, LocalAttention(), device="meta")
    states = shard_model_states(
        model, [0.7, 0.3], compute_dtype=torch.bfloat16, seed=6, device="cpu"
    )
    planned = sum(shard_counts(unit.numel, [0.7, 0.3])[rank] for unit in states.units)
    assert states.master_elements() == planned
    assert abs(planned - [0.7, 0.3][rank] * SPEC.params) <= len(states.units)
    positions = torch.arange(SEQ_LEN)
    hidden = model.hidden_states(batch[rank : rank + 1], positions)
    labels = next_token_labels(batch[rank : rank + 1], positions)
    loss = chunked_next_token_loss(hidden, model.lm_head.weight, labels)  # a global mean
    loss.local_share.backward()
    assert relative_error(loss.global_loss, want_loss) <= 1e-2
    for name, grad in states.full_gradients().items():
        error = relative_error(grad, want_grads[name])
        assert error <= 5e-2, f"rank {rank} {name} {error}"


@pytest.mark.multiproc
def test_sharding_bf16_ranks():
    run_distributed(_bf16_uneven_ranks, 2)
