"""One ring step on one rank: attend the local queries to a K/V block, tile by tile (torch).

Forward results are merged into an `OnlineSoftmax` (fp32 output and log-sum-exp); backward
gradients are accumulated in fp32. K/V heads are expanded to the rank's query heads for the
kernels (query head h uses K/V head h // r) and the expanded dK/dV are summed back per K/V
head, so GQA never enters the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hexiseq.runtime._tiles import Tile
from hexiseq.runtime.kernels import block_backward, block_forward


class OnlineSoftmax:
    """Running softmax attention over key blocks: out and lse in fp32, merged block by block
    (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax").

    Rows that no block has reached keep lse = -inf and out = 0.
    """

    def __init__(self, q_BHLD: torch.Tensor) -> None:
        batch, heads, rows, head_dim = q_BHLD.shape
        device = q_BHLD.device
        self.out_BHLD = torch.zeros(batch, heads, rows, head_dim, device=device)
        self.lse_BHL = torch.full((batch, heads, rows), float("-inf"), device=device)

    def merge(self, rows: slice, out_BHLD: torch.Tensor, lse_BHL: torch.Tensor) -> None:
        """Fold a block result for `rows` in: out = (e^lse_a out_a + e^lse_b out_b) / e^lse."""
        old_out, old_lse = self.out_BHLD[:, :, rows], self.lse_BHL[:, :, rows]
        new_lse = torch.logaddexp(old_lse, lse_BHL)
        # -inf - -inf would be NaN; such a row stays empty (both weights 0).
        finite_lse = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
        old_weight = torch.exp(old_lse - finite_lse)[..., None]
        new_weight = torch.exp(lse_BHL - finite_lse)[..., None]
        old_out.mul_(old_weight).add_(new_weight * out_BHLD.float())
        old_lse.copy_(new_lse)


def expansion_index(heads: tuple[int, int], kv_heads: tuple[int, int], ratio: int) -> list[int]:
    """For each of the rank's query heads, the index of its K/V head among the rank's K/V
    heads (query head h uses K/V head h // ratio)."""
    return [h // ratio - kv_heads[0] for h in range(*heads)]


def expand_kv(kv_2BHSD: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """K/V heads -> one per query head; `index` None means they already match."""
    return kv_2BHSD if index is None else kv_2BHSD.index_select(2, index)


def attend_block(
    merged: OnlineSoftmax,
    q_BHLD: torch.Tensor,
    kv_2BHSD: torch.Tensor,
    tiles: Sequence[Tile],
    index: torch.Tensor | None,
    scale: float,
) -> None:
    """Forward of one block: every tile's result merged into `merged`."""
    if not tiles:
        return
    k_BHSD, v_BHSD = expand_kv(kv_2BHSD, index)
    for tile in tiles:
        out, lse = block_forward(
            q_BHLD[:, :, tile.rows],
            k_BHSD[:, :, tile.keys],
            v_BHSD[:, :, tile.keys],
            causal=tile.causal,
            scale=scale,
        )
        merged.merge(tile.rows, out, lse)


def block_gradients(
    dq_BHLD: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv_2BHSD: torch.Tensor,
    tiles: Sequence[Tile],
    index: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Backward of one block: adds dQ into `dq_BHLD` (fp32) and returns the block's partial
    dK/dV (2, B, H_kv_local, S, D) in fp32. `saved` = (dout, q, global out, global lse)."""
    dout, q_BHLD, out_BHLD, lse_BHL = saved
    batch, kv_heads, keys, head_dim = kv_2BHSD.shape[1:]
    expanded = expand_kv(kv_2BHSD, index)
    dkv_2BHSD = torch.zeros((2, *expanded.shape[1:]), device=kv_2BHSD.device)
    for tile in tiles:
        rows, keys_slice = tile.rows, tile.keys
        dq, dk, dv = block_backward(
            dout[:, :, rows],
            q_BHLD[:, :, rows],
            expanded[0][:, :, keys_slice],
            expanded[1][:, :, keys_slice],
            out_BHLD[:, :, rows],
            lse_BHL[:, :, rows],
            causal=tile.causal,
            scale=scale,
        )
        dq_BHLD[:, :, rows] += dq
        dkv_2BHSD[0][:, :, keys_slice] += dk
        dkv_2BHSD[1][:, :, keys_slice] += dv
    if index is None:
        return dkv_2BHSD
    reduced = torch.zeros((2, batch, kv_heads, keys, head_dim), device=kv_2BHSD.device)
    return reduced.index_add_(2, index, dkv_2BHSD)
