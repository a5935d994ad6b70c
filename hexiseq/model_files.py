"""A user's own model: `load_model` turns a preset name, a Hugging Face `config.json`, a
hub-style name whose config is in the local Hugging Face cache, or a small YAML of
`ModelSpec` fields into a `ModelSpec`.

Only Llama-style decoders are accepted (RMSNorm, RoPE, GQA, SwiGLU: `model_type` llama,
qwen2 or mistral without sliding-window attention), since that is what the cost model and
the runtime compute. Read from a config: layers, hidden size, heads, K/V heads, head size
(`head_dim`, else hidden / heads), FFN size, vocabulary, tied embeddings, RoPE theta and the
norm epsilon. Biases (Qwen2's q/k/v) are left out as in the presets (< 0.01 % of parameters
and FLOPs), and `rope_scaling` (Llama 3.1's long-context frequency scaling) is noted in the
model's `source` but not applied: it changes no FLOP or byte, only which angles RoPE uses.
Nothing is downloaded: a hub name must already be in the cache.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hexiseq._yaml import format_validation_error, read_yaml_file
from hexiseq.errors import InputError
from hexiseq.model import MAX_MODEL_DIMENSION, ModelSpec, model_presets

__all__ = ["LLAMA_STYLE_TYPES", "load_model", "model_from_hf_config"]

LLAMA_STYLE_TYPES = ("llama", "qwen2", "mistral")
"""`model_type`s of Llama-style decoders (RMSNorm, RoPE, GQA, SwiGLU)."""
_MAX_DIMENSION = MAX_MODEL_DIMENSION
"""Largest layer count, width, head count or vocabulary accepted (16,777,216)."""
_MAX_CONFIG_BYTES = 2**20

PositiveDimension = Annotated[int, Field(strict=True, ge=1, le=_MAX_DIMENSION)]
PositiveFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class HFLlamaConfig(BaseModel):
    """The fields of a Hugging Face `config.json` that shape a Llama-style model (others are
    ignored: a config carries many)."""

    model_config = ConfigDict(extra="ignore")

    model_type: Literal["llama", "qwen2", "mistral"]
    hidden_size: PositiveDimension
    num_hidden_layers: PositiveDimension
    num_attention_heads: PositiveDimension
    num_key_value_heads: PositiveDimension | None = None
    head_dim: PositiveDimension | None = None
    intermediate_size: PositiveDimension
    vocab_size: PositiveDimension
    hidden_act: Literal["silu"] = "silu"
    tie_word_embeddings: bool = False
    rope_theta: PositiveFinite = 10_000.0
    rms_norm_eps: PositiveFinite = 1e-6
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    use_sliding_window: bool = False


def load_model(name_or_path: str) -> ModelSpec:
    """The model `name_or_path` names: a preset, a `config.json` (or a directory holding
    one), a YAML file of `ModelSpec` fields, or a hub name (`org/model`) cached locally.

    Raises InputError naming what was given and what is accepted.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InputError(f"model must be a preset name or a file path, got {name_or_path!r}")
    presets = model_presets()
    if name_or_path in presets:
        return presets[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        if path.suffix.lower() in (".yaml", ".yml"):
            return _model_from_yaml(path)
        return model_from_hf_config(_read_json(path), source=str(path), name=_name_for(path))
    cached = _cached_hub_config(name_or_path)
    if cached is not None:
        return model_from_hf_config(_read_json(cached), source=f"{name_or_path} (local cache)",
                                    name=name_or_path.rsplit("/", 1)[-1])  # fmt: skip
    raise InputError(
        f"model {name_or_path!r} is not a preset, a file, or a Hugging Face hub name in the "
        f"local cache; presets: {', '.join(presets)}; or give a config.json, a directory "
        "holding one, or a YAML of ModelSpec fields"
    )


def model_from_hf_config(document: Any, source: str, name: str) -> ModelSpec:
    """A `ModelSpec` from a parsed Hugging Face `config.json` document."""
    try:
        config = HFLlamaConfig.model_validate(document)
    except ValidationError as error:
        message = format_validation_error(error, f"model config {source}")
        raise InputError(
            f"{message} (hexiseq models Llama-style decoders: model_type "
            f"{', '.join(LLAMA_STYLE_TYPES)} with hidden_act silu)"
        ) from None
    if config.sliding_window is not None and (
        config.model_type == "mistral" or config.use_sliding_window
    ):
        raise InputError(
            f"model config {source}: sliding-window attention ({config.sliding_window} tokens) "
            "is not what hexiseq's attention computes; use a config with sliding_window null"
        )
    heads = config.num_attention_heads
    head_dim = config.head_dim or _even_split(config.hidden_size, heads, source)
    note = " (rope_scaling not applied)" if config.rope_scaling else ""
    return ModelSpec(
        name=name,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=config.num_key_value_heads or heads,
        head_dim=head_dim,
        ffn_hidden=config.intermediate_size,
        vocab=config.vocab_size,
        tied_embeddings=config.tie_word_embeddings,
        source=f"{source}{note}",
        rope_theta=float(config.rope_theta),
        norm_eps=float(config.rms_norm_eps),
    )


def _even_split(hidden: int, heads: int, source: str) -> int:
    if hidden % heads:
        raise InputError(
            f"model config {source}: hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads}; give head_dim"
        )
    return hidden // heads


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise InputError(f"model config {path}: larger than 1 MiB; not a config.json")
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InputError(
            f"model config {path}: cannot be read ({error.strerror or error})"
        ) from None
    except UnicodeDecodeError as error:
        raise InputError(f"model config {path}: not UTF-8 text (byte {error.start})") from None
    except (json.JSONDecodeError, RecursionError) as error:
        reason = getattr(error, "msg", "nested too deeply")
        raise InputError(f"model config {path}: not valid JSON ({reason})") from None


def _model_from_yaml(path: Path) -> ModelSpec:
    document = read_yaml_file(path, "model")
    if not isinstance(document, dict):
        raise InputError(f"model file {path}: need a mapping of ModelSpec fields")
    document = {"name": _name_for(path), "source": str(path), **document}
    fields = dict(document)
    for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab"):
        value = fields.get(field)
        if value is not None and (type(value) is not int or not 1 <= value <= _MAX_DIMENSION):
            raise InputError(
                f"model file {path}: {field} must be a whole number in 1..{_MAX_DIMENSION}, "
                f"got {value!r}"
            )
    for field in ("rope_theta", "norm_eps"):
        value = fields.get(field)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and not math.isfinite(value):
            raise InputError(f"model file {path}: {field} must be finite, got {value!r}")
    if type(fields.get("tied_embeddings", False)) is not bool:
        raise InputError(
            f"model file {path}: tied_embeddings must be true or false, "
            f"got {fields['tied_embeddings']!r}"
        )
    try:
        return ModelSpec.from_dict(fields)
    except TypeError as error:
        raise InputError(f"model file {path}: {error}") from None


def _name_for(path: Path) -> str:
    """A model's name from its file: the directory's for a config.json, else the stem."""
    if path.name == "config.json" and path.parent.name:
        return path.resolve().parent.name
    return path.stem


def _cached_hub_config(name: str) -> Path | None:
    """The config.json of hub model `org/model` in the local Hugging Face cache, if there:
    the snapshot `refs/main` names, else the newest."""
    if name.count("/") != 1 or any(part in ("", ".", "..") for part in name.split("/")):
        return None
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    repository = hub / f"models--{name.replace('/', '--')}"
    main = repository / "refs" / "main"
    if main.is_file():
        config = repository / "snapshots" / main.read_text().strip() / "config.json"
        if config.is_file():
            return config
    configs = sorted(
        (repository / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime
    )
    return configs[-1] if configs else None
