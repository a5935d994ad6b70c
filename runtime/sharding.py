"""Model states sharded over the whole CP–HP domain with FSDP2 (`fully_shard`), as the memory
model counts them (`costmodel.memory`: parameters, gradients and AdamW states split over the
ranks, plus the gathered weights of the layer at work).

Each decoder block is one FSDP unit (its weights are all-gathered before its forward, and
again before its backward, and freed after); the root unit holds the embedding, final norm
and LM head. FSDP2 cuts every parameter into equal dim-0 chunks, so each rank keeps 1/N of
the states: the memory model's even split. A plan whose search gave ranks uneven state shares
(`RankPrediction.state_fraction`) runs with even shares; `uneven_state_note` says so.

Gradients: FSDP2 reduce-scatters them as the *mean* over ranks (gloo has no pre-multiplied
sum to change that), while each rank's loss share is already its part of the global mean
(`loss.sharded_next_token_loss`), so the loss share is multiplied by the world size
(`GRADIENT_SCALE`): the reduced gradient is then the sum of the ranks' parts, as with
`all_reduce_gradients`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hexiseq.runtime.model import LlamaModel

STATE_SHARDING = ("fsdp2", "replicated")


def shard_model_states(model: LlamaModel, compute_dtype: torch.dtype | None = None) -> None:
    """Shard `model` in place: one FSDP2 unit per decoder block, the rest in the root.

    With a `compute_dtype` (bf16 training) the weights are gathered in it and gradients
    reduced in fp32, so the gathers move the compute dtype's bytes, as the simulator counts."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    options = {} if compute_dtype is None else {"mp_policy": policy}
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)


def gradient_scale(state_sharding: str) -> float:
    """What each rank's loss share is multiplied by before backward (see module docstring)."""
    return float(dist.get_world_size()) if state_sharding == "fsdp2" else 1.0


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on this rank (gathered from the shards if sharded)."""
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grads


def uneven_state_note(state_fractions: list[float]) -> str | None:
    """A note when the plan gave ranks uneven state shares, which FSDP2 cannot run."""
    even = 1.0 / len(state_fractions)
    if max(abs(f - even) for f in state_fractions) <= 1e-6:
        return None
    shares = ", ".join(f"{f:.3f}" for f in state_fractions)
    return (
        f"the plan shards model states unevenly ({shares}); FSDP2 shards them evenly "
        f"({even:.3f} each), so ranks with a larger planned share use less memory than planned "
        "and the others more"
    )
