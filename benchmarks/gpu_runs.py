"""Real-GPU runs: measured step time and peak memory against what the plans predicted when they
were made (before) and what the current models predict for the same plans (after).

For every runtime run (`hexiseq run`) in a store: its plan as recorded, the measured steady step
time (median over steps >= 1; step 0 holds allocation and first-call costs) and peak memory
(max over steps and ranks, with its measure), the plan's stored `predicted` and
`hexiseq.predict` of the plan with `--cost-model datasheet` and `auto` (the store's newest
fitted model), each with its signed error against the measurement.

Run:

    .venv/bin/python benchmarks/gpu_runs.py      # a copy of ../shared/data/h100-profile.db
    .venv/bin/python benchmarks/gpu_runs.py --store sqlite:///h100.db [--refit]

Without --store it reads a temporary copy of the shared one-H100 store and fits it first with
this hexiseq (as `hexiseq fit` does; the copy's own fit was made by an earlier one); with
--store it uses the store's newest fitted model unless --refit (which saves a new fit there).
Prints the tables and updates the "gpu_runs" section of benchmarks/RESULTS.md (`--no-write`:
print only).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _results import replace_section

import hexiseq
from hexiseq.cli.fit import fit_store_profiles
from hexiseq.costmodel import FittedCostModel
from hexiseq.errors import HexiseqError
from hexiseq.plan import Plan, Prediction
from hexiseq.store import Store

SECTION = "gpu_runs"
REPO = Path(__file__).resolve().parents[1]
SHARED_STORE = REPO.parent / "shared" / "data" / "h100-profile.db"
GIB = 2**30
SHARED_STORE_OOM_NOTE = (
    " In the shared one-H100 store these are runs 4 and 6: CUDA OOM in step 2 allocating "
    "7.83 GiB for the fp32 logits with the default allocator (`../shared/data/README.md`; "
    "with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` the same plan ran)."
)


@dataclass(frozen=True)
class MeasuredRun:
    """One runtime run: what ran and what it measured."""

    run_id: int
    plan: Plan
    steps_requested: int
    steps_recorded: int
    step_time_s: float | None  # median over steps >= 1 (None: only step 0 recorded)
    peak_bytes: int  # max over steps and ranks
    memory_measures: tuple[str, ...]


@dataclass(frozen=True)
class Predictions:
    before: Prediction
    datasheet: Prediction
    auto: Prediction


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", metavar="URL", help="store with the runtime runs")
    parser.add_argument(
        "--shared-store",
        type=Path,
        default=SHARED_STORE,
        metavar="PATH",
        help=f"SQLite file copied when no --store is given (default {SHARED_STORE})",
    )
    parser.add_argument(
        "--refit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fit the store's profiles and runs with this hexiseq first and save the fit in "
        "the store (default: on for the copy of the shared store, off for --store)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as folder:
            url = args.store or _copy_shared_store(args.shared_store, Path(folder))
            refit = args.refit if args.refit is not None else args.store is None
            with Store.open(url) as store:
                text = build_report(store, refit=refit, argv=argv or [], shared=args.store is None)
    except HexiseqError as error:
        print(f"gpu_runs: error: {error}", file=sys.stderr)
        return 2
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
    return 0


def _copy_shared_store(source: Path, folder: Path) -> str:
    if not source.is_file():
        raise HexiseqError(f"no shared store at {source}; give --store URL or --shared-store")
    copy = folder / "gpu_runs.db"
    shutil.copyfile(source, copy)  # the shared file is read-only; the copy is not
    return f"sqlite:///{copy}"


def build_report(store: Store, *, refit: bool, argv: list[str], shared: bool) -> str:
    """The RESULTS.md section: the two tables, notes, and how it was made; `shared`: the
    store is the copy of the shared one-H100 store (its notes name what is known of it)."""
    fit_note = _prepare_fit(store, refit)
    runs = read_runs(store)
    if not runs:
        raise HexiseqError(f"store {store.url} holds no runtime runs with measurements")
    predictions = {run.run_id: predict_run(run.plan, store) for run in runs}
    calibrated_on = _memory_calibration_runs(store)
    lines = [
        "## Real-GPU runs: measured vs predicted, before and after",
        "",
        _intro(store, fit_note),
        "",
        "Step time (s), steady state: median of steps >= 1; error = (predicted - measured) / "
        "measured.",
        "",
        *_step_table(runs, predictions),
        "",
        "Peak memory (GiB), max over steps and ranks, against the predicted allocated peak "
        "of the largest rank (its peak without the reserve for the CUDA context and the "
        "allocator's fragmentation, which `cuda_max_allocated` does not count).",
        "",
        *_memory_table(runs, predictions, calibrated_on),
        "",
        *_notes(runs, predictions, shared),
        "",
        f"Produced by `{_command(store, argv)}` at hexiseq {_commit()}.",
    ]
    return "\n".join(lines)


def read_runs(store: Store) -> list[MeasuredRun]:
    """Every runtime run with measurements, oldest first, its plan loaded."""
    requested = {run["id"]: run["steps"] for run in store.list_runtime_runs()}
    runs = []
    for run_id, plan_json, _ in store.runtime_peaks():
        plan = Plan.from_run_json_text(plan_json, source=f"runtime run {run_id}: plan")
        rows = store.runtime_measurements(run_id)
        steps = sorted({row.step for row in rows})
        steady = [max(r.step_time_s for r in rows if r.step == step) for step in steps if step]
        runs.append(
            MeasuredRun(
                run_id=run_id,
                plan=plan,
                steps_requested=requested[run_id],
                steps_recorded=len(steps),
                step_time_s=statistics.median(steady) if steady else None,
                peak_bytes=max(row.peak_memory_bytes for row in rows),
                memory_measures=tuple(sorted({row.memory_measure for row in rows})),
            )
        )
    return runs


def predict_run(plan: Plan, store: Store) -> Predictions:
    """The plan's stored prediction, and the current models' with each cost model."""
    return Predictions(
        before=plan.predicted,
        datasheet=hexiseq.predict(plan, cost_model="datasheet"),
        auto=hexiseq.predict(plan, store=store, cost_model="auto"),
    )


def _prepare_fit(store: Store, refit: bool) -> str:
    if refit:
        model = FittedCostModel(fit_store_profiles(store))
        fitted_id = store.save_fitted_model(model.to_json())
        return f"fitted model {fitted_id}, fitted by this run from the store's profiles and runs"
    if store.latest_fitted_model() is None:
        return "no fitted model in the store: auto is the datasheet"
    return "the store's newest fitted model"


def _memory_calibration_runs(store: Store) -> set[int]:
    """Runs whose measured peaks calibrated the memory model that auto uses."""
    text = store.latest_fitted_model()
    if text is None:
        return set()
    document = FittedCostModel.from_json(text).document
    return {run for fit in document.memory for run in getattr(fit, "source_runs", ())}


def _intro(store: Store, fit_note: str) -> str:
    return (
        f"Store `{store.url}`; auto = {fit_note}. Before: the prediction stored in each plan "
        "when it was made (by the hexiseq that planned it). After: `hexiseq.predict` of the "
        "same plan (same layout and state shares) with the current simulator and memory model."
    )


def _step_table(runs: list[MeasuredRun], predictions: dict[int, Predictions]) -> list[str]:
    header = (
        "| run | model | tokens | ckpt | steps | measured | before | after: datasheet "
        "| after: auto |"
    )
    rows = [header, "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        p, train = predictions[run.run_id], run.plan.train
        measured = run.step_time_s
        cells = [
            str(run.run_id),
            run.plan.model.name,
            _tokens(train.tokens_per_step),
            "on" if train.activation_checkpointing else "off",
            f"{run.steps_recorded}/{run.steps_requested}",
            "-" if measured is None else f"{measured:.3f}",
            *(
                _with_error(x.step_time_s, measured, "{:.3f}")
                for x in (p.before, p.datasheet, p.auto)
            ),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _memory_table(
    runs: list[MeasuredRun], predictions: dict[int, Predictions], calibrated_on: set[int]
) -> list[str]:
    header = "| run | measured (measure) | capacity | before | after: datasheet | after: auto |"
    rows = [header, "|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        p = predictions[run.run_id]
        measured = run.peak_bytes / GIB
        lower_bound = "≥ " if run.steps_recorded < run.steps_requested else ""
        auto = _with_error(_peak_gib(p.auto), measured, "{:.1f}")
        cells = [
            str(run.run_id),
            f"{lower_bound}{measured:.1f} ({', '.join(run.memory_measures)})",
            f"{max(r.memory_capacity_bytes for r in p.auto.ranks) / GIB:.0f}",
            _with_error(_peak_gib(p.before), measured, "{:.1f}"),
            _with_error(_peak_gib(p.datasheet), measured, "{:.1f}"),
            auto + (" (in-sample)" if run.run_id in calibrated_on else ""),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _notes(
    runs: list[MeasuredRun], predictions: dict[int, Predictions], shared: bool
) -> list[str]:
    notes = []
    died = [run for run in runs if run.steps_recorded < run.steps_requested]
    if died:
        listed = ", ".join(
            f"run {r.run_id} ({r.steps_recorded} of {r.steps_requested})" for r in died
        )
        notes.append(
            f"- Runs that recorded fewer steps than asked died mid-run: {listed}; their "
            "measured peak is a lower bound (≥): the step that died wanted more."
            + (SHARED_STORE_OOM_NOTE if shared else "")
            + " Predicted peak of each, as a share of capacity (the planner's limit is 95 %): "
            + "; ".join(_fits_note(r, predictions[r.run_id]) for r in died)
            + "."
        )
    labels = {g: m for p in predictions.values() for g, m in p.auto.cost_model.items()}
    notes.append(
        "- auto's cost model per GPU type: "
        + "; ".join(f"{gpu}: {label}" for gpu, label in labels.items())
        + ". (in-sample): this run's own measured peak is among those the memory "
        "calibration was fitted on."
    )
    return notes


def _fits_note(run: MeasuredRun, p: Predictions) -> str:
    shares = [
        f"{name} {100 * x.max_memory_fraction:.0f} %"
        for name, x in (("before", p.before), ("datasheet", p.datasheet), ("auto", p.auto))
    ]
    return f"run {run.run_id}: " + ", ".join(shares)


def _peak_gib(prediction: Prediction) -> float:
    """The predicted allocated peak: the plan's peak without its `reserve` term (context,
    fragmentation), which `cuda_max_allocated` does not count either."""
    return (
        max(rank.memory_bytes - rank.memory_terms.get("reserve", 0) for rank in prediction.ranks)
        / GIB
    )


def _with_error(predicted: float, measured: float | None, number: str) -> str:
    if measured is None or measured <= 0:
        return number.format(predicted)
    return f"{number.format(predicted)} ({100 * (predicted - measured) / measured:+.1f} %)"


def _tokens(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


def _command(store: Store, argv: list[str]) -> str:
    """The command line, with the store URL as `Store.url` shows it (no password)."""
    shown = [store.url if arg.startswith(("sqlite", "postgresql")) else arg for arg in argv]
    shown = [f"--store={store.url}" if arg.startswith("--store=") else arg for arg in shown]
    return shlex.join([".venv/bin/python", "benchmarks/gpu_runs.py", *shown])


def _commit() -> str:
    try:
        result = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "(commit unknown)"
    return result.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
