"""One ring step on one rank: attend the local queries to a K/V block, tile by tile (torch).

Forward results are merged into an `OnlineSoftmax` (log-sum-exp and output), backward
gradients are summed in `RowSum`s (fp32). K/V heads are expanded to the rank's query heads for
the kernels (query head h uses K/V head h // r) and each tile's dK/dV are summed back per K/V
head (`HeadExpansion`), so GQA never enters the kernels.

Both keep track of the rows (query rows, or keys) no result has reached yet: the first result
for such rows is written, not merged or added, so a block of one tile (every one-group ring,
and the own block of a zigzag layout) costs no zero fill, merge or add at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hexiseq.runtime._tiles import Tile
from hexiseq.runtime.kernels import block_backward, block_forward

Range = tuple[int, int]


class Untouched:
    """The rows of [0, rows) that nothing has reached yet, as sorted disjoint ranges."""

    def __init__(self, rows: int) -> None:
        self.ranges: list[Range] = [(0, rows)] if rows else []

    def take(self, start: int, stop: int) -> list[Range]:
        """The untouched parts of [start, stop), from now on touched."""
        taken, kept = [], []
        for low, high in self.ranges:
            inside = (max(low, start), min(high, stop))
            if inside[0] >= inside[1]:
                kept.append((low, high))
                continue
            taken.append(inside)
            kept += [r for r in ((low, inside[0]), (inside[1], high)) if r[0] < r[1]]
        self.ranges = kept
        return taken


def _bounds(rows: slice, count: int) -> Range:
    """[start, stop) of a tile's row (or key) slice among `count` rows."""
    start, stop, _ = rows.indices(count)
    return start, stop


class OnlineSoftmax:
    """Running softmax attention over key blocks: out and lse, merged block by block
    (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax").

    A result for rows nothing has reached yet is written, not merged; the first result, if it
    covers every row, becomes the state as it is (no allocation), its output kept in its own
    dtype until a second result needs an fp32 merge. The state owns what it is given (later
    merges update it in place). Rows that no block has reached end with lse = -inf, out = 0.
    """

    def __init__(self, q_BHLD: torch.Tensor) -> None:
        self._shape, self._device = q_BHLD.shape, q_BHLD.device
        self._out_BHLD: torch.Tensor | None = None
        self._lse_BHL: torch.Tensor | None = None
        self._untouched = Untouched(q_BHLD.shape[2])

    @property
    def out_BHLD(self) -> torch.Tensor:
        """The output in fp32."""
        return self.output(torch.float32)

    @property
    def lse_BHL(self) -> torch.Tensor:
        """The log-sum-exp in fp32."""
        self._close_untouched()
        return self._lse_BHL

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        """The output in `dtype` (no fp32 round trip when one result made it)."""
        self._close_untouched()
        return self._out_BHLD.to(dtype)

    def merge(self, rows: slice, out_BHLD: torch.Tensor, lse_BHL: torch.Tensor) -> None:
        """Fold a block result for `rows` in: out = (e^lse_a out_a + e^lse_b out_b) / e^lse."""
        start, stop = _bounds(rows, self._shape[2])
        fresh = self._untouched.take(start, stop)
        if self._out_BHLD is None and (start, stop) == (0, self._shape[2]):
            self._out_BHLD, self._lse_BHL = out_BHLD, lse_BHL.float()
            return
        state_out, state_lse = self._fp32_state()
        if fresh == [(start, stop)]:
            state_out[:, :, rows].copy_(out_BHLD)
            state_lse[:, :, rows].copy_(lse_BHL)
            return
        self._empty(fresh)  # the part of `rows` nothing reached before
        _merge_into(state_out[:, :, rows], state_lse[:, :, rows], out_BHLD, lse_BHL)

    def _allocate(self) -> None:
        """fp32 state, uninitialised (rows are written before they are read), if there is
        none yet."""
        if self._out_BHLD is None:
            self._out_BHLD = torch.empty(self._shape, dtype=torch.float32, device=self._device)
            self._lse_BHL = torch.empty(self._shape[:3], dtype=torch.float32, device=self._device)

    def _fp32_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The state as fp32 tensors to update in place."""
        self._allocate()
        self._out_BHLD = self._out_BHLD.float()
        return self._out_BHLD, self._lse_BHL

    def _close_untouched(self) -> None:
        """Rows no block reached end empty."""
        self._allocate()
        self._empty(self._untouched.take(0, self._shape[2]))

    def _empty(self, ranges: list[Range]) -> None:
        """out 0, lse -inf (the merge's identity) in the rows of `ranges`."""
        for start, stop in ranges:
            self._out_BHLD[:, :, start:stop].zero_()
            self._lse_BHL[:, :, start:stop].fill_(float("-inf"))


def _merge_into(
    old_out: torch.Tensor, old_lse: torch.Tensor, out_BHLD: torch.Tensor, lse_BHL: torch.Tensor
) -> None:
    """The general online-softmax merge, in place into the fp32 views `old_out`, `old_lse`."""
    new_lse = torch.logaddexp(old_lse, lse_BHL)
    # -inf - -inf would be NaN; such a row stays empty (both weights 0).
    finite_lse = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = torch.exp(old_lse - finite_lse)[..., None]
    new_weight = torch.exp(lse_BHL - finite_lse)[..., None]
    old_out.mul_(old_weight).add_(new_weight * out_BHLD.float())
    old_lse.copy_(new_lse)


class RowSum:
    """A sum of tensors over slices of rows (the second-to-last dimension), in fp32.

    Like `OnlineSoftmax`: a contribution to rows nothing has reached yet is written, not
    added; the first, if it covers every row and no buffer was given, becomes the sum as it is
    (upcast to fp32 only when a second one is added). The sum owns what it is given. Rows
    nothing reached sum to 0.
    """

    def __init__(self, shape: Sequence[int], device: torch.device) -> None:
        self._shape, self._device = tuple(shape), device
        self._sum: torch.Tensor | None = None
        self._untouched = Untouched(self._shape[-2])

    @classmethod
    def into(cls, buffer: torch.Tensor) -> RowSum:
        """A sum kept in `buffer` (fp32; what it holds is ignored)."""
        row_sum = cls(buffer.shape, buffer.device)
        row_sum._sum = buffer
        return row_sum

    def add(self, rows: slice, x: torch.Tensor) -> None:
        """Add `x` into `rows` (any floating dtype; the sum stays fp32)."""
        start, stop = _bounds(rows, self._shape[-2])
        fresh = self._untouched.take(start, stop)
        if self._sum is None and (start, stop) == (0, self._shape[-2]):
            self._sum = x
            return
        if self._sum is None:  # rows are written before they are read
            self._sum = torch.empty(self._shape, dtype=torch.float32, device=self._device)
        self._sum = self._sum.float()
        if fresh == [(start, stop)]:
            self._sum[..., rows, :].copy_(x)
            return
        self._zero(fresh)  # the part of `rows` nothing reached before
        self._sum[..., rows, :].add_(x)

    def finish(self) -> torch.Tensor:
        """The sum: fp32, or the dtype of the one contribution that covered every row."""
        if self._sum is None:
            self._sum = torch.empty(self._shape, dtype=torch.float32, device=self._device)
        self._zero(self._untouched.take(0, self._shape[-2]))
        return self._sum

    def _zero(self, ranges: list[Range]) -> None:
        for start, stop in ranges:
            self._sum[..., start:stop, :].zero_()


class HeadExpansion(NamedTuple):
    """How the rank's K/V heads become one per query head, and the gradients come back.

    `index` None: query head i uses K/V head i // `repeats` (the rank's query heads are whole
    runs of `repeats` heads per K/V head, e.g. whole GQA groups; `repeats` 1: the identity), so
    expanding is a broadcast copy and reducing a sum over a view. Otherwise (an uneven head
    split cuts a group) `index` is the K/V head of each query head: a gather, and a
    scatter-add back.
    """

    repeats: int
    index: torch.Tensor | None

    def expand(self, kv_2BHSD: torch.Tensor) -> torch.Tensor:
        """(2, B, H_kv, S, D) -> (2, B, H, S, D)."""
        if self.index is not None:
            return kv_2BHSD.index_select(2, self.index)
        if self.repeats == 1:
            return kv_2BHSD
        two, batch, kv_heads, keys, head_dim = kv_2BHSD.shape
        repeated = kv_2BHSD[:, :, :, None].expand(two, batch, kv_heads, self.repeats, keys, -1)
        return repeated.reshape(two, batch, kv_heads * self.repeats, keys, head_dim)

    def reduce(self, d_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """(B, H, S, D) gradients -> (B, H_kv, S, D) summed per K/V head, in fp32 (the identity:
        as given)."""
        if self.index is not None:
            batch, _, keys, head_dim = d_BHSD.shape
            reduced = d_BHSD.new_zeros(batch, kv_heads, keys, head_dim, dtype=torch.float32)
            return reduced.index_add_(1, self.index, d_BHSD.float())
        if self.repeats == 1:
            return d_BHSD
        return d_BHSD.unflatten(1, (kv_heads, self.repeats)).sum(2, dtype=torch.float32)


def expansion_index(heads: Range, kv_heads: Range, ratio: int) -> list[int]:
    """For each of the rank's query heads, the index of its K/V head among the rank's K/V
    heads (query head h uses K/V head h // ratio)."""
    return [h // ratio - kv_heads[0] for h in range(*heads)]


def head_expansion(index: list[int], device: torch.device) -> HeadExpansion:
    """The `HeadExpansion` for an `expansion_index`: by repeats when the index is i // r for
    some r, else by the index tensor on `device`."""
    repeats = len(index) // (index[-1] + 1) if index else 1
    if index == [i // repeats for i in range(len(index))]:
        return HeadExpansion(repeats, None)
    return HeadExpansion(1, torch.tensor(index, device=device))


def attend_block(
    merged: OnlineSoftmax,
    q_BHLD: torch.Tensor,
    kv_2BHSD: torch.Tensor,
    tiles: Sequence[Tile],
    expansion: HeadExpansion,
    scale: float,
) -> None:
    """Forward of one block: every tile's result merged into `merged`."""
    if not tiles:
        return
    k_BHSD, v_BHSD = expansion.expand(kv_2BHSD)
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
    dq: RowSum,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv_2BHSD: torch.Tensor,
    tiles: Sequence[Tile],
    expansion: HeadExpansion,
    scale: float,
) -> torch.Tensor:
    """Backward of one block: adds dQ into `dq` and returns the block's partial dK/dV
    (2, B, H_kv_local, S, D) in fp32. `saved` = (dout, q, global out, global lse).

    Each tile's dK/dV are reduced to K/V heads before they are summed over tiles."""
    dout, q_BHLD, out_BHLD, lse_BHL = saved
    kv_heads = kv_2BHSD.shape[2]
    expanded = expansion.expand(kv_2BHSD)
    dkv_2BHSD = torch.empty(kv_2BHSD.shape, dtype=torch.float32, device=kv_2BHSD.device)
    dk_sum, dv_sum = RowSum.into(dkv_2BHSD[0]), RowSum.into(dkv_2BHSD[1])
    for tile in tiles:
        rows, keys = tile.rows, tile.keys
        dq_tile, dk, dv = block_backward(
            dout[:, :, rows],
            q_BHLD[:, :, rows],
            expanded[0][:, :, keys],
            expanded[1][:, :, keys],
            out_BHLD[:, :, rows],
            lse_BHL[:, :, rows],
            causal=tile.causal,
            scale=scale,
        )
        dq.add(rows, dq_tile)
        dk_sum.add(keys, expansion.reduce(dk, kv_heads))
        dv_sum.add(keys, expansion.reduce(dv, kv_heads))
    dk_sum.finish()  # keys no tile reached: 0
    dv_sum.finish()
    return dkv_2BHSD
