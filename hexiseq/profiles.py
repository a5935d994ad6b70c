"""What a profiling sweep measures, as the profiler writes it and the cost-model fit reads it.

One `ProfileMeasurement` is one microbenchmark point (docs/design.md §5): an op family on one
device type (compute) or one link class (communication), at one size, with its timing
statistics and the identity of the hardware and software that produced it. The profiler
(`hexiseq.profiler`) writes them to the store; `hexiseq.costmodel` fits regressions to them.
Core module: no torch, no scikit-learn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from hexiseq.errors import InputError

COMPUTE_OPS = ("gemm", "attention_fwd", "attention_bwd", "elementwise")
"""Op families measured on one device. Their `params`:
- gemm: m, n, k (C[m, n] = A[m, k] @ B[k, n]).
- attention_fwd / attention_bwd: q_len, kv_len, heads, head_dim, causal (bool); `flops` counts
  the (query, key) pairs actually computed (see `attention_pairs`: a causal block is the
  top-left-aligned lower triangle, diagonal included, q_len * (q_len + 1) / 2 pairs when square).
- elementwise: numel (a bandwidth-bound kernel reading and writing `bytes_moved` in all).
"""

LINK_OPS = ("p2p", "all_to_all", "all_gather", "reduce_scatter")
"""Op families measured on a link class. Their `params`: world (ranks taking part) and
message_bytes (what one rank sends to one peer for p2p / all_to_all; one rank's shard for
all_gather / reduce_scatter). p2p also has direction: `next` (every rank sends to rank + 1 and
receives from rank - 1, all ring pairs at once) or `prev` (the reverse)."""

STATUSES = ("ok", "oom", "error")
"""`ok`: timed. `oom`: the size did not fit in memory. `error`: it failed otherwise (see
`error`). Failed points are kept so a resumed sweep does not retry them and the fit skips them."""


@dataclass(frozen=True)
class ProfileMeasurement:
    """One microbenchmark point."""

    device_type: str
    """Catalog name of the device type measured (`cpu`, `h100`, ...); for links, the device
    type of the ranks at both ends."""
    op: str
    """One of COMPUTE_OPS or LINK_OPS."""
    params: dict[str, int | float | bool | str]
    """The op's shape (see COMPUTE_OPS / LINK_OPS); with `op`, `dtype`, `device_type`,
    `link_class` and `emulation_slowdown` it is the point's identity in a resumable sweep."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`, `float32`."""
    flops: float
    """Floating-point operations of one call (0 for bandwidth-bound ops and links)."""
    bytes_moved: float
    """Bytes read + written by one call (compute), or sent by one rank (links)."""
    status: str
    """One of STATUSES."""
    median_s: float | None
    """Median time of one call over the samples, seconds (None unless status is `ok`)."""
    p10_s: float | None
    p90_s: float | None
    samples: int
    """Number of timed samples (>= 10 when `ok`)."""
    device_name: str
    """What the hardware calls itself: `torch.cuda.get_device_name`, or the CPU model."""
    torch_version: str
    cuda_version: str | None = None
    clocks: str | None = None
    """SM/memory clocks where the driver reports them, free text; None when unknown."""
    link_class: str | None = None
    """Link ops only: `intra:<device_type>` (default: ranks inside one node) or a class the user
    names, e.g. `inter`, for what the measured link stands for."""
    emulation_slowdown: float = 1.0
    """> 1 when the device's compute was padded by sleeping (CPU emulation only)."""
    error: str | None = None
    """One line saying what failed, when status is not `ok`."""
    host: str = ""
    extra: dict[str, int | float | bool | str] = field(default_factory=dict)
    """Anything else worth keeping (thread count, backend, ...)."""


ProfileKey = tuple[str, str, str, str, str, float]
"""Identity of a point: (device_type, op, canonical params JSON, dtype, link_class or "",
emulation_slowdown). Two measurements with the same key measure the same thing."""


def attention_pairs(q_len: int, kv_len: int, *, causal: bool) -> int:
    """(query, key) pairs an attention block computes.

    Full: q_len * kv_len. Causal: query i sees keys 0..i (top-left alignment, as torch's
    `is_causal` kernels and the runtime's diagonal tiles use), so a square block has
    q_len * (q_len + 1) / 2 pairs; a wide block (kv_len > q_len) stops at the diagonal and a
    tall one (q_len > kv_len) has its lower rows full.
    """
    if not causal:
        return q_len * kv_len
    square = min(q_len, kv_len)
    return square * (square + 1) // 2 + (q_len - square) * kv_len


def canonical_params_json(params: dict[str, int | float | bool | str]) -> str:
    """`params` as JSON with sorted keys and no spaces: the form identities compare."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def profile_key(
    device_type: str,
    op: str,
    params: dict[str, int | float | bool | str],
    dtype: str,
    link_class: str | None = None,
    emulation_slowdown: float = 1.0,
) -> ProfileKey:
    """The identity of a point (see `ProfileKey`)."""
    return (
        device_type,
        op,
        canonical_params_json(params),
        dtype,
        link_class or "",
        float(emulation_slowdown),
    )


def measurement_key(measurement: ProfileMeasurement) -> ProfileKey:
    """The identity of a measurement (see `ProfileKey`)."""
    m = measurement
    return profile_key(m.device_type, m.op, m.params, m.dtype, m.link_class, m.emulation_slowdown)


def check_measurement(measurement: ProfileMeasurement) -> None:
    """Raise InputError unless `measurement` can be stored as it is (what the fit relies on).

    Known op and status; params of plain values; an `ok` point has >= 1 sample and finite
    times with p10 <= median <= p90; a failed one has an error line.
    """
    m = measurement
    if m.op not in COMPUTE_OPS + LINK_OPS:
        raise InputError(f"op {m.op!r} is not one of {', '.join(COMPUTE_OPS + LINK_OPS)}")
    if m.status not in STATUSES:
        raise InputError(f"status {m.status!r} is not one of {', '.join(STATUSES)}")
    for name, mapping in (("params", m.params), ("extra", m.extra)):
        bad = [k for k, v in mapping.items() if not isinstance(v, (int, float, bool, str))]
        if bad:
            raise InputError(f"{name}[{bad[0]!r}] must be an int, float, bool or str")
    if not (math.isfinite(m.emulation_slowdown) and m.emulation_slowdown >= 1.0):
        raise InputError(f"emulation_slowdown must be >= 1, got {m.emulation_slowdown!r}")
    if m.status == "ok":
        _check_timings(m)
    elif not m.error:
        raise InputError(f"a {m.status!r} measurement needs a one-line error")


def _check_timings(m: ProfileMeasurement) -> None:
    times = (m.p10_s, m.median_s, m.p90_s)
    if any(t is None or not math.isfinite(t) or t < 0 for t in times):
        raise InputError(f"an ok measurement needs finite times >= 0, got {times}")
    if not m.p10_s <= m.median_s <= m.p90_s:
        raise InputError(f"times must satisfy p10 <= median <= p90, got {times}")
    if m.samples < 1:
        raise InputError(f"an ok measurement needs samples >= 1, got {m.samples}")
