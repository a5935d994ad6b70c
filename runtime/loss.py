"""The training loss over a sequence sharded across ranks, and the gradient reduction.

The loss is the mean next-token cross-entropy over ALL labelled tokens of the sequence: each
rank sums the losses of its own tokens and divides by the *global* count of labelled tokens,
so the ranks' shares add up to the true mean whatever the shard sizes. (A mean of per-rank
means would weight the tokens of a small shard more than those of a large one.) The label of
the token at global position p is the token at p + 1; the last position has none.

Each rank back-propagates only its own share, so the full gradient is the SUM of the ranks'
gradients: `all_reduce_gradients` for replicated parameters, FSDP2's reduce-scatter for
sharded ones (`sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as functional

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

    Without an initialized process group it is the plain single-process mean.
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
