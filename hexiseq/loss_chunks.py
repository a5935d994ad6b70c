"""How the training loss cuts its work into pieces: one rule for the runtime and the models.

`hexiseq.runtime.loss.chunked_next_token_loss` computes the LM head and the cross-entropy a
chunk of tokens at a time, so only one chunk's logits (and their gradient) ever exist; the
memory model and the step simulator (`hexiseq.costmodel`) count what it allocates and moves
with the same sizes. Pure and torch-free, so planning does not import torch.

- A chunk holds `loss_chunk_tokens(vocab)` tokens: as many as keep its FP32 logits within
  `LOSS_CHUNK_LOGIT_BYTES` (the allocation that OOMed: 16K tokens x 128K vocabulary in FP32 is
  7.8 GiB at once; a chunk of that vocabulary is 2,092 tokens, 1 GiB). 256 MiB chunks made
  the loss add each chunk's weight gradient into the FP32 accumulator in three slabs: 48
  passes over the head's FP32 gradient at 8K tokens on an H200 (profiles/h200-2026-11-26,
  `aten::add_`); 1 GiB makes it 4, for about 1.1 GiB more of transient memory at 128K
  vocabulary.
- With a compute dtype narrower than FP32, each chunk's weight gradient is made by GEMMs over
  slabs of `weight_gradient_slab_rows` vocabulary rows and added into the FP32 accumulator,
  so that temporary stays within the same budget too.
"""

from __future__ import annotations

from hexiseq.catalog import MiB

FP32_BYTES = 4

LOSS_CHUNK_LOGIT_BYTES = 1024 * MiB
"""Bytes of one chunk's FP32 logits (and the bound on a weight-gradient slab)."""


def loss_chunk_tokens(vocab: int, budget_bytes: int = LOSS_CHUNK_LOGIT_BYTES) -> int:
    """Tokens per loss chunk: the most whose FP32 logits over `vocab` fit `budget_bytes`
    (at least one). Raises ValueError for a vocabulary or budget below 1."""
    if vocab < 1 or budget_bytes < 1:
        raise ValueError(
            f"loss_chunk_tokens: vocab {vocab} and budget {budget_bytes} must be >= 1"
        )
    return max(1, budget_bytes // (vocab * FP32_BYTES))


def loss_chunk_count(tokens: int, chunk_tokens: int) -> int:
    """Chunks the loss runs for `tokens` tokens (0 for none)."""
    return -(-tokens // chunk_tokens)


def weight_gradient_slab_rows(
    vocab: int, hidden: int, element_bytes: int, budget_bytes: int = LOSS_CHUNK_LOGIT_BYTES
) -> int:
    """Vocabulary rows of one weight-gradient partial (rows x `hidden` in `element_bytes`
    per element) within `budget_bytes`: at least one row, at most the whole vocabulary."""
    return min(vocab, max(1, budget_bytes // (hidden * element_bytes)))


def weight_gradient_slab_count(vocab: int, hidden: int, element_bytes: int) -> int:
    """Partial GEMMs (and FP32 additions) one chunk's weight gradient takes."""
    return loss_chunk_count(vocab, weight_gradient_slab_rows(vocab, hidden, element_bytes))
