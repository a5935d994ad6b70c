"""Random layouts, a single-process reference and the per-rank checks of the runtime tests.

Shared by the tier-0/1 tests (imported directly) and the tier-2 workers (run in spawned
processes by `run_distributed`, so everything here is importable by name and seeded).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from hexiseq import AttentionLayout, build_zigzag_layout

TOLERANCE = 1e-5  # fp32 relative error (Frobenius norm) against the float64 reference
CONDITIONING_FACTOR = 10
"""Where the inputs make a gradient ill-conditioned (a nearly one-hot softmax: dq the small
difference of large terms), no fp32 computation reaches TOLERANCE: on seed 973241 (2 tokens,
causal) the plain single-process fp32 attention's dq was 6.7e-6 off the float64 reference
and `CPHPAttention`'s 4.1e-5 (its flash-style backward, D = rowsum(dO * O), rounds once
more). A tensor's bound is TOLERANCE or this factor times the plain fp32 attention's own
error, whichever is larger; on 600 other random cases neither went over TOLERANCE."""
HEAD_DIM = 8


@dataclass(frozen=True)
class Case:
    """One attention call to check: a layout, the mask, the batch and the input seed."""

    layout: AttentionLayout
    causal: bool
    batch: int
    seed: int


# --- random layouts ---------------------------------------------------------------------------


def random_layout(rng: random.Random, world_size: int) -> AttentionLayout:
    """A valid layout for `world_size` ranks: 1-3 groups of shuffled ranks, uneven heads,
    GQA ratio 1, 2 or 4; generalized zigzag or hand-built shuffled non-contiguous ranges."""
    groups = random_groups(rng, world_size)
    num_heads, num_kv_heads = random_heads(rng, max(len(members) for members in groups))
    head_counts = [random_composition(rng, num_heads, len(members)) for members in groups]
    if rng.random() < 0.5:
        return random_zigzag_layout(rng, groups, num_heads, num_kv_heads, head_counts)
    return random_shuffled_layout(rng, groups, num_heads, num_kv_heads, head_counts)


def random_groups(rng: random.Random, world_size: int) -> list[list[int]]:
    ranks = list(range(world_size))
    rng.shuffle(ranks)
    count = rng.randint(1, min(3, world_size))
    cuts = sorted(rng.sample(range(1, world_size), count - 1))
    bounds = [0, *cuts, world_size]
    return [ranks[a:b] for a, b in zip(bounds, bounds[1:])]


def random_heads(rng: random.Random, largest_group: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) with ratio 1, 2 or 4 and at least one head per member."""
    ratio = rng.choice([1, 2, 4])
    smallest_kv = -(-largest_group // ratio)
    num_kv_heads = rng.randint(smallest_kv, smallest_kv + 2)
    if ratio == 1 and rng.random() < 0.3:
        num_kv_heads = max(num_kv_heads, 7)  # e.g. 7 heads over 3 ranks
    return ratio * num_kv_heads, num_kv_heads


def random_composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """`parts` positive integers summing to `total`, uneven."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def random_zigzag_layout(rng, groups, num_heads, num_kv_heads, head_counts) -> AttentionLayout:
    segments = [2 * rng.randint(len(members), len(members) + 4) for members in groups]
    weights = [[rng.uniform(1.0, 4.0) for _ in members] for members in groups]
    return build_zigzag_layout(
        sum(segments), num_heads, num_kv_heads, groups, segments, weights, head_counts
    )


def random_shuffled_layout(rng, groups, num_heads, num_kv_heads, head_counts) -> AttentionLayout:
    """Token ranges cut at random and dealt to random ranks (every rank at least one), each
    rank's list sorted: uneven, non-contiguous, no zigzag structure."""
    world_size = sum(len(members) for members in groups)
    piece_count = rng.randint(world_size, 3 * world_size)
    seq_len = rng.randint(piece_count, piece_count + 24)
    cuts = sorted(rng.sample(range(1, seq_len), piece_count - 1))
    bounds = [0, *cuts, seq_len]
    pieces = list(zip(bounds, bounds[1:]))
    rng.shuffle(pieces)
    owners = list(range(world_size)) + [rng.randrange(world_size) for _ in pieces[world_size:]]
    token_ranges: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for owner, piece in zip(owners, pieces):
        token_ranges[owner].append(piece)
    head_ranges: list[tuple[int, int]] = [(0, 0)] * world_size
    for members, counts in zip(groups, head_counts):
        start = 0
        for rank, count in zip(members, counts):
            head_ranges[rank] = (start, start + count)
            start += count
    layout = AttentionLayout(
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        groups=tuple(tuple(m) for m in groups),
        token_ranges=tuple(tuple(sorted(r)) for r in token_ranges),
        head_ranges=tuple(head_ranges),
    )
    layout.validate()
    return layout


def random_cases(seed: int, world_size: int, count: int) -> list[Case]:
    """`count` cases for `world_size` ranks, the same on every rank for the same seed."""
    rng = random.Random(seed)
    return [
        Case(random_layout(rng, world_size), rng.random() < 0.6, rng.choice([1, 2]), seed + i)
        for i in range(count)
    ]


# --- reference and checks ---------------------------------------------------------------------


def full_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """q, k, v and dout over the whole sequence, fp32, fresh for the case (never zeros)."""
    layout = case.layout
    generator = torch.Generator().manual_seed(case.seed)
    shapes = [
        (case.batch, layout.seq_len, layout.num_heads, HEAD_DIM),
        (case.batch, layout.seq_len, layout.num_kv_heads, HEAD_DIM),
        (case.batch, layout.seq_len, layout.num_kv_heads, HEAD_DIM),
        (case.batch, layout.seq_len, layout.num_heads, HEAD_DIM),
    ]
    return tuple(torch.randn(shape, generator=generator) for shape in shapes)


def reference_attention(q, k, v, causal: bool) -> torch.Tensor:
    """Plain softmax attention over the whole sequence in the inputs' dtype; token t is at
    position t; K/V head h // r serves query head h."""
    ratio = q.shape[2] // k.shape[2]
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
    k_, v_ = k_.repeat_interleave(ratio, dim=1), v_.repeat_interleave(ratio, dim=1)
    scores = q_ @ k_.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        length = q.shape[1]
        hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v_).transpose(1, 2)


def reference_results(case: Case) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of the whole sequence, computed in float64."""
    q, k, v, dout = full_inputs(case)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = reference_attention(*leaves, case.causal)
    out.backward(dout.double())
    return (out.detach(), *(x.grad for x in leaves))


def token_index(layout: AttentionLayout, rank: int) -> torch.Tensor:
    """The positions of `rank`'s tokens, in its order (its ranges concatenated)."""
    return torch.tensor([p for start, end in layout.token_ranges[rank] for p in range(start, end)])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||; the absolute error where expected is exactly 0
    (e.g. dq of a token that sees only itself)."""
    difference = (actual.double() - expected).norm().item()
    scale = expected.norm().item()
    return difference / scale if scale > 0 else difference


def check_case(case: Case, rank: int, group=None) -> None:
    """Run `CPHPAttention` on this rank's shard and compare with the reference; `rank` is
    the rank in `group` (None: the default process group)."""
    from hexiseq.runtime import CPHPAttention

    index = token_index(case.layout, rank)
    q, k, v, dout = (x[:, index] for x in full_inputs(case))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = CPHPAttention(case.layout, group)(*leaves, causal=case.causal)
    out.backward(dout)
    expected = [x[:, index] for x in reference_results(case)]
    actual = [out, *(x.grad for x in leaves)]
    plain = [x[:, index] for x in plain_fp32_results(case)]
    for name, got, want, fp32 in zip(("out", "dq", "dk", "dv"), actual, expected, plain):
        error = relative_error(got, want)
        bound = max(TOLERANCE, CONDITIONING_FACTOR * relative_error(fp32, want))
        assert error <= bound, f"rank {rank} {name} error {error:.2e} > {bound:.1e} in {case}"


def plain_fp32_results(case: Case) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of plain attention over the whole sequence in fp32, one process:
    how close fp32 itself gets to the float64 reference on these inputs."""
    q, k, v, dout = full_inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = reference_attention(*leaves, case.causal)
    out.backward(dout)
    return (out.detach(), *(x.grad for x in leaves))


def run_random_cases(rank: int, world_size: int, seed: int, count: int) -> None:
    """Tier-2 worker: `count` random cases on `world_size` ranks."""
    for case in random_cases(seed, world_size, count):
        check_case(case, rank)
