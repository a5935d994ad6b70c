"""The fitted cost model: profiled regressions where a device type was profiled, the datasheet
model elsewhere (docs/design.md §6).

Choices, and why:
- An unprofiled GPU type is predicted by `DatasheetCostModel` (labelled "datasheet estimate"),
  not transferred from a profiled reference by datasheet ratios: the one reference profiled so
  far is a CPU, and a CPU's achieved fraction of its peak says nothing about a GPU's. The
  transfer is what the leave-one-device-type-out error of `hexiseq fit` measures; once two
  GPU types are profiled and that error is small, transfer can replace the datasheet here.
- The model the simulator uses is the 1x fit (`emulation_slowdown` 1): the simulator already
  multiplies each rank's compute by its slowdown. Fits of emulated slow devices stay in the
  document as a check of the emulation.
- Per device type one dtype is used: float32 on `cpu` (CPU runs train in FP32), bfloat16
  elsewhere; another profiled dtype only when that one is missing.
- Links: the measured α–β of a link class replaces the declared link for every node pair of
  that class (`intra:<gpu>` inside a node of that GPU type, `inter` across nodes); p2p fits
  are preferred (the ring is p2p), then all_to_all, all_gather, reduce_scatter. The simulator
  takes one (bandwidth, latency) per pair, so the regime of the largest messages is used.
  Unmeasured pairs get the cluster's declared numbers x the datasheet link efficiency.
- Memory: where runtime runs measured a device type's peaks, its `MemoryFit` calibrates the
  memory model (`memory_calibration`): the measure a run on that device reads
  (`cpu_max_rss` for `cpu`, `cuda_max_allocated` for a GPU); elsewhere the model as written.
- Goals: a fit whose held-out extrapolation error missed its goal (`HeldOut.goal_met` False:
  above 5 % for compute, 10 % for links) is not used: that op family on that device type (or
  that link class) falls back to the datasheet model, and the label says so; so does a
  compute fit that is unstable (`HeldOut.stable` False: fits to resamples of its training
  points extrapolate beyond twice its goal in more than 1 of 10). `forced=True`
  (`--cost-model fitted`) uses every fit anyway, and its label says which it forced.
- GPU fits predict with the GPU features they were fitted on (`_gpu_features`: SM waves,
  FlashAttention-2 tiles); CPU fits with the CPU's (`_features`).
- Attention is priced for the kernel the runtime runs (`hexiseq.kernels.attention_kernel` at
  the model's head size), as the datasheet model prices it. A fit of another kernel is not
  used for it: attention falls back to the datasheet at that kernel's efficiency, and the
  label says so ("attention_fwd, attention_bwd: datasheet — profiled flash, the runtime runs
  cudnn"). E.g. the H100 profiles taken before the runtime called cuDNN attention time the
  flash kernel, 1.6-1.8x slower than cuDNN's (gpus.yaml, H100-SXM, measured on an H100): a
  fit of them would overstate the attention the runtime now runs. Re-profiling the device
  replaces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hexiseq.cluster import Cluster
from hexiseq.costmodel._features import (
    OP_FEATURES,
    attention_features,
    element_bytes,
    gemm_features,
    memory_bound_features,
    square_gemm_bytes,
)
from hexiseq.costmodel._fit_document import (
    STABILITY_FACTOR,
    FittedDocument,
    LinkFit,
    OpFit,
    dump_fitted_document,
    parse_fitted_document,
)
from hexiseq.costmodel._gpu_features import (
    GPU_OP_FEATURES,
    flash_attention_features,
    gpu_gemm_features,
    gpu_memory_bound_features,
)
from hexiseq.costmodel.base import FloatOrArray
from hexiseq.costmodel.datasheet import DatasheetCostModel, declared_link_parameters
from hexiseq.costmodel.memory import MemoryCalibration
from hexiseq.kernels import attention_kernel, canonical_kernel_name, training_dtype
from hexiseq.profiles import COMPUTE_OPS

LINK_OP_PREFERENCE = ("p2p", "all_to_all", "all_gather", "reduce_scatter")
"""Which link fit stands for a link class, first found first."""


@dataclass(frozen=True)
class FittedCostModel:
    """A `CostModel` from a `FittedDocument` (see the module docstring for its choices).

    Every method broadcasts over numpy arrays like `DatasheetCostModel`."""

    document: FittedDocument
    fallback: DatasheetCostModel = field(default_factory=DatasheetCostModel)
    forced: bool = False
    """Use fits that missed their goal too (`--cost-model fitted`); else they fall back."""
    _ops: dict[tuple[str, str], OpFit] = field(init=False, repr=False, compare=False)
    _missed: dict[tuple[str, str], OpFit] = field(init=False, repr=False, compare=False)
    _links: dict[str, LinkFit] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        candidates = _used_op_fits(self.document.ops)
        missed = {key: fit for key, fit in candidates.items() if _refused_by_auto(fit.heldout)}
        used = candidates if self.forced else _without(candidates, missed)
        object.__setattr__(self, "_ops", used)
        object.__setattr__(self, "_missed", missed)
        links = self.document.links
        if not self.forced:
            links = tuple(fit for fit in links if fit.heldout.goal_met is not False)
        object.__setattr__(self, "_links", _used_link_fits(links))

    @classmethod
    def from_json(
        cls, text: str, source: str = "fitted model", *, forced: bool = False
    ) -> FittedCostModel:
        """Read the JSON document `to_json` writes; InputError (one line) if it is corrupt.
        `forced`: use fits that missed their goal too (see the class docstring)."""
        return cls(parse_fitted_document(text, source), forced=forced)

    def to_json(self) -> str:
        """The fitted document as JSON text; `from_json` reads it back to an equal model."""
        return dump_fitted_document(self.document)

    @property
    def covered_types(self) -> tuple[str, ...]:
        """Device types with at least one fitted op family, in fit order."""
        return tuple(dict.fromkeys(gpu for gpu, _ in self._ops))

    def label(self, gpu: str) -> str:
        """ "fitted (profile run 3, 2026-11-22)", naming op families left to the datasheet
        (not profiled, or their fit missed its goal: "attention_fwd: datasheet — fit missed
        its goal, 7.1 % > 5 %"; forced: "attention_fwd forced although it missed its goal,
        ..."); the datasheet model's label for a type with no fit used."""
        other_kernel = [op for op in COMPUTE_OPS if self._profiled_other_kernel(gpu, op)]
        ops = [op for op in COMPUTE_OPS if (gpu, op) in self._ops and op not in other_kernel]
        missed = [op for op in COMPUTE_OPS if (gpu, op) in self._missed]
        notes = [self._missed_note(gpu, op) for op in missed]
        notes += [self._kernel_note(gpu, other_kernel), self._memory_note(gpu)]
        suffix = "".join(f"; {note}" for note in notes if note)
        if not ops:
            return self.fallback.label(gpu) + suffix
        runs = sorted({run for op in ops for run in self._ops[gpu, op].source_runs})
        label = f"fitted ({_describe_runs(self.document, runs)})"
        left = set(missed) | set(other_kernel)
        missing = [op for op in COMPUTE_OPS if op not in ops and op not in left]
        return label + (f"; datasheet for {', '.join(missing)}" if missing else "") + suffix

    def _missed_note(self, gpu: str, op: str) -> str:
        heldout = self._missed[gpu, op].heldout
        if heldout.goal_met is False:
            why = "missed its goal"
            numbers = f"{_percent(heldout.extrapolation_mape)} > {_percent(heldout.goal_mape)}"
        else:
            why = "is unstable"
            numbers = (
                f"bootstrap p90 {_percent(heldout.bootstrap_mape_p90)} > "
                f"{STABILITY_FACTOR:g} x {_percent(heldout.goal_mape)}"
            )
        if self.forced:
            return f"{op}: fit forced by --cost-model fitted though it {why}, {numbers}"
        return f"{op}: datasheet — fit {why}, {numbers}"

    def _profiled_other_kernel(self, gpu: str, op: str) -> bool:
        """Whether `gpu`'s fit of attention `op` timed another kernel than the runtime runs
        there (at the catalog's reference head size, 128)."""
        fit = self._ops.get((gpu, op))
        return (
            fit is not None
            and op.startswith("attention")
            and not _same_kernel(_runtime_kernel(gpu, 128), fit.attention_kernel)
        )

    def _kernel_note(self, gpu: str, ops: list[str]) -> str:
        if not ops:
            return ""
        profiled = canonical_kernel_name(str(self._ops[gpu, ops[0]].attention_kernel))
        runs = _runtime_kernel(gpu, 128)
        return f"{', '.join(ops)}: datasheet — profiled {profiled}, the runtime runs {runs}"

    def _memory_note(self, gpu: str) -> str:
        calibration = self.memory_calibration(gpu)
        return "memory calibrated by measured peaks" if calibration is not None else ""

    def gemm_time_s(
        self,
        gpu: str,
        flops: FloatOrArray,
        *,
        bytes_moved: FloatOrArray | None = None,
        calls: FloatOrArray = 1,
    ) -> FloatOrArray:
        fit = self._ops.get((gpu, "gemm"))
        if fit is None:
            return self.fallback.gemm_time_s(gpu, flops, bytes_moved=bytes_moved, calls=calls)
        if fit.features == GPU_OP_FEATURES["gemm"]:
            if bytes_moved is None:
                bytes_moved = square_gemm_bytes(flops, calls, element_bytes(fit.dtype))
            ridge = fit.ridge_flops_per_byte
            return _combine(fit, gpu_gemm_features(flops, bytes_moved, calls, ridge))
        features = gemm_features(
            flops, bytes_moved, calls, element_bytes(fit.dtype), fit.cache_bytes
        )
        return _combine(fit, features)

    def attention_time_s(
        self,
        gpu: str,
        pairs: FloatOrArray,
        heads: FloatOrArray,
        head_dim: int,
        *,
        backward: bool,
        q_tokens: FloatOrArray | None = None,
        kv_tokens: FloatOrArray | None = None,
        calls: FloatOrArray = 1,
        kernel: str | None = None,
    ) -> FloatOrArray:
        """The fit of `gpu`'s attention; the datasheet model where there is none, or where
        `kernel` (`hexiseq.kernels`; None: the one the runtime runs on `gpu` at `head_dim`) is
        not the kernel profiled."""
        fit = self._ops.get((gpu, "attention_bwd" if backward else "attention_fwd"))
        asked = kernel or _runtime_kernel(gpu, head_dim)
        if fit is None or not _same_kernel(asked, fit.attention_kernel):
            return self.fallback.attention_time_s(
                gpu, pairs, heads, head_dim, backward=backward, q_tokens=q_tokens,
                kv_tokens=kv_tokens, calls=calls, kernel=kernel,
            )  # fmt: skip
        if fit.features == GPU_OP_FEATURES[fit.op]:
            return _combine(fit, _flash_features(fit, pairs, heads, head_dim, q_tokens,
                                                 kv_tokens, calls))  # fmt: skip
        features = attention_features(
            pairs, heads, head_dim, backward=backward, q_tokens=q_tokens, kv_tokens=kv_tokens,
            calls=calls, element_size=element_bytes(fit.dtype), kernel=fit.attention_kernel,
        )  # fmt: skip
        return _combine(fit, features)

    def memory_bound_time_s(
        self, gpu: str, bytes_moved: FloatOrArray, *, calls: FloatOrArray = 1
    ) -> FloatOrArray:
        fit = self._ops.get((gpu, "elementwise"))
        if fit is None:
            return self.fallback.memory_bound_time_s(gpu, bytes_moved, calls=calls)
        if fit.features == GPU_OP_FEATURES["elementwise"]:
            l2_bytes = fit.cache_bytes[0] if fit.cache_bytes else None
            return _combine(fit, gpu_memory_bound_features(bytes_moved, calls, l2_bytes))
        return _combine(fit, memory_bound_features(bytes_moved, calls, fit.cache_bytes))

    def transfer_time_s(
        self, bytes_moved: FloatOrArray, bandwidth_GBps: FloatOrArray, latency_s: FloatOrArray
    ) -> FloatOrArray:
        """α + bytes/β with the bandwidth and latency `link_parameters` gave (measured, or
        declared x link efficiency); 0 where nothing is sent."""
        seconds = np.where(
            np.asarray(bytes_moved) > 0,
            latency_s + np.divide(bytes_moved, np.multiply(bandwidth_GBps, 1e9)),
            0.0,
        )
        return float(seconds) if seconds.ndim == 0 else seconds

    def link_parameters(self, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """[node, node] bandwidth (GB/s) and latency (s): measured where the link class was
        profiled, declared x `fallback.link_efficiency` elsewhere."""
        bandwidth, latency = declared_link_parameters(cluster)
        bandwidth = bandwidth * self.fallback.link_efficiency
        inter = self._links.get("inter")
        if inter is not None:
            off_diagonal = ~np.eye(len(cluster.nodes), dtype=bool)
            bandwidth[off_diagonal], latency[off_diagonal] = _link_numbers(inter)
        for i, node in enumerate(cluster.nodes):
            intra = self._links.get(f"intra:{node.gpu}")
            if intra is not None:
                bandwidth[i, i], latency[i, i] = _link_numbers(intra)
        return bandwidth, latency

    def memory_calibration(self, gpu: str) -> MemoryCalibration | None:
        """The memory model calibrated by `gpu`'s measured peaks, or None (not measured)."""
        measure = "cpu_max_rss" if gpu == "cpu" else "cuda_max_allocated"
        fit = next(
            (
                f
                for f in self.document.memory
                if (f.device_type, f.memory_measure) == (gpu, measure)
            ),
            None,
        )
        if fit is None:
            return None
        return MemoryCalibration(reserve_bytes=int(round(fit.reserve_bytes)), scale=fit.scale)

    def link_label(self, link_class: str) -> str:
        """ "measured (p2p)" for a profiled link class, else "declared x link efficiency",
        naming a fit of the class that missed its goal (and "forced" where it is used)."""
        fit = self._links.get(link_class)
        missed = [f for f in self.document.links if f.link_class == link_class]
        missed = [f for f in missed if f.heldout.goal_met is False]
        notes = "".join(
            f"; {f.op} fit {'forced, ' if self.forced else 'not used, '}missed its goal "
            f"({_percent(f.heldout.extrapolation_mape)} > {_percent(f.heldout.goal_mape)})"
            for f in missed
        )
        return (f"measured ({fit.op})" if fit else "declared x link efficiency") + notes


def _flash_features(fit: OpFit, pairs, heads, head_dim, q_tokens, kv_tokens, calls):
    """GPU attention features of the `attention_time_s` arguments: unknown token counts are
    square full blocks; a block is causal when its pairs are nearer the causal count of its
    box than the full count (`hexiseq.profiles.attention_pairs`)."""
    if q_tokens is None or kv_tokens is None:
        q_tokens = kv_tokens = np.sqrt(np.divide(pairs, calls))
    q, kv = np.maximum(np.rint(q_tokens), 1.0), np.maximum(np.rint(kv_tokens), 1.0)
    full = np.multiply(q, kv)
    square = np.minimum(q, kv)
    causal_pairs = square * (square + 1) / 2 + (q - square) * kv
    causal = np.divide(pairs, calls) <= (full + causal_pairs) / 2
    causal = causal & (causal_pairs < full)
    return flash_attention_features(
        q, kv, heads, head_dim, causal=causal, backward=fit.op == "attention_bwd",
        calls=calls, element_size=element_bytes(fit.dtype), sm_count=fit.sm_count,
        kernel=fit.attention_kernel,
    )  # fmt: skip


def _combine(fit: OpFit, features: Sequence[FloatOrArray]) -> FloatOrArray:
    """Σ coefficient x feature, in a fixed order (arrays give what scalars give). `features`
    are the op's current ones of the fit's kind (OP_FEATURES or GPU_OP_FEATURES); a fit of an
    older schema uses those it names."""
    names = GPU_OP_FEATURES[fit.op] if fit.features == GPU_OP_FEATURES[fit.op] else None
    named = dict(zip(names or OP_FEATURES[fit.op], features))
    seconds = 0.0
    for coefficient, name in zip(fit.coefficients, fit.features):
        seconds = seconds + coefficient * named[name]
    return seconds


_LEGACY_KERNEL_NAMES = {"cuda_flash": "flash", "cuda_efficient": "efficient"}
"""Profiler names of rows written before `hexiseq.kernels` named the kernels."""


def _runtime_kernel(gpu: str, head_dim: int) -> str:
    """The attention kernel the runtime runs on `gpu` in its training dtype."""
    return attention_kernel(gpu, training_dtype(gpu), head_dim)


def _same_kernel(asked: str | None, profiled: str | None) -> bool:
    """Whether the kernel a caller asks about is the one the fit profiled (None: any)."""
    if asked is None or profiled is None:
        return True
    return _LEGACY_KERNEL_NAMES.get(asked, asked) == _LEGACY_KERNEL_NAMES.get(profiled, profiled)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %".replace(".0 %", " %")


def _without(fits: dict, dropped: dict) -> dict:
    return {key: fit for key, fit in fits.items() if key not in dropped}


def _link_numbers(fit: LinkFit) -> tuple[float, float]:
    """(bandwidth GB/s, latency s) of the fit's regime for the largest messages."""
    regime = fit.regimes[-1]
    per_byte = regime.seconds_per_byte
    bandwidth_GBps = np.inf if per_byte == 0 else 1.0 / (per_byte * 1e9)
    return bandwidth_GBps, regime.latency_s


def preferred_dtype(device_type: str) -> str:
    """The dtype hexiseq trains in on `device_type`: float32 on CPU, bfloat16 on GPUs."""
    return "float32" if device_type == "cpu" else "bfloat16"


def _used_op_fits(fits: Sequence[OpFit]) -> dict[tuple[str, str], OpFit]:
    """(device type, op) -> the 1x fit the model predicts with (preferred dtype first)."""
    used: dict[tuple[str, str], OpFit] = {}
    for fit in fits:
        if fit.emulation_slowdown != 1.0:
            continue
        key = (fit.device_type, fit.op)
        current = used.get(key)
        preferred = preferred_dtype(fit.device_type)
        if current is None or (fit.dtype == preferred and current.dtype != preferred):
            used[key] = fit
    return used


def _used_link_fits(fits: Sequence[LinkFit]) -> dict[str, LinkFit]:
    """link class -> the fit that stands for it (LINK_OP_PREFERENCE)."""
    used: dict[str, LinkFit] = {}
    for fit in sorted(fits, key=lambda f: LINK_OP_PREFERENCE.index(f.op)):
        used.setdefault(fit.link_class, fit)
    return used


def _refused_by_auto(heldout) -> bool:
    """A fit `--cost-model auto` leaves to the datasheet: it missed its goal, or is unstable
    (its resampled fits extrapolate beyond `STABILITY_FACTOR` x the goal)."""
    return heldout.goal_met is False or heldout.stable is False


def _describe_runs(document: FittedDocument, runs: list[int]) -> str:
    """ "profile run 3, 2026-11-22" / "profile runs 3, 5, 2026-11-22" (newest run's date), or
    "profiles fitted 2026-11-22" when the runs are unknown."""
    dates = [s.created_at for s in document.sources if s.run_id in runs and s.created_at]
    if not runs:
        return f"profiles fitted {document.created_at[:10]}"
    date = max(dates)[:10] if dates else f"fitted {document.created_at[:10]}"
    noun = "run" if len(runs) == 1 else "runs"
    return f"profile {noun} {', '.join(map(str, runs))}, {date}"
