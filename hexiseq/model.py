"""Model and training specs: transformer shapes (Llama family) and the training knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from hexiseq._yaml import read_packaged_yaml
from hexiseq.errors import InputError

MAX_MODEL_DIMENSION = 2**24
"""Largest layer count, width, head count or vocabulary a model may have (16,777,216)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU); contract fields of docs/design.md §2."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    tied_embeddings: bool = False
    source: str = ""
    rope_theta: float = 10_000.0
    """RoPE base (config.json `rope_theta`; Su et al. 2021, eq. 15): 10,000 for Llama 1/2,
    500,000 for Llama 3, 1,000,000 for Qwen2.5. (Llama 3.2's long-context frequency
    scaling is not modelled.)"""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (config.json `rms_norm_eps`)."""

    def __post_init__(self) -> None:
        for field_name in (
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "ffn_hidden",
            "vocab",
        ):
            value = getattr(self, field_name)
            if type(value) is not int or not 1 <= value <= MAX_MODEL_DIMENSION:
                raise InputError(
                    f"model {self.name}: {field_name} must be a whole number in "
                    f"1..{MAX_MODEL_DIMENSION} (got {value!r})"
                )
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"model name must be a non-empty string (got {self.name!r})")
        if not isinstance(self.source, str):
            raise InputError(f"model {self.name}: source must be a string (got {self.source!r})")
        if type(self.tied_embeddings) is not bool:
            raise InputError(
                f"model {self.name}: tied_embeddings must be true or false "
                f"(got {self.tied_embeddings!r})"
            )
        for field_name in ("rope_theta", "norm_eps"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InputError(
                    f"model {self.name}: {field_name} must be a positive number (got {value!r})"
                )
            if value == float("inf"):
                raise InputError(f"model {self.name}: {field_name} must be finite")
        if self.heads % self.kv_heads:
            raise InputError(
                f"model {self.name}: kv_heads ({self.kv_heads}) must divide heads ({self.heads})"
            )

    @property
    def gqa_ratio(self) -> int:
        return self.heads // self.kv_heads

    @property
    def params_per_layer(self) -> int:
        """Weights of one block: q, k, v, o projections, SwiGLU's three matrices, two norms."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn_hidden
        return attention + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """The input embedding table (a lookup, no FLOPs)."""
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head matrix (shared with the embedding when tied) plus the final norm."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.hidden

    @property
    def params(self) -> int:
        """Total parameter count."""
        return self.layers * self.params_per_layer + self.embedding_params + self.head_params

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> ModelSpec:
        """Rebuild from `to_dict`; `InputError` naming missing or unknown fields."""
        return cls(**_known_fields(cls, document, "model"))

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A bundled model (`model_presets()` lists them)."""
        presets = model_presets()
        if name not in presets:
            raise InputError(f"unknown model preset '{name}'; presets: {', '.join(presets)}")
        return presets[name]


@cache
def model_presets() -> dict[str, ModelSpec]:
    """All models of `hexiseq/data/models.yaml`, by name."""
    raw = read_packaged_yaml("models.yaml")["models"]
    return {name: ModelSpec(name=name, **entry) for name, entry in raw.items()}


RUNTIME_RECIPES = ("sharded", "autocast")


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """What one training step processes and how.

    `seq_len` tokens form one sequence spread over the whole CP-HP domain; `micro_batches`
    sequences are processed one after another per step (gradient accumulation).
    `activation_checkpointing` keeps only each layer's input and recomputes the layer in the
    backward pass. Parameters are BF16 in compute, optimizer states FP32 (Adam).
    """

    seq_len: int
    micro_batches: int = 1
    activation_checkpointing: bool = True
    bytes_per_param_state: int = 16  # ZeRO paper (Rajbhandari et al. 2020) mixed-precision Adam
    compute_dtype_bytes: int = 2
    runtime_recipe: str = "sharded"
    """How the runtime holds and updates the weights, which the memory model and the step
    simulator count: `sharded` (what `hexiseq.runtime` runs: FP32 master shards in the plan's
    state fractions, weights gathered in the compute dtype, fused AdamW) or `autocast` (the
    runtime before it, on one rank: whole FP32 weights under autocast, foreach AdamW; the
    shared real-GPU runs were taken with it)."""

    def __post_init__(self) -> None:
        for field_name in (
            "seq_len",
            "micro_batches",
            "bytes_per_param_state",
            "compute_dtype_bytes",
        ):
            _check_positive_int("train", field_name, getattr(self, field_name))
        if self.seq_len < 2:
            raise InputError(f"train: seq_len must be at least 2 tokens (got {self.seq_len})")
        if not isinstance(self.activation_checkpointing, bool):
            raise InputError("train: activation_checkpointing must be true or false")
        if self.runtime_recipe not in RUNTIME_RECIPES:
            raise InputError(
                f"train: runtime_recipe must be one of {', '.join(RUNTIME_RECIPES)} "
                f"(got {self.runtime_recipe!r})"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> TrainSpec:
        """Rebuild from `to_dict`; `InputError` naming missing or unknown fields."""
        return cls(**_known_fields(cls, document, "train"))


def _check_positive_int(owner: str, field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{owner}: {field_name} must be a whole number (got {value!r})")
    if value <= 0:
        raise InputError(f"{owner}: {field_name} must be positive (got {value})")


def _known_fields(cls: type, document: Any, what: str) -> dict[str, Any]:
    """`document` if its keys are exactly the dataclass's fields (defaults may be left out)."""
    if not isinstance(document, dict):
        raise InputError(f"{what}: expected a mapping (got {type(document).__name__})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(document) - set(fields))
    if unknown:
        raise InputError(
            f"{what}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(fields)}"
        )
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in document]
    if missing:
        raise InputError(f"{what}: missing field(s) {', '.join(missing)}")
    return document
