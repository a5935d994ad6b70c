"""`hexiseq predict --plan PATH`: a thin shell over `hexiseq.predict` that prints the plan's
stored prediction beside the current models' one (the search and cost-model modules load on
use: `hexiseq --help` should not wait for them)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from hexiseq.cli.fit import add_cost_model_argument
from hexiseq.plan import Plan, Prediction, RankPrediction

if TYPE_CHECKING:
    from hexiseq.store import Store

GIB = 2**30


def add_predict_parser(commands: Any) -> None:
    """Register `hexiseq predict` on the CLI's subcommands."""
    predict = commands.add_parser(
        "predict",
        help="predict a saved plan again with the current simulator and cost model",
        description="Simulate a plan JSON again (same layout, same state shares) with the "
        "current models and print its stored prediction beside the new one, per rank. The "
        "fitted model comes from --store, else $HEXISEQ_STORE_URL; without either, auto is "
        "the datasheet. fitted fails unless the fit covers every GPU type of the plan.",
    )
    predict.add_argument("--plan", required=True, metavar="PATH", help="plan JSON file")
    predict.add_argument(
        "--store",
        metavar="URL",
        help="SQLAlchemy URL of the store with the fitted model (default $HEXISEQ_STORE_URL)",
    )
    add_cost_model_argument(predict)
    predict.add_argument(
        "--json", action="store_true", help="print a JSON document: the new and the old prediction"
    )


def run_predict(args: argparse.Namespace) -> int:
    """Load the plan, predict it again, print the comparison; InputError on bad input."""
    from hexiseq.search.predict import open_prediction_store, predict

    plan = Plan.from_json(args.plan)
    if args.cost_model == "datasheet":  # no store needed: do not open one
        new, store_url = predict(plan, cost_model="datasheet"), None
    else:
        with open_prediction_store(args.store) as store:
            new, store_url = predict(plan, store, args.cost_model), _shown_url(store)
    if args.json:
        print(json.dumps(_json_document(args, plan, new, store_url), indent=1))
    else:
        print(format_prediction_change(args.plan, plan, new, store_url))
    return 0


def _shown_url(store: Store | None) -> str | None:
    return None if store is None else store.url  # `Store.url` masks a password


def _json_document(
    args: argparse.Namespace, plan: Plan, new: Prediction, store_url: str | None
) -> dict[str, Any]:
    return {
        "plan": args.plan,
        "plan_name": plan.name,
        "cost_model_choice": args.cost_model,
        "store": store_url,
        "new": new.to_dict(),
        "old": plan.predicted.to_dict(),
    }


def format_prediction_change(path: str, plan: Plan, new: Prediction, store_url: str | None) -> str:
    """The text report: summary, cost model per GPU type, time and memory per rank."""
    return "\n".join(
        [
            *_summary_lines(path, plan, new, store_url),
            "",
            "time per rank (ms), as stored in the plan (old) and predicted now (new)",
            *_table(*_time_rows(plan, new)),
            "",
            "memory per rank (GiB)",
            *_table(*_memory_rows(plan, new)),
            *_over_limit_lines(new),
        ]
    )


def _summary_lines(path: str, plan: Plan, new: Prediction, store_url: str | None) -> list[str]:
    old, train = plan.predicted, plan.train
    checkpointing = "on" if train.activation_checkpointing else "off"
    lines = [
        f"plan {path}: {plan.name}, {plan.model.name} on {plan.cluster.name} "
        f"({_count(plan.cluster.world_size, 'rank')}), {train.tokens_per_step:,} tokens per step, "
        f"activation checkpointing {checkpointing}",
        f"step time   {old.step_time_s:.4g} s -> {new.step_time_s:.4g} s  "
        f"(new/old {_ratio(new.step_time_s, old.step_time_s)})",
        f"tokens/s    {old.tokens_per_s:,.0f} -> {new.tokens_per_s:,.0f}  "
        f"(new/old {_ratio(new.tokens_per_s, old.tokens_per_s)})",
        f"max memory  {_percent(old.max_memory_fraction)} -> {_percent(new.max_memory_fraction)} "
        "of capacity",
        "cost model per GPU type" + (f" (store {store_url})" if store_url else "") + ":",
    ]
    for gpu in dict.fromkeys([*old.cost_model, *new.cost_model]):
        before, after = old.cost_model.get(gpu, "-"), new.cost_model.get(gpu, "-")
        change = f"{after} (unchanged)" if before == after else f"{before} -> {after}"
        lines.append(f"  {gpu}: {change}")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def _ratio(new: float, old: float) -> str:
    return f"{new / old:.3f}" if old > 0 else "-"


def _time_rows(plan: Plan, new: Prediction) -> tuple[list[str], list[list[str]]]:
    parts = list(new.ranks[0].to_dict()) if new.ranks else []
    header = ["rank", "gpu", "node", "", *(p.removesuffix("_s") for p in parts), "step"]
    rows = []
    for assignment, before, after in zip(plan.assignments, plan.predicted.ranks, new.ranks):
        for label, rank in (("old", before), ("new", after)):
            first = [str(assignment.rank), assignment.gpu, assignment.node]
            times = [getattr(rank, part, 0.0) for part in parts] + [rank.step_s]
            rows.append(
                (first if label == "old" else ["", "", ""])
                + [label, *(f"{1e3 * t:.2f}" for t in times)]
            )
    return header, rows


def _memory_rows(plan: Plan, new: Prediction) -> tuple[list[str], list[list[str]]]:
    header = ["rank", "gpu", "old peak", "new peak", "new/old", "capacity", "old %", "new %"]
    rows = [
        [
            str(assignment.rank),
            assignment.gpu,
            f"{before.memory_bytes / GIB:.2f}",
            f"{after.memory_bytes / GIB:.2f}",
            _ratio(after.memory_bytes, before.memory_bytes),
            _capacity(before, after),
            _percent(before.memory_fraction),
            _percent(after.memory_fraction),
        ]
        for assignment, before, after in zip(plan.assignments, plan.predicted.ranks, new.ranks)
    ]
    return header, rows


def _capacity(before: RankPrediction, after: RankPrediction) -> str:
    old, new = before.memory_capacity_bytes / GIB, after.memory_capacity_bytes / GIB
    return f"{new:.2f}" if old == new else f"{old:.2f} -> {new:.2f}"


def _over_limit_lines(new: Prediction) -> list[str]:
    """Ranks the current memory model puts over the planner's limit (95 % of capacity)."""
    from hexiseq.costmodel import memory_limit_bytes

    over = [
        f"rank {r} by {(rank.memory_bytes - limit) / GIB:.2f} GiB"
        for r, rank in enumerate(new.ranks)
        if rank.memory_bytes > (limit := memory_limit_bytes(rank.memory_capacity_bytes))
    ]
    if not over:
        return []
    return ["", "over the 95 % memory limit under the current model: " + "; ".join(over)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns, two spaces apart; numbers right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(cells, widths, numeric)
        )
        return "  ".join(padded).rstrip()

    return [line(header), *(line(row) for row in rows)]


def _is_number(cell: str) -> bool:
    try:
        float(cell.removesuffix(" %"))
    except ValueError:
        return False
    return True
