"""Synthetic profile measurements with known coefficients, for the cost-model fit tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hexiseq.costmodel._features import measurement_features
from hexiseq.profiles import ProfileMeasurement


@dataclass(frozen=True)
class TrueDevice:
    """The coefficients a synthetic device follows exactly (before noise)."""

    name: str
    # s/FLOP, s/byte, s/call, s/byte beyond the L2, s/byte beyond the last-level cache (the
    # cache terms are 0: these rows record no cache sizes, so their cache features are 0)
    gemm: tuple[float, ...] = (1 / 3e11, 1 / 4e10, 2e-5, 0.0, 0.0)
    attention_fwd: tuple[float, ...] = (1 / 1.5e11, 1 / 3e11, 2e-10, 1 / 1e11, 5e-5)
    attention_bwd: tuple[float, ...] = (1 / 1e11, 1 / 2e11, 4e-10, 1 / 1e11, 8e-5)
    elementwise: tuple[float, ...] = (1 / 1.5e10, 5e-6, 0.0, 0.0)


def measurement(
    device: str,
    op: str,
    params: dict,
    flops: float,
    bytes_moved: float,
    seconds: float | None,
    *,
    dtype: str = "float32",
    slowdown: float = 1.0,
    link_class: str | None = None,
    status: str = "ok",
    extra: dict | None = None,
) -> ProfileMeasurement:
    return ProfileMeasurement(
        device_type=device,
        op=op,
        params=params,
        dtype=dtype,
        flops=flops,
        bytes_moved=bytes_moved,
        status=status,
        median_s=seconds,
        p10_s=seconds,
        p90_s=seconds,
        samples=10 if status == "ok" else 0,
        device_name="synthetic",
        torch_version="none",
        link_class=link_class,
        emulation_slowdown=slowdown,
        error=None if status == "ok" else "synthetic failure",
        extra=extra or {},
    )


def compute_rows(
    device: TrueDevice,
    rng: np.random.Generator,
    *,
    noise: float = 0.02,
    slowdown: float = 1.0,
    dtype: str = "float32",
) -> list[ProfileMeasurement]:
    """GEMM, attention and elementwise points over two decades of sizes, each timed as
    slowdown x Σ coefficient x feature x exp(N(0, noise))."""
    element = 4 if dtype == "float32" else 2
    rows = []
    for m, n, k in _gemm_shapes():
        row = measurement(device.name, "gemm", {"m": m, "n": n, "k": k}, 2.0 * m * n * k,
                          element * (m * k + n * k + m * n), None, dtype=dtype)  # fmt: skip
        rows.append(row)
    for op in ("attention_fwd", "attention_bwd"):
        factor = 2.5 if op == "attention_bwd" else 1.0
        for q_len, kv_len, heads, head_dim, causal in _attention_shapes():
            params = {"q_len": q_len, "kv_len": kv_len, "heads": heads, "head_dim": head_dim,
                      "causal": causal}  # fmt: skip
            pairs = q_len * (q_len + 1) // 2 if causal else q_len * kv_len
            flops = factor * 4.0 * head_dim * pairs * heads
            rows.append(measurement(device.name, op, params, flops, 0.0, None, dtype=dtype))
    for numel in (2**e for e in range(12, 25)):
        rows.append(
            measurement(
                device.name,
                "elementwise",
                {"numel": numel},
                0.0,
                3.0 * element * numel,
                None,
                dtype=dtype,
            )  # fmt: skip
        )
    return [_timed(row, getattr(device, row.op), rng, noise, slowdown) for row in rows]


def _timed(row, coefficients, rng, noise, slowdown) -> ProfileMeasurement:
    features = measurement_features(row)
    # no cache terms; a GPU's gemm / elementwise features share their first three / two
    # with the CPU's, and the GPU's own last term is left at 0 too
    padded = (tuple(coefficients) + (0.0,) * len(features))[: len(features)]
    exact = float(np.dot(padded, features))
    seconds = slowdown * exact * float(np.exp(rng.normal(0.0, noise)))
    return measurement(row.device_type, row.op, row.params, row.flops, row.bytes_moved, seconds,
                       dtype=row.dtype, slowdown=slowdown)  # fmt: skip


def _gemm_shapes() -> list[tuple[int, int, int]]:
    square = [(s, s, s) for s in (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)]
    skinny = [(t, 4096, 64) for t in (32, 128, 512, 2048)] + [(16, 2048, 2048), (8, 8192, 512)]
    return square + skinny


def _attention_shapes() -> list[tuple[int, int, int, int, bool]]:
    shapes = []
    for length in (64, 128, 256, 512, 1024, 2048):
        for head_dim in (16, 64, 128):
            shapes.append((length, length, 4, head_dim, True))
            shapes.append((length, 2 * length, 4, head_dim, False))
    return shapes


def link_rows(
    link_class: str,
    latency_s: float,
    bandwidth_GBps: float,
    rng: np.random.Generator,
    *,
    noise: float = 0.02,
    op: str = "p2p",
    knee: tuple[float, float, float] | None = None,
    device: str = "cpu",
) -> list[ProfileMeasurement]:
    """Message sizes 1 KiB .. 64 MiB timed α + bytes/β; from `knee` = (bytes, α, GB/s) on,
    the second regime's line."""
    rows = []
    for size in (2**e for e in range(10, 27)):
        alpha, gbps = (
            (knee[1], knee[2]) if knee and size >= knee[0] else (latency_s, bandwidth_GBps)
        )
        seconds = (alpha + size / (gbps * 1e9)) * float(np.exp(rng.normal(0.0, noise)))
        params = {"world": 2, "message_bytes": size}
        rows.append(measurement(device, op, params, 0.0, float(size), seconds,
                                link_class=link_class))  # fmt: skip
    return rows
