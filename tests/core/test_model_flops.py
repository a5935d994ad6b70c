"""Tests of hexiseq.model (presets, validation) and hexiseq.flops (FLOP accounting,
docs/design.md §2).

The expected FLOPs are worked out by hand from each model's published shapes, written here as
literal numbers, so that a slip in the library's formulas or in models.yaml shows up.
"""

from __future__ import annotations

import pytest

from hexiseq import InputError, ModelSpec, TrainSpec, model_presets
from hexiseq.flops import (
    attention_flops,
    causal_pairs,
    hardware_flops_per_step,
    head_flops_per_token,
    linear_flops_per_token,
    matmul_params,
    model_flops_per_step,
    standard_flops_estimate,
)

DESIGN_MODELS = [
    "llama3.2-3b",
    "llama2-7b",
    "llama3-8b",
    "llama2-13b",
    "qwen2.5-14b",
    "llama-30b",
    "llama3-70b",
]


def _spec(**overrides: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "m",
        "layers": 2,
        "hidden": 64,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "ffn_hidden": 128,
        "vocab": 100,
    }
    fields.update(overrides)
    return ModelSpec(**fields)  # type: ignore[arg-type]


# --- presets ------------------------------------------------------------------------------------


def test_design_presets_and_a_tiny_model_exist():
    presets = model_presets()
    assert [name for name in DESIGN_MODELS if name not in presets] == []
    assert "tiny" in presets
    assert presets["tiny"].params < 1_000_000  # small enough for CPU runs


@pytest.mark.parametrize(
    ("name", "published_params"),
    [
        # Parameter counts of the published checkpoints (Hugging Face safetensors totals).
        ("llama3.2-3b", 3_212_749_824),
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("llama2-13b", 13_015_864_320),
        ("llama-30b", 32_528_943_616),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_preset_parameter_counts_match_published(name, published_params):
    assert ModelSpec.preset(name).params == published_params


def test_qwen_count_leaves_out_only_the_qkv_biases():
    # Qwen2.5-14B has 14,770,033,664 parameters including q/k/v biases:
    # 48 layers * (5120 + 1024 + 1024) = 344,064 bias weights, which models.yaml leaves out.
    assert ModelSpec.preset("qwen2.5-14b").params == 14_770_033_664 - 48 * (5120 + 1024 + 1024)


def test_llama2_7b_shapes():
    model = ModelSpec.preset("llama2-7b")
    shape = (model.layers, model.hidden, model.heads, model.kv_heads, model.head_dim)
    assert shape == (32, 4096, 32, 32, 128)
    assert (model.ffn_hidden, model.vocab, model.tied_embeddings) == (11008, 32000, False)
    assert model.gqa_ratio == 1
    assert ModelSpec.preset("llama3-70b").gqa_ratio == 8


def test_preset_round_trips_through_dict():
    model = ModelSpec.preset("llama3.2-3b")
    assert ModelSpec.from_dict(model.to_dict()) == model


def test_unknown_model_preset_lists_presets():
    with pytest.raises(InputError, match=r"unknown model preset 'gpt5'; presets: .*llama2-7b"):
        ModelSpec.preset("gpt5")


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 5), (8, 3), (4, 8)])
def test_kv_heads_must_divide_heads(heads, kv_heads):
    with pytest.raises(
        InputError, match=rf"kv_heads \({kv_heads}\) must divide heads \({heads}\)"
    ):
        _spec(heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize(
    "field_name", ["layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab"]
)
@pytest.mark.parametrize("value", [0, -4, 2.5, 1e300, "8", True, 2**24 + 1])
def test_shape_fields_must_be_positive_whole_numbers(field_name, value):
    with pytest.raises(InputError, match=rf"model m: {field_name} must be a whole number in"):
        _spec(**{field_name: value})


def test_train_spec_validation_and_tokens_per_step():
    assert TrainSpec(seq_len=4096, micro_batches=3).tokens_per_step == 12288
    with pytest.raises(InputError, match=r"seq_len must be at least 2"):
        TrainSpec(seq_len=1)
    with pytest.raises(InputError, match=r"micro_batches must be positive"):
        TrainSpec(seq_len=4096, micro_batches=0)


# --- FLOP accounting, by hand -------------------------------------------------------------------


def test_llama2_7b_flops_at_4k_by_hand():
    model = ModelSpec.preset("llama2-7b")
    T = 4096
    # L=32, hidden=4096, heads=kv_heads=32, head_dim=128, ffn=11008, vocab=32000.
    # Matmul weights of one layer: q,o (4096x4096 each) + k,v (4096x4096 each, MHA) + SwiGLU (3).
    layer_weights = 4096 * 128 * (2 * 32 + 2 * 32) + 3 * 4096 * 11008
    assert layer_weights == 67_108_864 + 135_266_304 == 202_375_168
    linear_fwd_per_token = 2 * 32 * layer_weights  # 2 FLOPs per multiply-add, 32 layers
    assert linear_fwd_per_token == 12_952_010_752
    head_fwd_per_token = 2 * 4096 * 32000
    assert head_fwd_per_token == 262_144_000
    pairs = 4096 * 4097 // 2  # causal (query, key) pairs with key <= query
    assert pairs == 8_390_656
    attention_fwd = 32 * 4 * 128 * 32 * pairs  # layers * (QK^T + PV = 4*head_dim) * heads * pairs
    assert attention_fwd == 4_399_120_252_928
    # Model FLOPs (MFU convention): forward + 2x backward, for matmuls and attention alike.
    expected = 3 * (linear_fwd_per_token + head_fwd_per_token) * T + 3 * attention_fwd
    assert expected == 162_375_533_592_576 + 13_197_360_758_784 == 175_572_894_351_360

    assert model_flops_per_step(model, T) == pytest.approx(expected, rel=1e-12)

    # 6*N*T + 6*L*H*D*T^2, N = matmul weights = 32 layers + LM head (untied embedding excluded).
    N = 32 * layer_weights + 32000 * 4096
    assert N == 6_607_077_376 == matmul_params(model)
    standard = 6 * N * T + 6 * 32 * 32 * 128 * T**2
    assert standard == 162_375_533_592_576 + 13_194_139_533_312
    assert standard_flops_estimate(model, T) == pytest.approx(standard, rel=1e-12)
    assert model_flops_per_step(model, T) == pytest.approx(standard, rel=0.01)

    # Executed FLOPs with activation checkpointing: linear 1+2+1 = 4x forward, attention
    # 1 + 2.5 (FlashAttention backward) + 1 (recompute) = 4.5x, LM head 3x (not recomputed).
    linear_fwd = linear_fwd_per_token * T
    head_fwd = head_fwd_per_token * T
    assert (linear_fwd, head_fwd) == (53_051_436_040_192, 1_073_741_824_000)
    hardware = 4 * linear_fwd + 3 * head_fwd + 4.5 * attention_fwd
    assert hardware_flops_per_step(model, T, activation_checkpointing=True) == pytest.approx(
        hardware, rel=1e-12
    )
    no_recompute = 3 * linear_fwd + 3 * head_fwd + 3.5 * attention_fwd
    assert hardware_flops_per_step(model, T, activation_checkpointing=False) == pytest.approx(
        no_recompute, rel=1e-12
    )


def test_llama_30b_flops_at_512k_by_hand():
    model = ModelSpec.preset("llama-30b")
    T = 524288  # 512K
    # L=60, hidden=6656, heads=kv_heads=52, head_dim=128, ffn=17920, vocab=32000.
    layer_weights = 6656 * 128 * (2 * 52 + 2 * 52) + 3 * 6656 * 17920
    assert layer_weights == 177_209_344 + 357_826_560 == 535_035_904
    linear_fwd_per_token = 2 * 60 * layer_weights
    assert linear_fwd_per_token == 64_204_308_480
    head_fwd_per_token = 2 * 6656 * 32000
    assert head_fwd_per_token == 425_984_000
    pairs = 524288 * 524289 // 2
    assert pairs == 137_439_215_616
    attention_fwd = 60 * 4 * 128 * 52 * pairs
    assert attention_fwd == 219_550_900_593_623_040
    linear_fwd = linear_fwd_per_token * T
    head_fwd = head_fwd_per_token * T
    assert (linear_fwd, head_fwd) == (33_661_548_484_362_240, 223_338_299_392_000)
    expected = 3 * (linear_fwd + head_fwd) + 3 * attention_fwd
    assert expected == 760_307_362_132_131_840  # attention is ~87 % of it at 512K

    assert model_flops_per_step(model, T) == pytest.approx(expected, rel=1e-12)

    N = 60 * layer_weights + 32000 * 6656
    assert N == 32_315_146_240 == matmul_params(model)
    standard = 6 * N * T + 6 * 60 * 52 * 128 * T**2
    assert standard == 101_654_660_351_262_720 + 658_651_445_502_935_040
    assert standard_flops_estimate(model, T) == pytest.approx(standard, rel=1e-12)
    assert model_flops_per_step(model, T) == pytest.approx(standard, rel=0.01)

    hardware = 4 * linear_fwd + 3 * head_fwd + 4.5 * attention_fwd
    assert hardware_flops_per_step(model, T, activation_checkpointing=True) == pytest.approx(
        hardware, rel=1e-12
    )


def test_gqa_shrinks_only_the_kv_projections():
    model = ModelSpec.preset("llama3-8b")
    # q, o: 4096 x (32*128); k, v: 4096 x (8*128); SwiGLU 3 x 4096 x 14336.
    assert linear_flops_per_token(model) == 2 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336)
    assert head_flops_per_token(model) == 2 * 4096 * 128256


def test_tied_embeddings_count_the_lm_head_matrix_once():
    model = ModelSpec.preset("llama3.2-3b")
    assert model.tied_embeddings
    layer_weights = 3072 * 128 * (2 * 24 + 2 * 8) + 3 * 3072 * 8192
    assert matmul_params(model) == 28 * layer_weights + 128256 * 3072
    # Tied: the parameter count holds one vocab x hidden table, plus 2 norms per layer + final.
    assert model.params == matmul_params(model) + (2 * 28 + 1) * 3072


def test_attention_primitives():
    assert causal_pairs(1) == 1
    assert causal_pairs(4) == 10  # 1 + 2 + 3 + 4
    assert attention_flops(pairs=10, heads=3, head_dim=16) == 4 * 16 * 10 * 3


@pytest.mark.parametrize("name", sorted(model_presets()))
@pytest.mark.parametrize("seq_len", [2048, 131072, 1048576])
def test_model_flops_agree_with_standard_estimate_within_one_percent(name, seq_len):
    model = ModelSpec.preset(name)
    assert model_flops_per_step(model, seq_len) == pytest.approx(
        standard_flops_estimate(model, seq_len), rel=0.01
    )


@pytest.mark.parametrize("name", DESIGN_MODELS)
def test_checkpointing_costs_between_one_and_one_and_a_half_extra_forward(name):
    model = ModelSpec.preset(name)
    with_ckpt = hardware_flops_per_step(model, 65536, activation_checkpointing=True)
    without = hardware_flops_per_step(model, 65536, activation_checkpointing=False)
    model_flops = model_flops_per_step(model, 65536)
    assert model_flops < without < with_ckpt
    # Recompute adds one forward of the layers: 1/3.5 of `without` for attention alone (4.5 vs
    # 3.5), 1/3 for matmuls alone (4 vs 3), less with the LM head that is not recomputed.
    assert 1 + 1 / 3.5 - 0.05 < with_ckpt / without < 1 + 1 / 3
