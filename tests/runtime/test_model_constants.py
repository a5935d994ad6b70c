"""RoPE base and RMSNorm epsilon come from the `ModelSpec` (issue 12): the Llama 3 and
Qwen2.5 presets are the models their names say."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hexiseq import ModelSpec
from hexiseq.errors import InputError
from hexiseq.runtime.model import LocalAttention, build_model, rope_tables


@pytest.mark.parametrize(
    ("preset", "theta", "eps"),
    [
        ("llama2-7b", 10_000.0, 1e-5),
        ("llama3.2-3b", 500_000.0, 1e-5),
        ("llama3-70b", 500_000.0, 1e-5),
        ("qwen2.5-14b", 1_000_000.0, 1e-6),
        ("llama-30b", 10_000.0, 1e-6),
    ],
)
def test_presets_carry_their_config_values(preset, theta, eps):
    spec = ModelSpec.preset(preset)
    assert (spec.rope_theta, spec.norm_eps) == (theta, eps)
    assert ModelSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(("field", "value"), [("rope_theta", 0.0), ("norm_eps", -1e-6)])
def test_non_positive_values_are_refused(field, value):
    spec = ModelSpec.preset("tiny")
    with pytest.raises(InputError, match=field):
        dataclasses.replace(spec, **{field: value})


def test_the_model_rotates_and_normalizes_with_the_specs_values():
    spec = dataclasses.replace(ModelSpec.preset("tiny"), rope_theta=500_000.0, norm_eps=1e-3)
    model = build_model(spec, LocalAttention(), seed=1)
    positions = torch.tensor([0, 1, 7, 300_000])
    cos, _ = rope_tables(positions, spec.head_dim, torch.float64, spec.rope_theta)
    # Pair i turns by position x theta^(-2i/D); the slowest pair (i = D/2 - 1) shows theta.
    slowest = spec.head_dim // 2 - 1
    angle = 300_000 * 500_000.0 ** (-2 * slowest / spec.head_dim)
    assert cos[3, slowest].item() == pytest.approx(math.cos(angle), rel=1e-12)
    norm = model.blocks[0].attention_norm
    assert norm.eps == 1e-3
    x = torch.randn(3, spec.hidden) * 1e-2  # small enough that eps matters
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)
    assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-7)
