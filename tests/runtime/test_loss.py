"""`chunked_next_token_loss`: the LM head and cross-entropy a chunk of tokens at a time.

Against the unchunked reference `cross_entropy(hidden @ W.T)` (fp32 to 1e-5, bf16 within
bf16 rounding), on one process and on 2 gloo ranks with uneven (and empty) token shares, and
its memory under `AllocationTracker`: one chunk's logits, never all of them, exactly what
`costmodel.memory` counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as functional
from distributed import run_distributed

from hexiseq import ModelSpec, TrainSpec
from hexiseq.costmodel._runtime_work import RuntimeDtypes
from hexiseq.costmodel.memory import loss_chunk_bytes, loss_transient_bytes
from hexiseq.loss_chunks import LOSS_CHUNK_LOGIT_BYTES, loss_chunk_tokens
from hexiseq.runtime.allocations import AllocationTracker
from hexiseq.runtime.loss import (
    IGNORE_LABEL,
    chunked_next_token_loss,
    sharded_next_token_loss,
)

FP32_TOLERANCE = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2 %): the logits, the gradient of
# the logits and the GEMM outputs are each rounded once.
BF16_LOSS_TOLERANCE = 5e-3
BF16_GRADIENT_TOLERANCE = 2e-2
# Per token of a chunk, the row vectors beside its logits (label mask and targets, row max,
# target logit, sum of exponentials, row scale, ...): about 40 bytes, left out of the model.
ROW_VECTOR_BYTES_PER_TOKEN = 64


def random_case(batch: int, tokens: int, hidden: int, vocab: int, seed: int, dtype=torch.float32):
    """Hidden states, head weight (logits of order 1) and labels with some ignored."""
    generator = torch.Generator().manual_seed(seed)
    hidden_BTE = torch.randn(batch, tokens, hidden, generator=generator)
    weight_VE = torch.randn(vocab, hidden, generator=generator) / hidden**0.5
    labels_BT = torch.randint(0, vocab, (batch, tokens), generator=generator)
    labels_BT[:, ::5] = IGNORE_LABEL
    return hidden_BTE.to(dtype), weight_VE.to(dtype), labels_BT


def reference(hidden_BTE, weight_VE, labels_BT, scale: float = 1.0):
    """(loss, d hidden, d W) of the unchunked mean cross-entropy in fp32, x `scale`."""
    hidden = hidden_BTE.detach().float().requires_grad_()
    weight = weight_VE.detach().float().requires_grad_()
    logits = (hidden @ weight.T).flatten(0, 1)
    loss = functional.cross_entropy(logits, labels_BT.flatten(), ignore_index=IGNORE_LABEL)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def chunked(hidden_BTE, weight_VE, labels_BT, scale: float = 1.0, **options):
    hidden = hidden_BTE.detach().clone().requires_grad_()
    weight = weight_VE.detach().clone().requires_grad_()
    loss = chunked_next_token_loss(hidden, weight, labels_BT, **options)
    (loss.local_share * scale).backward()
    return loss, hidden.grad, weight.grad


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 17, 34, 1000, None])
def test_fp32_matches_the_unchunked_loss(chunk_tokens):
    """Chunks of 1 token, uneven ones (17 tokens are not a multiple of 4 or 7), one per
    sequence (17) or batch (34), larger than everything, and the default."""
    case = random_case(2, 17, 24, 50, seed=chunk_tokens or 0)
    loss, d_hidden, d_weight = chunked(*case, scale=0.75, chunk_tokens=chunk_tokens)
    expected_loss, expected_hidden, expected_weight = reference(*case, scale=0.75)
    assert loss.labelled_tokens == int((case[2] != IGNORE_LABEL).sum())
    assert abs(loss.local_share.item() - expected_loss.item()) <= FP32_TOLERANCE * expected_loss
    assert abs(loss.global_loss.item() - expected_loss.item()) <= FP32_TOLERANCE * expected_loss
    assert relative_error(d_hidden, expected_hidden) <= FP32_TOLERANCE
    assert relative_error(d_weight, expected_weight) <= FP32_TOLERANCE
    assert (d_hidden.dtype, d_weight.dtype) == (torch.float32, torch.float32)


def test_chunk_with_every_label_ignored_and_sharded_loss_agree():
    """A chunk whose labels are all ignored adds nothing and gets zero gradient rows; the
    result equals `sharded_next_token_loss` on the full logits."""
    hidden_BTE, weight_VE, labels_BT = random_case(1, 12, 16, 30, seed=3)
    labels_BT[:, 4:8] = IGNORE_LABEL  # the second chunk of 4
    loss, d_hidden, d_weight = chunked(hidden_BTE, weight_VE, labels_BT, chunk_tokens=4)
    _, expected_hidden, expected_weight = reference(hidden_BTE, weight_VE, labels_BT)
    assert torch.equal(d_hidden[:, 4:8], torch.zeros_like(d_hidden[:, 4:8]))
    assert relative_error(d_hidden, expected_hidden) <= FP32_TOLERANCE
    assert relative_error(d_weight, expected_weight) <= FP32_TOLERANCE
    full = sharded_next_token_loss(hidden_BTE @ weight_VE.T, labels_BT)
    assert loss.global_loss.item() == pytest.approx(full.global_loss.item(), rel=FP32_TOLERANCE)
    assert loss.labelled_tokens == full.labelled_tokens


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_bf16_within_bf16_rounding_of_fp32(compute_dtype):
    """bf16 hidden states and weight (None: compute in their dtype), or fp32 ones computed in
    bf16 as autocast would: gradients come back in the inputs' dtypes."""
    inputs = torch.bfloat16 if compute_dtype is None else torch.float32
    case = random_case(2, 40, 32, 64, seed=11, dtype=inputs)
    loss, d_hidden, d_weight = chunked(
        *case, scale=0.5, chunk_tokens=16, compute_dtype=compute_dtype
    )
    expected_loss, expected_hidden, expected_weight = reference(*case, scale=0.5)
    error = abs(loss.global_loss.item() - expected_loss.item()) / expected_loss.item()
    assert error <= BF16_LOSS_TOLERANCE
    assert relative_error(d_hidden, expected_hidden) <= BF16_GRADIENT_TOLERANCE
    assert relative_error(d_weight, expected_weight) <= BF16_GRADIENT_TOLERANCE
    assert (d_hidden.dtype, d_weight.dtype) == (inputs, inputs)


def test_bad_input_fails_loudly():
    hidden_BTE, weight_VE, labels_BT = random_case(1, 6, 8, 10, seed=1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_next_token_loss(hidden_BTE, weight_VE, labels_BT, chunk_tokens=0)
    with pytest.raises(ValueError, match="no labelled token"):
        chunked_next_token_loss(hidden_BTE, weight_VE, torch.full_like(labels_BT, IGNORE_LABEL))


def test_default_chunk_keeps_fp32_logits_within_the_budget():
    assert loss_chunk_tokens(128_256) == 2092  # llama3: 2,092 x 128,256 x 4 B <= 1 GiB
    assert loss_chunk_tokens(128_256) * 128_256 * 4 <= LOSS_CHUNK_LOGIT_BYTES
    assert loss_chunk_tokens(10**12) == 1


# --- two ranks ---------------------------------------------------------------------------


def _two_rank_losses(rank: int, world_size: int, cases: list[tuple[int, int]]) -> None:
    for token_counts in cases:  # one spawn for every case: spawning takes most of the time
        _two_rank_loss(rank, token_counts)


def _two_rank_loss(rank: int, token_counts: tuple[int, int]) -> None:
    """Each rank takes its slice of one sequence; the shares add up to the global mean and
    the gradients (hidden rows per rank, the weight summed) are the reference's."""
    total = sum(token_counts)
    hidden_BTE, weight_VE, labels_BT = random_case(1, total, 16, 40, seed=5)
    start = sum(token_counts[:rank])
    own = slice(start, start + token_counts[rank])
    loss, d_hidden, d_weight = chunked(
        hidden_BTE[:, own], weight_VE, labels_BT[:, own], chunk_tokens=3
    )
    expected_loss, expected_hidden, expected_weight = reference(hidden_BTE, weight_VE, labels_BT)
    shares = loss.local_share.detach().double().clone()
    dist.all_reduce(shares)
    dist.all_reduce(d_weight)
    assert abs(shares.item() - expected_loss.item()) <= FP32_TOLERANCE * expected_loss
    assert abs(loss.global_loss.item() - expected_loss.item()) <= FP32_TOLERANCE * expected_loss
    assert loss.labelled_tokens == int((labels_BT != IGNORE_LABEL).sum())
    assert relative_error(d_weight, expected_weight) <= FP32_TOLERANCE
    if token_counts[rank]:
        assert relative_error(d_hidden, expected_hidden[:, own]) <= FP32_TOLERANCE
    else:
        assert d_hidden.shape == (1, 0, 16)


@pytest.mark.multiproc
def test_two_ranks_with_uneven_tokens_add_up_to_the_global_mean():
    """Uneven shares (13 and 6 tokens, chunks of 3), and a rank with no token at all."""
    run_distributed(_two_rank_losses, 2, [(13, 6), (11, 0)])


# --- memory ------------------------------------------------------------------------------


def tracked_loss_bytes(hidden_BTE, weight_VE, labels_BT, **options) -> tuple[int, int]:
    """(peak of the loss above its inputs, bytes it leaves for the backward but its two
    scalars), counted by `AllocationTracker`; the backward adds nothing (it scales the
    gradients in place)."""
    hidden = hidden_BTE.detach().clone().requires_grad_()
    weight = weight_VE.detach().clone().requires_grad_()
    tracker = AllocationTracker()
    tracker.track([hidden, weight, labels_BT], "inputs")
    with tracker:
        with tracker.phase("loss") as loss_phase:
            loss = chunked_next_token_loss(hidden, weight, labels_BT, **options)
        left = tracker.live_bytes - loss_phase.start_bytes - 2 * 4  # local and global loss
        with tracker.phase("backward") as backward_phase:
            loss.local_share.backward()
    assert backward_phase.peak_bytes - backward_phase.start_bytes <= 4  # the seed gradient
    assert weight.grad is not None and hidden.grad is not None
    return loss_phase.peak_bytes - loss_phase.start_bytes, left


def test_peak_is_one_chunk_of_logits_not_all_of_them():
    """2,048 tokens x 16,000 vocabulary: the FP32 logits of all tokens would be 125 MiB; in
    chunks of 128 tokens the loss peaks at one chunk's (7.8 MiB) plus the two gradients."""
    tokens, hidden, vocab, chunk = 2048, 32, 16_000, 128
    case = random_case(1, tokens, hidden, vocab, seed=2)
    peak, left = tracked_loss_bytes(*case, chunk_tokens=chunk)
    gradients = tokens * hidden * 4 + vocab * hidden * 4
    assert 0 <= peak - (chunk * vocab * 4 + gradients) <= ROW_VECTOR_BYTES_PER_TOKEN * chunk
    assert left == gradients
    assert peak < 0.1 * tokens * vocab * 4


MODEL = ModelSpec(
    name="m", layers=1, hidden=48, heads=4, kv_heads=2, head_dim=12, ffn_hidden=96, vocab=1000
)


@pytest.mark.parametrize(
    ("inputs", "compute_dtype", "dtypes"),
    [
        # an fp32 run; weights gathered in bf16; autocast over fp32 weights
        (torch.float32, None, RuntimeDtypes(compute=4, stream=4, casts_weights=False)),
        (torch.bfloat16, None, RuntimeDtypes(compute=2, stream=2, casts_weights=False)),
        (torch.float32, torch.bfloat16, RuntimeDtypes(compute=2, stream=4, casts_weights=True)),
    ],
)
def test_memory_model_counts_what_the_loss_allocates(inputs, compute_dtype, dtypes):
    """`costmodel.memory`'s loss terms, byte for byte: one chunk (the whole sequence here,
    shorter than a default chunk), and 100-token chunks with the last one short."""
    tokens = 700
    case = random_case(1, tokens, MODEL.hidden, MODEL.vocab, seed=4, dtype=inputs)
    weight_bytes = 4 if inputs == torch.float32 else 2
    peak, left = tracked_loss_bytes(*case, compute_dtype=compute_dtype)
    modelled = loss_transient_bytes(MODEL, TrainSpec(seq_len=tokens), dtypes, tokens)
    assert 0 <= peak - modelled <= ROW_VECTOR_BYTES_PER_TOKEN * tokens
    assert (
        left == tokens * MODEL.hidden * dtypes.stream + MODEL.vocab * MODEL.hidden * weight_bytes
    )
    peak, _ = tracked_loss_bytes(*case, compute_dtype=compute_dtype, chunk_tokens=100)
    weight_copy = MODEL.vocab * MODEL.hidden * 2 if dtypes.casts_weights else 0
    gradients = tokens * MODEL.hidden * dtypes.stream + MODEL.vocab * MODEL.hidden * 4
    modelled = gradients + weight_copy + loss_chunk_bytes(MODEL, dtypes, 100)
    assert 0 <= peak - modelled <= ROW_VECTOR_BYTES_PER_TOKEN * 100
