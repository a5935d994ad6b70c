"""`hexiseq plan`: a thin shell over `hexiseq.search.plan_search` that prints the plan and its
baselines (text, or one JSON document with `--json`), writes it (`--out PATH|-`) and saves it
in the store. The search modules load on use: `hexiseq --help` should not wait for them.

Every input is checked before the search starts or the store is created; the plan file and the
store are written before anything is printed, so a closed pipe loses only output.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hexiseq.cli.arguments import positive_float, positive_int, seed
from hexiseq.cli.fit import add_cost_model_argument, plan_cost_model
from hexiseq.cli.output import (
    STDOUT,
    add_json_argument,
    check_out_choice,
    human_stream,
    print_json,
)
from hexiseq.cluster import cluster_presets
from hexiseq.errors import InputError
from hexiseq.model import model_presets
from hexiseq.store import STORE_URL_HELP

if TYPE_CHECKING:
    from hexiseq.cluster import Cluster
    from hexiseq.model import ModelSpec
    from hexiseq.plan import InfeasiblePlan, Plan
    from hexiseq.search import SearchResult
    from hexiseq.store import Store


def add_plan_parser(commands: Any) -> None:
    """Register `hexiseq plan` on the CLI's subcommands."""
    plan = commands.add_parser(
        "plan",
        help="find the fastest CP-HP plan for a cluster, model and sequence length",
        description="Find the fastest asymmetric CP-HP plan and compare it with the baselines.",
    )
    _add_problem_arguments(plan)
    _add_output_arguments(plan)
    _add_search_arguments(plan)
    add_cost_model_argument(plan)


def _add_problem_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--cluster",
        required=True,
        metavar="PATH|PRESET",
        help=f"cluster YAML file or preset: {', '.join(cluster_presets())}",
    )
    plan.add_argument(
        "--model",
        required=True,
        metavar="PRESET|PATH",
        help=(
            f"model preset ({', '.join(model_presets())}), a Hugging Face config.json (or its "
            "directory, or a hub name in the local cache) or a YAML of ModelSpec fields"
        ),
    )
    plan.add_argument(
        "--seq-len", required=True, metavar="TOKENS", help="tokens per sequence: 131072, 128k, 1M"
    )
    plan.add_argument(
        "--micro-batches",
        type=positive_int,
        default=1,
        metavar="N",
        help="sequences per step (the global batch; default 1): one mesh takes them one after "
        "another (gradient accumulation), data-parallel replicas share them",
    )
    plan.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="compute dtype the plan is for and `hexiseq run` computes in (auto: bf16 on GPUs, "
        "fp32 on an all-CPU cluster); master weights and AdamW states are fp32 either way",
    )
    plan.add_argument(
        "--no-data-parallel",
        action="store_true",
        help="plan one CP-HP mesh over the whole cluster only (default: also data-parallel "
        "replicas, the cluster split by nodes, each its own mesh on its own sequences, picked "
        "where faster)",
    )


def _add_output_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--out",
        metavar="PATH|-",
        help="write the best plan as JSON here (atomically); '-': to stdout, the human text "
        "then goes to stderr",
    )
    add_json_argument(
        plan, "the best plan's summary and per-device rows, the baselines, the speedups, the "
        "store id"
    )  # fmt: skip
    plan.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store the plans are saved in {STORE_URL_HELP}",
    )
    plan.add_argument("--no-store", action="store_true", help="do not save the plans")


def _add_search_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help="let the Optuna layer search this long beyond the greedy candidates",
    )
    plan.add_argument(
        "--trials",
        type=positive_int,
        metavar="N",
        help="trials in this run, a new study's greedy short list included (deterministic "
        "for a given --seed)",
    )
    plan.add_argument("--seed", type=seed, default=0, help="sampler seed, 0..2**32-1 (default 0)")
    plan.add_argument(
        "--storage",
        metavar="URL",
        help="SQLAlchemy URL of the Optuna study (SQLite, PostgreSQL): keeps it, so that a "
        "later run goes on with it and other searches can share it",
    )
    plan.add_argument(
        "--study-name",
        metavar="NAME",
        help="name of the study in --storage (default CLUSTER/MODEL/TOKENS/KIND, e.g. "
        "h100x8-a100x8/llama-30b/262144/throughput): another name starts another study",
    )
    plan.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="processes scoring the sampled trials (default 1: this one)",
    )
    plan.add_argument(
        "--pareto",
        action="store_true",
        help="search throughput against memory headroom and print the Pareto front",
    )
    plan.add_argument(
        "--checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation checkpointing: auto (off wherever memory allows), on, or off",
    )
    plan.add_argument(
        "--no-checkpointing", action="store_true", help="same as --checkpointing off"
    )


@dataclass(frozen=True)
class _Saved:
    """Where the plan went: the store's (masked) URL and the best plan's id there."""

    store_url: str | None = None
    plan_id: int | None = None


def run_plan(args: argparse.Namespace) -> int:
    """Search, write `--out`, save to the store, then print; InputError on bad input and
    InfeasibleError when no plan fits (the caller maps them to exit codes)."""
    from hexiseq.cluster import Cluster
    from hexiseq.model_files import load_model
    from hexiseq.units import parse_seq_len

    # Check every input before anything is created on disk.
    check_out_choice(args.out, args.json)
    cluster, model = Cluster.load(args.cluster), load_model(args.model)
    seq_len = parse_seq_len(args.seq_len)
    _check_study_options(args)
    if args.out not in (None, STDOUT):
        check_writable(args.out, "--out")
    store = None if args.no_store else _open_store(args.store)
    try:
        cost_model = plan_cost_model(args, store)  # None: the datasheet default
        result = _search(args, cluster, model, seq_len, cost_model)
        if args.out not in (None, STDOUT):
            write_plan(result.best, args.out, "--out")
        saved = _save(store, result)
    finally:
        if store is not None:
            store.close()
    _print_result(args, result, saved, fitted=cost_model is not None)
    return 0


def _check_study_options(args: argparse.Namespace) -> None:
    if args.study_name is not None and args.storage is None:
        raise InputError(
            "--study-name names a study kept in --storage; give --storage URL too (without it "
            "the study lives in memory and has no name to reuse)"
        )
    if args.study_name is not None and not args.study_name.strip():
        raise InputError("--study-name must not be empty")


def _open_store(url: str) -> Store:
    from hexiseq.store import Store

    return Store.open(url)


def _search(
    args: argparse.Namespace, cluster: Cluster, model: ModelSpec, seq_len: int, cost_model
) -> SearchResult:
    """`plan_search` with the CLI's options; a progress bar on a terminal (`cli.progress`)."""
    from hexiseq.cli.progress import shows_progress
    from hexiseq.search import plan_search

    return plan_search(
        cluster,
        model,
        seq_len,
        time_budget_s=args.time_budget,
        n_trials=args.trials,
        seed=args.seed,
        storage=args.storage,
        study_name=args.study_name,
        workers=args.workers,
        multi_objective=args.pareto,
        activation_checkpointing=_checkpointing(args),
        show_progress=shows_progress(n_trials=args.trials, time_budget_s=args.time_budget),
        cost_model=cost_model,
        micro_batches=args.micro_batches,
        precision=args.precision,
        data_parallel=not args.no_data_parallel,
    )


def _checkpointing(args: argparse.Namespace) -> bool | None:
    if args.no_checkpointing:
        return False
    return {"auto": None, "on": True, "off": False}[args.checkpointing]


def _save(store: Store | None, result: SearchResult) -> _Saved:
    if store is None:
        return _Saved()
    return _Saved(store.url, store.save_search_result(result.best, result.baselines))


def check_writable(path: str, option: str) -> None:
    """Fail before the work when `path`'s folder is missing or `path` is a folder."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{option} {path}: cannot write (Is a directory)")
    if not (target.parent if str(target.parent) else Path(".")).is_dir():
        raise InputError(f"{option} {path}: cannot write (No such file or directory)")


def write_plan(plan: Plan, path: str, option: str) -> None:
    """`plan.to_json(path)` (atomic); an OSError as one InputError line."""
    try:
        plan.to_json(path)
    except OSError as exc:
        raise InputError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None


# --- output -------------------------------------------------------------------------------------


def _print_result(
    args: argparse.Namespace, result: SearchResult, saved: _Saved, *, fitted: bool
) -> None:
    if args.json:
        print_json(search_result_document(result, out=args.out, saved=saved))
        return
    print(_human_text(args, result, saved, fitted=fitted), file=human_stream(args.out))
    if args.out == STDOUT:
        print(result.best.to_json_text())


def _human_text(
    args: argparse.Namespace, result: SearchResult, saved: _Saved, *, fitted: bool
) -> str:
    """The tables `format_search_result` makes, then where the plan went."""
    from hexiseq.report import format_search_result

    lines = [format_search_result(result)]
    if fitted:  # a fitted model was asked for: say which model each type used
        labels = result.best.predicted.cost_model.items()
        lines.append("\ncost model per device type: " + "; ".join(f"{g}: {m}" for g, m in labels))
    if args.out == STDOUT:
        lines.append("\nplan JSON written to stdout")
    elif args.out:
        lines.append(f"\nplan written to {args.out}")
    if saved.plan_id is not None:
        lines.append(f"saved to {saved.store_url} as plan {saved.plan_id} (baselines beside it)")
    return "\n".join(lines)


def search_result_document(
    result: SearchResult, *, out: str | None = None, saved: _Saved | None = None
) -> dict[str, Any]:
    """What `hexiseq plan --json` prints: the problem, the best plan (summary and one row per
    device), every baseline with the best plan's speedup over it, the data-parallel replicas,
    the Pareto front, the search, and where the plan went."""
    best, replicas, saved = result.best, result.data_parallel, saved or _Saved()
    return {
        "cluster": best.cluster.name,
        "model": best.model.name,
        "seq_len": best.train.seq_len,
        "devices": best.cluster.world_size,
        "best": plan_document(best),
        "baselines": {
            name: _baseline_document(best, other) for name, other in result.baselines.items()
        },
        "strongest_baseline": (
            None if result.strongest_baseline is None else result.strongest_baseline.name
        ),
        "speedup_over_strongest": result.speedup_over_strongest(),
        "data_parallel": None if replicas is None else _replicas_document(result),
        "pareto": [_pareto_point(plan) for plan in result.pareto],
        "search": {
            "study_name": result.study_name,
            "candidates": len(result.trials),
            "feasible": sum(1 for t in result.trials if t.tokens_per_s is not None),
        },
        "out": out,
        "store": saved.store_url,
        "plan_id": saved.plan_id,
    }


def plan_document(plan: Plan) -> dict[str, Any]:
    """A plan's summary and one row per device (rank): JSON-ready."""
    predicted = plan.predicted
    return {
        "name": plan.name,
        "tokens_per_s": predicted.tokens_per_s,
        "step_time_s": predicted.step_time_s,
        "max_memory_fraction": predicted.max_memory_fraction,
        "activation_checkpointing": plan.train.activation_checkpointing,
        "cost_model": dict(predicted.cost_model),
        "knobs": plan.knobs,
        "sequences_per_step": plan.train.micro_batches,
        "replicas": [
            {"ranks": list(replica.ranks), "sequences": replica.sequences}
            for replica in plan.replicas
        ],
        "ranks": [
            _rank_row(assignment, rank)
            for assignment, rank in zip(plan.assignments, predicted.ranks)
        ],
    }


def _rank_row(assignment, rank) -> dict[str, Any]:
    return {
        "rank": assignment.rank,
        "replica": assignment.replica,
        "node": assignment.node,
        "gpu": assignment.gpu,
        "group": assignment.group,
        "head_range": list(assignment.head_range),
        "heads": assignment.heads,
        "tokens": assignment.tokens,
        "state_fraction": assignment.state_fraction,
        "step_s": rank.step_s,
        "busy_s": rank.busy_s,
        "idle_s": rank.idle_s,
        "time_s": rank.to_dict(),
        "memory_bytes": rank.memory_bytes,
        "memory_capacity_bytes": rank.memory_capacity_bytes,
        "memory_fraction": rank.memory_fraction,
    }


def _baseline_document(best: Plan, other: Plan | InfeasiblePlan) -> dict[str, Any]:
    from hexiseq.plan import InfeasiblePlan

    if isinstance(other, InfeasiblePlan):
        return {
            "plan_name": other.name,
            "feasible": False,
            "reason": other.reason,
            "missing_bytes": {str(rank): n for rank, n in other.missing_bytes.items()},
        }
    return {
        "plan_name": other.name,
        "feasible": True,
        "tokens_per_s": other.predicted.tokens_per_s,
        "step_time_s": other.predicted.step_time_s,
        "max_memory_fraction": other.predicted.max_memory_fraction,
        "speedup": best.predicted.tokens_per_s / other.predicted.tokens_per_s,
    }


def _replicas_document(result: SearchResult) -> dict[str, Any]:
    replicas = result.data_parallel
    return {
        "description": replicas.describe(),
        "tokens_per_s": replicas.tokens_per_s,
        "step_time_s": replicas.step_time_s,
        "gradient_sync_s": replicas.gradient_sync_s,
        "replicas": [
            {"gpu": r.gpu, "devices": r.plan.cluster.world_size, "sequences": r.sequences}
            for r in replicas.replicas
        ],
        "idle_types": list(replicas.idle_types),
        "speedup": result.speedup_over_data_parallel(),
    }


def _pareto_point(plan: Plan) -> dict[str, Any]:
    return {
        "tokens_per_s": plan.predicted.tokens_per_s,
        "headroom": 1.0 - plan.predicted.max_memory_fraction,
        "knobs": plan.knobs,
    }
