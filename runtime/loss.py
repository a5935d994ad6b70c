"""The training loss over a sequence sharded across ranks, and the gradient reduction.

The loss is the mean next-token cross-entropy over ALL labelled tokens of the sequence: each
rank sums the losses of its own tokens and divides by the *global* count of labelled tokens,
so the ranks' shares add up to the true mean whatever the shard sizes. (A mean of per-rank
means would weight the tokens of a small shard more than those of a large one.) The label of
the token at global position p is the token at p + 1; the last position has none.

Each rank back-propagates only its own share, so the full gradient is the SUM of the ranks'
gradients: `all_reduce_gradients` for replicated parameters, the shards' reduce-scatter for
sharded ones (`sharding`).

`chunked_next_token_loss` is what training runs: it takes the final norm's output and the LM
head's weight instead of logits, and makes the logits, the cross-entropy and their gradients
one chunk of tokens at a time (`hexiseq.loss_chunks`), so the logits of all tokens never
exist at once (16K tokens x 128K vocabulary in FP32 is 7.8 GiB). `sharded_next_token_loss`
takes logits made elsewhere (tests and benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as functional
from torch.autograd.function import once_differentiable

from hexiseq.loss_chunks import loss_chunk_tokens, weight_gradient_slab_rows

IGNORE_LABEL = -100  # functional.cross_entropy's default ignore_index


@dataclass(frozen=True)
class ShardedLoss:
    """This rank's share of the loss (backward on it) and the loss of the whole sequence."""

    local_share: torch.Tensor
    """sum of this rank's token losses / global labelled-token count; differentiable."""
    global_loss: torch.Tensor
    """The mean over every labelled token of the sequence (0-d, detached, same on all ranks)."""
    labelled_tokens: int
    """Labelled tokens of the whole sequence (batch included)."""


def next_token_labels(tokens_BS: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """Labels (B, T) of the tokens at global `positions_T`, read from the whole sequence
    `tokens_BS`: the next token, or IGNORE_LABEL at the sequence's last position."""
    seq_len = tokens_BS.shape[1]
    has_label = positions_T < seq_len - 1
    next_positions = torch.where(has_label, positions_T + 1, 0).to(tokens_BS.device)
    labels_BT = tokens_BS[:, next_positions]
    return labels_BT.masked_fill(~has_label.to(tokens_BS.device)[None, :], IGNORE_LABEL)


def sharded_next_token_loss(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, group: dist.ProcessGroup | None = None
) -> ShardedLoss:
    """The sequence's mean cross-entropy, from every rank's logits and labels (collective).

    Without an initialized process group it is the plain single-process mean. Upcasts all
    logits to FP32 at once: training uses `chunked_next_token_loss`.
    """
    loss_sum = functional.cross_entropy(
        logits_BTV.flatten(0, 1).float(),
        labels_BT.flatten(),
        ignore_index=IGNORE_LABEL,
        reduction="sum",
    )
    counts = torch.stack(
        [loss_sum.detach(), (labels_BT != IGNORE_LABEL).sum().to(loss_sum.dtype)]
    ).double()
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)  # one collective for the sum and the count
    global_sum, global_count = counts.tolist()
    if global_count <= 0:
        raise ValueError("sharded_next_token_loss: the sequence has no labelled token")
    return ShardedLoss(
        local_share=loss_sum / global_count,
        global_loss=torch.tensor(global_sum / global_count),
        labelled_tokens=int(global_count),
    )


def chunked_next_token_loss(
    hidden_BTE: torch.Tensor,
    head_weight_VE: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype | None = None,
) -> ShardedLoss:
    """The sequence's mean cross-entropy of the logits `hidden_BTE @ head_weight_VE.T`, made
    `chunk_tokens` tokens at a time (collective over `group`, like `sharded_next_token_loss`).

    Each chunk's logits are made in `compute_dtype` (default: the hidden states' dtype),
    upcast to FP32 for the softmax, and turned into their gradient at once: the gradient of
    the hidden states (in their dtype) and of the weight (accumulated in FP32, cast to the
    weight's dtype at the end) are made in the forward pass, and the backward pass only
    scales them by the incoming gradient. `chunk_tokens` defaults to
    `hexiseq.loss_chunks.loss_chunk_tokens(vocab)`. The local share is differentiable with
    respect to `hidden_BTE` and `head_weight_VE` (backward once). A rank with no tokens takes
    part with a zero share. Raises ValueError when the whole sequence has no labelled token
    or `chunk_tokens` < 1.
    """
    vocab = head_weight_VE.shape[0]
    chunk_tokens = loss_chunk_tokens(vocab) if chunk_tokens is None else chunk_tokens
    if chunk_tokens < 1:
        raise ValueError(f"chunked_next_token_loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    labelled = (labels_BT != IGNORE_LABEL).sum().to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(labelled, group=group)  # the gradient needs the global count first
    global_count = labelled.item()
    if global_count <= 0:
        raise ValueError("chunked_next_token_loss: the sequence has no labelled token")
    local_share = _ChunkedHeadLoss.apply(
        hidden_BTE,
        head_weight_VE,
        labels_BT,
        1.0 / global_count,
        chunk_tokens,
        compute_dtype or hidden_BTE.dtype,
    )
    global_loss = local_share.detach().to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(global_loss, group=group)  # the shares add up to the mean
    return ShardedLoss(
        local_share=local_share,
        global_loss=torch.tensor(global_loss.item()),
        labelled_tokens=int(global_count),
    )


def all_reduce_gradients(
    parameters: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None
) -> None:
    """Sum every parameter's gradient over the ranks of `group`, in one flat buffer per dtype
    (one collective instead of one per parameter). A parameter without a gradient on this
    rank takes part with zeros, so every rank sends the same buffer layout."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for parameter in parameters:
        by_dtype.setdefault(parameter.grad.dtype, []).append(parameter)
    for members in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in members])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in members:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum of the token losses x `inverse_count`. Its gradients are made chunk by chunk in
    the forward pass and held (instead of any logits) until the backward pass scales them."""

    @staticmethod
    def forward(
        ctx,
        hidden_BTE: torch.Tensor,
        weight_VE: torch.Tensor,
        labels_BT: torch.Tensor,
        inverse_count: float,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        hidden_NE = hidden_BTE.reshape(-1, hidden_BTE.shape[-1])
        labels_N = labels_BT.reshape(-1).to(hidden_NE.device)
        gradients = _HeadGradients(hidden_NE, weight_VE, compute_dtype, ctx.needs_input_grad)
        loss_sum = torch.zeros((), dtype=torch.float64, device=hidden_NE.device)
        # The dtypes are chosen here, not by an autocast region the loss may be called in.
        with torch.autocast(hidden_NE.device.type, enabled=False):
            weight = weight_VE.to(compute_dtype)  # a copy only when the dtypes differ
            for start in range(0, hidden_NE.shape[0], chunk_tokens):
                hidden_CE = hidden_NE[start : start + chunk_tokens].to(compute_dtype)
                labels_C = labels_N[start : start + chunk_tokens]
                # The logits go straight in: the function frees them once upcast.
                loss, gradient_CV = _chunk_loss_and_gradient(
                    torch.mm(hidden_CE, weight.t()), labels_C, inverse_count
                )
                loss_sum += loss
                gradients.add_chunk(gradient_CV, hidden_CE, weight, start)
                del gradient_CV
            del weight
            ctx.d_hidden, ctx.d_weight = gradients.finish(hidden_BTE.shape)
        return loss_sum.to(torch.float32)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        d_hidden, d_weight = ctx.d_hidden, ctx.d_weight
        ctx.d_hidden = ctx.d_weight = None  # handed over: autograd may keep d_weight as .grad
        for gradient in (d_hidden, d_weight):
            if gradient is not None:
                gradient.mul_(grad_loss)
        return d_hidden, d_weight, None, None, None, None


def _chunk_loss_and_gradient(
    logits_CV: torch.Tensor, labels_C: torch.Tensor, inverse_count: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's token losses x `inverse_count`, its gradient with respect to the
    logits in their dtype): softmax - one-hot, x `inverse_count`, zero for ignored labels.

    Consumes `logits_CV`: upcast to FP32 (in place when already FP32), shifted by the row
    maximum, exponentiated and scaled in place, so the chunk holds one FP32 copy."""
    compute_dtype = logits_CV.dtype
    z_CV = logits_CV.float()
    del logits_CV
    labelled_C = labels_C != IGNORE_LABEL
    targets_C1 = torch.where(labelled_C, labels_C, 0)[:, None]
    z_CV.sub_(z_CV.amax(dim=-1, keepdim=True))  # softmax is shift-invariant; exp <= 1
    target_C1 = z_CV.gather(1, targets_C1)
    z_CV.exp_()
    sum_exp_C1 = z_CV.sum(dim=-1, keepdim=True)
    scale_C1 = labelled_C[:, None].to(torch.float32) * inverse_count
    loss = ((sum_exp_C1.log() - target_C1) * scale_C1).sum()  # -log softmax at the label
    z_CV.mul_(scale_C1 / sum_exp_C1)  # softmax x scale
    z_CV.scatter_add_(1, targets_C1, -scale_C1)  # - one-hot x scale
    return loss, z_CV.to(compute_dtype)


class _HeadGradients:
    """The gradients of the hidden states (their dtype) and of the head weight (an FP32
    accumulator, or wider with a wider compute dtype), filled chunk by chunk."""

    def __init__(
        self,
        hidden_NE: torch.Tensor,
        weight_VE: torch.Tensor,
        compute_dtype: torch.dtype,
        needs_input_grad: tuple[bool, ...],
    ) -> None:
        wants_hidden, wants_weight = needs_input_grad[:2]
        accumulate_dtype = torch.promote_types(compute_dtype, torch.float32)
        self.weight_dtype = weight_VE.dtype
        self.hidden = torch.empty_like(hidden_NE) if wants_hidden else None
        self.weight = (
            torch.zeros(weight_VE.shape, dtype=accumulate_dtype, device=weight_VE.device)
            if wants_weight
            else None
        )

    def add_chunk(
        self,
        gradient_CV: torch.Tensor,
        hidden_CE: torch.Tensor,
        weight_VE: torch.Tensor,
        start: int,
    ) -> None:
        """Write the chunk's rows of d hidden = gradient @ W and add gradient.T @ hidden to
        d W (one GEMM into the accumulator, or slab by slab through a compute-dtype partial
        when the compute dtype is narrower)."""
        if self.hidden is not None:
            rows_CE = self.hidden[start : start + gradient_CV.shape[0]]
            if rows_CE.dtype == gradient_CV.dtype:
                torch.mm(gradient_CV, weight_VE, out=rows_CE)
            else:
                rows_CE.copy_(torch.mm(gradient_CV, weight_VE))
        if self.weight is None:
            return
        if gradient_CV.dtype == self.weight.dtype:
            self.weight.addmm_(gradient_CV.t(), hidden_CE)
            return
        vocab, hidden = self.weight.shape
        rows = weight_gradient_slab_rows(vocab, hidden, gradient_CV.element_size())
        for low in range(0, vocab, rows):
            partial = torch.mm(gradient_CV[:, low : low + rows].t(), hidden_CE)
            self.weight[low : low + rows].add_(partial)
            del partial

    def finish(self, hidden_shape: torch.Size) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(d hidden in the hidden states' shape, d W in the weight's dtype); the FP32
        accumulator is freed once cast."""
        d_hidden = None if self.hidden is None else self.hidden.view(hidden_shape)
        d_weight, self.weight, self.hidden = self.weight, None, None
        if d_weight is not None and d_weight.dtype != self.weight_dtype:
            d_weight = d_weight.to(self.weight_dtype)
        return d_hidden, d_weight
