"""The sweep grid: which sizes a profiling sweep measures, read from a YAML file the user edits.

Two grids ship in `grids/`: `full.yaml` (sized for GPUs; a CPU sweep drops the points above
`max_gflop_per_call.cpu`) and `quick.yaml` (a few minutes at most anywhere). `--grid PATH`
names another. Bad files fail with one line naming the file and the field. No torch here, so
the CLI can check a grid before it starts anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from hexiseq._yaml import format_validation_error, read_yaml_file
from hexiseq.errors import InputError
from hexiseq.model import model_presets
from hexiseq.profiles import LINK_OPS

GRIDS_DIR = Path(__file__).parent / "grids"
BUILTIN_GRIDS = ("full", "quick")
DTYPES = ("float32", "bfloat16", "float16", "float64")
DeviceKind = Literal["cpu", "cuda"]
MIN_SAMPLES = 10  # docs/design.md §5
DEFAULT_ROUNDS = 5  # rounds a point's samples are spread over (`TimingSpec.rounds`)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TimingSpec(_Strict):
    """How each point is timed (docs/design.md §5)."""

    warmup_s: float = Field(0.1, ge=0.0)
    """Calls run untimed for at least this long before the samples (at least one call)."""
    samples: int = Field(MIN_SAMPLES, ge=MIN_SAMPLES)
    """Timed calls per point."""
    input_sets: PositiveInt = 3
    """Random input tensors rotated between calls, so no call reads what the last one cached."""
    rounds: PositiveInt = DEFAULT_ROUNDS
    """The samples of each point are taken in this many rounds; each round visits every
    point of an op family (links: of an op) once, in a shuffled order. A slow or fast spell
    of the machine then spreads over all sizes instead of biasing the few measured during
    it, which would tilt a fit and its held-out split by size."""


class GemmSpec(_Strict):
    """Linear-layer GEMMs: C[m, n] = A[m, k] @ W[n, k]^T, as `nn.Linear` computes them."""

    models: list[str] = []
    """Model presets whose q, k, v, o, MLP and LM-head shapes are measured."""
    tokens: list[PositiveInt] = []
    """Token counts (m) for the model shapes."""
    ladder: list[PositiveInt] = []
    """Square sizes m = n = k, a size ladder independent of any model."""

    @field_validator("models")
    @classmethod
    def _known_models(cls, models: list[str]) -> list[str]:
        unknown = [name for name in models if name not in model_presets()]
        if unknown:
            raise ValueError(
                f"unknown model preset {unknown[0]!r}; known: {', '.join(model_presets())}"
            )
        return models


class AttentionSpec(_Strict):
    """Attention blocks as the runtime's tiles are: full blocks for every (q_len, kv_len) and
    causal blocks on the diagonal only (square, q_len = kv_len)."""

    q_lens: list[PositiveInt]
    kv_lens: list[PositiveInt]
    heads: list[PositiveInt]
    head_dims: list[Literal[16, 32, 64, 128]]
    causal: list[bool] = [False, True]
    backward: bool = True
    """Also measure the backward kernel (attention_bwd) of each block."""


class ElementwiseSpec(_Strict):
    """A bandwidth-bound kernel (c = a + b) over `numels` elements."""

    numels: list[PositiveInt]


class LinkSpec(_Strict):
    """Link sweeps (`hexiseq profile links`): message sizes are the powers of two from
    `min_bytes` to `max_bytes`, or the list `sizes` when given."""

    ops: list[Literal[LINK_OPS]] = list(LINK_OPS)  # type: ignore[valid-type]
    min_bytes: PositiveInt = 1024
    max_bytes: PositiveInt = 256 * 1024**2
    sizes: list[PositiveInt] | None = None
    """Message sizes in bytes, instead of the powers of two from `min_bytes` to `max_bytes`
    (e.g. denser steps where the bandwidth changes regime)."""
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    samples: int | None = Field(None, ge=MIN_SAMPLES)
    """Timed calls per link point, if not `timing.samples`: links on shared hosts (loopback
    gloo on a CPU) are far noisier than compute, and the median of more samples steadier."""
    warmup_s: float | None = Field(None, ge=0.0)
    """Warm-up per link point, if not `timing.warmup_s`."""
    rounds: PositiveInt | None = None
    """Rounds per link point, if not `timing.rounds`."""

    def timing(self, base: TimingSpec) -> TimingSpec:
        """`base` with this spec's link overrides."""
        changes = {"samples": self.samples, "warmup_s": self.warmup_s, "rounds": self.rounds}
        return base.model_copy(update={k: v for k, v in changes.items() if v is not None})

    def message_sizes(self) -> list[int]:
        """The message sizes in bytes, ascending."""
        if self.sizes is not None:
            return sorted(set(self.sizes))
        return powers_of_two(self.min_bytes, self.max_bytes)

    @field_validator("min_bytes", "max_bytes")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1) or value < 8:
            raise ValueError(f"must be a power of two >= 8 bytes, got {value}")
        return value

    @field_validator("sizes")
    @classmethod
    def _whole_elements(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(size % 8 for size in value)):
            raise ValueError(f"must be a non-empty list of multiples of 8 bytes, got {value}")
        return value


def powers_of_two(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from `min_bytes` to `max_bytes` inclusive."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


class Grid(_Strict):
    """A whole sweep grid file."""

    name: str
    timing: TimingSpec = TimingSpec()
    dtypes: dict[DeviceKind, list[Literal[DTYPES]]] = {  # type: ignore[valid-type]
        "cpu": ["float32"],
        "cuda": ["bfloat16"],
    }
    """Compute dtypes per device kind (CPU runs use fp32, GPU runs bf16)."""
    max_gflop_per_call: dict[DeviceKind, float] = {}
    """Points above this many GFLOP per call are left out on that device kind (keeps a CPU
    sweep of the GPU-sized grid bounded); no entry: no limit."""
    gemm: GemmSpec | None = None
    attention: AttentionSpec | None = None
    elementwise: ElementwiseSpec | None = None
    links: LinkSpec | None = None


def builtin_grid_path(quick: bool) -> Path:
    """The shipped grid file: quick.yaml or full.yaml."""
    return GRIDS_DIR / f"{'quick' if quick else 'full'}.yaml"


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file; InputError naming the file and the field otherwise."""
    document = read_yaml_file(path, "grid")
    if not isinstance(document, dict):
        raise InputError(f"grid file {path}: must be a mapping of grid fields")
    try:
        grid = Grid.model_validate(document)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc, f"grid file {path}", Grid)) from None
    _check_rounds(grid.timing, "timing", path)
    if grid.links is not None:
        _check_rounds(grid.links.timing(grid.timing), "links", path)
    _check_link_range(grid, path)
    return grid


def _check_rounds(timing: TimingSpec, field: str, path: str | Path) -> None:
    if timing.rounds > timing.samples:
        raise InputError(
            f"grid file {path}: {field}.rounds ({timing.rounds}) is above its samples per point "
            f"({timing.samples}); each round takes at least one sample"
        )


def _check_link_range(grid: Grid, path: str | Path) -> None:
    if (
        grid.links is not None
        and grid.links.sizes is None
        and grid.links.min_bytes > grid.links.max_bytes
    ):
        raise InputError(
            f"grid file {path}: links.min_bytes ({grid.links.min_bytes}) is above "
            f"links.max_bytes ({grid.links.max_bytes})"
        )
