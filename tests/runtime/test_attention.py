"""Tier 1: `CPHPAttention` in a one-rank gloo group (in process): results and refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from attention_cases import Case, check_case, random_cases
from hypothesis import given, settings
from hypothesis import strategies as st

from hexiseq import InputError, build_uniform_layout, build_zigzag_layout
from hexiseq.runtime import CPHPAttention


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_one_rank_matches_reference(one_rank_group, seed):
    for case in random_cases(seed, world_size=1, count=4):
        check_case(case, rank=0)


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_ratio_four_with_several_batches(one_rank_group, causal):
    layout = build_zigzag_layout(10, 8, 2, [[0]], [10], [[1]], [[8]])
    check_case(Case(layout, causal, batch=3, seed=11), rank=0)


def inputs(layout, tokens=None, heads=None, kv_heads=None, dtype=torch.float32):
    tokens = layout.num_tokens(0) if tokens is None else tokens
    heads = layout.num_heads if heads is None else heads
    kv_heads = layout.num_kv_heads if kv_heads is None else kv_heads
    q = torch.randn(1, tokens, heads, 8)
    return q, torch.randn(1, tokens, kv_heads, 8).to(dtype), torch.randn(1, tokens, kv_heads, 8)


def test_refuses_a_layout_for_another_world_size(one_rank_group):
    layout = build_uniform_layout(8, 4, 2, [2])
    with pytest.raises(InputError, match="layout is for 2 ranks but the process group has 1"):
        CPHPAttention(layout)


def test_refuses_an_invalid_layout(one_rank_group):
    layout = build_uniform_layout(8, 4, 2, [1])
    broken = dataclasses.replace(layout, token_ranges=(((0, 5), (4, 8)),))
    with pytest.raises(InputError, match="invalid layout"):
        CPHPAttention(broken)
    with pytest.raises(InputError, match="need an AttentionLayout"):
        CPHPAttention(layout.to_dict())


@pytest.mark.parametrize(
    "change,message",
    [
        ({"heads": 3}, r"q has shape \(1, 8, 3, 8\); the layout needs \(1, 8, 4, 8\)"),
        ({"kv_heads": 4}, r"k has shape \(1, 8, 4, 8\); the layout needs \(1, 8, 2, 8\)"),
        ({"tokens": 7}, r"T_local=8 tokens"),
        ({"dtype": torch.float64}, "need one floating-point dtype"),
    ],
)
def test_refuses_inputs_that_do_not_fit_the_layout(one_rank_group, change, message):
    layout = build_uniform_layout(8, 4, 2, [1])
    with pytest.raises(InputError, match=message):
        CPHPAttention(layout)(*inputs(layout, **change))


def test_refuses_without_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        CPHPAttention(build_uniform_layout(8, 4, 2, [1]))


def test_bfloat16_runs_in_bfloat16_close_to_reference(one_rank_group):
    from attention_cases import full_inputs, reference_results, relative_error

    layout = build_zigzag_layout(12, 4, 2, [[0]], [12], [[1]], [[4]])
    case = Case(layout, True, batch=2, seed=3)
    leaves = [x.bfloat16().requires_grad_() for x in full_inputs(case)[:3]]
    out = CPHPAttention(layout)(*leaves)
    out.backward(full_inputs(case)[3].bfloat16())
    for got, want in zip([out, *(x.grad for x in leaves)], reference_results(case)):
        assert got.dtype == torch.bfloat16
        assert relative_error(got.float(), want) <= 2e-2
