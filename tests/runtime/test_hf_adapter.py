"""A plan applied to Hugging Face transformers models (`hexiseq.runtime.hf`): Llama and Qwen2
decoders with their attention swapped for `CPHPAttention`, over the whole world or over
replica groups, against the unpatched model in one process (fp32, fresh random weights and
tokens: loss and every parameter's gradient within relative error 1e-5)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist
from attention_cases import random_layout
from distributed import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiproc

TOLERANCE = 1e-5
HEAD_DIM = 8


def _config(model_type: str, num_heads: int, num_kv_heads: int):
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(
        hidden_size=num_heads * HEAD_DIM,
        intermediate_size=3 * num_heads * HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=101,
        rope_theta=500_000.0,
    )
    return LlamaConfig(**shape) if model_type == "llama" else Qwen2Config(**shape)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / scale if scale > 0 else difference


def _check_replica(group_rank, group, ranks, model_type, seed) -> None:
    from transformers import AutoModelForCausalLM

    from hexiseq.runtime import hf

    layout = random_layout(random.Random(seed), len(ranks))
    config = _config(model_type, layout.num_heads, layout.num_kv_heads)
    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, layout.seq_len))

    hf.apply_layout(model, layout, group)
    ids, positions = hf.shard_tokens(tokens, layout, group_rank)
    logits = model(input_ids=ids, position_ids=positions).logits
    loss = hf.sequence_loss(logits, tokens, layout, group_rank, group)
    loss.local_share.backward()
    hf.reduce_gradients(model, group)

    expected = reference(input_ids=tokens, labels=tokens).loss
    expected.backward()
    assert _relative_error(loss.global_loss.double(), expected.detach().double()) <= TOLERANCE
    for (name, parameter), twin in zip(model.named_parameters(), reference.parameters()):
        error = _relative_error(parameter.grad, twin.grad)
        assert error <= TOLERANCE, f"{model_type} {name}: gradient error {error:.2e}"


def _run(rank: int, world_size: int, replicas, model_type: str, seed: int) -> None:
    groups = [None] if replicas is None else [dist.new_group(r) for r in replicas]
    replicas = replicas or [list(range(world_size))]
    for index, (ranks, group) in enumerate(zip(replicas, groups)):
        if rank in ranks:
            group_rank = dist.get_rank(group)
            _check_replica(group_rank, group, ranks, model_type, seed + 7919 * index)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_patched_model_matches_the_unpatched_one_over_the_world(model_type):
    run_distributed(_run, 3, None, model_type, 20261123)


def test_replicas_each_run_their_own_layout_of_the_model():
    run_distributed(_run, 4, [[0, 3], [1, 2]], "llama", 11)


def test_a_model_whose_heads_differ_from_the_layouts_is_refused_before_any_collective():
    from transformers import AutoModelForCausalLM

    from hexiseq import InputError, build_zigzag_layout
    from hexiseq.runtime import hf

    model = AutoModelForCausalLM.from_config(_config("llama", 4, 2))
    layout = build_zigzag_layout(16, 8, 2, [[0]], [16], [[1]], [[8]])
    with pytest.raises(InputError, match="the model has 4 query and 2 K/V heads but the layout"):
        hf.apply_layout(model, layout)
    with pytest.raises(InputError, match="a Hugging Face PreTrainedModel"):
        hf.apply_layout(torch.nn.Linear(2, 2), layout)
