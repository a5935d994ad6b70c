"""A user's own model from a Hugging Face config.json, a local hub cache or a YAML file
(`hexiseq.model_files.load_model`), and one clear line for every config it cannot model."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_main

from hexiseq.errors import InputError
from hexiseq.model import ModelSpec
from hexiseq.model_files import load_model

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json (the fields that shape the model)
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
QWEN25_14B = {  # Qwen/Qwen2.5-14B config.json
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}


def _write(directory, document, name="config.json"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(document))
    return path


def test_a_config_json_gives_the_same_model_as_the_preset_of_it(tmp_path):
    model = load_model(str(_write(tmp_path / "Llama-3.1-8B", LLAMA_31_8B)))
    preset = ModelSpec.preset("llama3-8b")  # Llama 3 8B: the same shapes as 3.1
    assert model.name == "Llama-3.1-8B" and model.params == preset.params == 8_030_261_248
    assert (model.kv_heads, model.head_dim, model.rope_theta, model.norm_eps) == (
        8, 128, 500000.0, 1e-5,
    )  # fmt: skip
    assert "rope_scaling not applied" in model.source


def test_a_directory_or_the_local_hub_cache_finds_the_config(tmp_path, monkeypatch):
    qwen = load_model(str(_write(tmp_path / "qwen", QWEN25_14B).parent))
    assert qwen.params == ModelSpec.preset("qwen2.5-14b").params and qwen.norm_eps == 1e-6
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    _write(snapshot, LLAMA_31_8B)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cached = load_model("meta-llama/Llama-3.1-8B")
    assert cached.name == "Llama-3.1-8B" and cached.source.startswith("meta-llama/Llama-3.1-8B")


def test_a_yaml_of_modelspec_fields(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "layers: 4\nhidden: 512\nheads: 8\nkv_heads: 2\nhead_dim: 64\nffn_hidden: 1376\n"
        "vocab: 32000\ntied_embeddings: true\nrope_theta: 1000000.0\n"
    )
    model = load_model(str(path))
    assert (model.name, model.kv_heads, model.tied_embeddings, model.rope_theta) == (
        "mine", 2, True, 1e6,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, r"model_type: .*'llama', 'qwen2' or 'mistral'"),
        ({"hidden_act": "gelu"}, r"hidden_act: .*'silu'"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"vocab_size": 10**30}, "vocab_size"),
        ({"rope_theta": -1}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"num_key_value_heads": 7}, r"kv_heads \(7\) must divide heads \(32\)"),
        ({"num_attention_heads": 30}, "hidden_size 4096 is not a multiple of num_attention"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window attention"),
    ],
)
def test_configs_it_cannot_model_get_one_line(tmp_path, change, message):
    path = _write(tmp_path / "m", {**LLAMA_31_8B, **change})
    with pytest.raises(InputError, match=message) as caught:
        load_model(str(path))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1, 2]", "model config"),
    ],
)
def test_files_that_are_not_configs_get_one_line(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text)
    with pytest.raises(InputError, match=message):
        load_model(str(path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("layers: 2.5\n", "layers must be a whole number"),
        ("layers: 2\nhidden: 1.0e300\n", "hidden must be a whole number"),
        ("- 1\n", "need a mapping"),
        ("layers: 2\ncolour: red\n", "colour"),
        ("tied_embeddings: 'no'\n", "tied_embeddings must be true or false"),
    ],
)
def test_yaml_models_that_are_not_models_get_one_line(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        load_model(str(path))


def test_a_name_that_is_nothing_lists_what_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="not a preset, a file, or a Hugging Face hub name"):
        load_model("meta-llama/Not-There")


def test_hexiseq_plan_takes_a_config_json_and_plans_that_model(tmp_path):
    config = _write(tmp_path / "Llama-3.1-8B", LLAMA_31_8B)
    out = tmp_path / "plan.json"
    done = run_main(
        ["plan", "--cluster", "h100x8-a100x8", "--model", str(config.parent), "--seq-len",
         "64k", "--no-store", "--out", str(out), "--json"]
    )  # fmt: skip
    assert done.code == 0, done.stderr
    assert json.loads(done.stdout)["model"] == "Llama-3.1-8B"
    planned = json.loads(out.read_text())["model"]
    assert (planned["rope_theta"], planned["kv_heads"], planned["name"]) == (
        500000.0, 8, "Llama-3.1-8B",
    )  # fmt: skip
    bad = run_main(["plan", "--cluster", "h100x8", "--model", "nope", "--seq-len", "8k"])
    assert bad.code == 2 and "not a preset, a file" in bad.stderr
