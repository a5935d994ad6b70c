"""`hexiseq plans list|show|export`: the plans saved in the store, for people and scripts.

`list` shows the newest plans (`--limit N`), `show ID` one plan's summary and devices, and
`export ID` writes the plan JSON that `hexiseq run` and `hexiseq predict` read (atomically to
`--out PATH`, or to stdout). `list` and `show` take `--json`. An unknown id is one line, exit 2.
Reading never creates a store: a SQLite file that does not exist is an error.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from hexiseq.cli.arguments import positive_int
from hexiseq.cli.output import STDOUT, add_json_argument, print_json
from hexiseq.store import STORE_URL_HELP

if TYPE_CHECKING:
    from hexiseq.plan import Plan
    from hexiseq.store import PlanRecord, Store

DEFAULT_LIMIT = 20


def add_plans_parser(commands: Any) -> None:
    """Register `hexiseq plans` and its `list`, `show` and `export` subcommands."""
    plans = commands.add_parser(
        "plans",
        help="list, show or export the plans saved in the store",
        description="The plans `hexiseq plan` saved in the store (best plans and baselines).",
    )
    actions = plans.add_subparsers(
        dest="plans_action", required=True, parser_class=type(plans), metavar="list|show|export"
    )
    listing = actions.add_parser("list", help="the newest saved plans, newest first")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"show at most N plans (default {DEFAULT_LIMIT})",
    )
    add_json_argument(listing, "one object per plan")
    show = actions.add_parser("show", help="one saved plan: summary and one row per device")
    show.add_argument("plan_id", type=_plan_id, metavar="ID", help="plan id (see `plans list`)")
    add_json_argument(show, "the plan's record, summary and per-device rows")
    export = actions.add_parser(
        "export", help="write a saved plan's JSON file, as `hexiseq run` and `predict` read it"
    )
    export.add_argument("plan_id", type=_plan_id, metavar="ID", help="plan id (see `plans list`)")
    export.add_argument(
        "--out",
        default=STDOUT,
        metavar="PATH|-",
        help="write it here (atomically); '-' (the default): to stdout",
    )
    for action in (listing, show, export):
        action.add_argument(
            "--store", metavar="URL", help=f"SQLAlchemy URL of the store {STORE_URL_HELP}"
        )


def _plan_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a plan id (a whole number)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"plan ids start at 1 (got {text})")
    return value


def run_plans(args: argparse.Namespace) -> int:
    """Run `plans list|show|export`; InputError (exit 2) for an unknown id or store."""
    if args.plans_action == "export" and args.out != STDOUT:
        from hexiseq.cli.plan import check_writable

        check_writable(args.out, "--out")
    with open_existing_store(args.store) as store:
        if args.plans_action == "list":
            return _list(args, store)
        plan = _load_plan(store, args.plan_id)
        if args.plans_action == "show":
            return _show(args, store, plan)
        return _export(args, plan)


def open_existing_store(url: str) -> Store:
    """The store to read plans from; a SQLite file that does not exist is an InputError:
    reading plans should not leave an empty store behind."""
    from hexiseq.store import Store

    return Store.open(url, create=False)


def _load_plan(store: Store, plan_id: int) -> Plan:
    from hexiseq.plan import Plan

    text = store.get_plan_json(plan_id)  # InputError naming the ids present
    return Plan.from_json_text(text, source=f"store {store.url}: plan {plan_id}")


def _record(store: Store, plan_id: int) -> PlanRecord:
    return next(record for record in store.list_plans() if record.id == plan_id)


# --- list ---------------------------------------------------------------------------------------


def _list(args: argparse.Namespace, store: Store) -> int:
    records = store.list_plans(limit=args.limit)
    if args.json:
        print_json({"store": store.url, "plans": [record_document(r) for r in records]})
        return 0
    if not records:
        print(f"store {store.url} holds no plans; `hexiseq plan --store {store.url}` saves some")
        return 0
    print(_records_table(records))
    return 0


def record_document(record: PlanRecord) -> dict[str, Any]:
    """A stored plan's summary columns, JSON-ready (`created_at` in ISO 8601, UTC)."""
    return {
        "id": record.id,
        "created_at": record.created_at.isoformat(),
        "label": record.label,
        "cluster": record.cluster_name,
        "model": record.model_name,
        "seq_len": record.seq_len,
        "tokens_per_s": record.tokens_per_s,
        "step_time_s": record.step_time_s,
        "cost_model": record.cost_model,
    }


def _records_table(records: list[PlanRecord]) -> str:
    from hexiseq.report import format_table
    from hexiseq.units import format_tokens

    headers = ["id", "saved (UTC)", "label", "cluster", "model", "tokens", "tokens/s", "step s"]
    headers.append("cost model")
    rows = [
        [
            str(r.id),
            r.created_at.strftime("%Y-%m-%d %H:%M"),
            r.label,
            r.cluster_name,
            r.model_name,
            format_tokens(r.seq_len),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.1f}",
            "-" if r.step_time_s is None else f"{r.step_time_s:,.3f}",
            r.cost_model,
        ]
        for r in records
    ]
    return format_table(headers, rows, right={0, 5, 6, 7})


# --- show and export ----------------------------------------------------------------------------


def _show(args: argparse.Namespace, store: Store, plan: Plan) -> int:
    from hexiseq.cli.plan import plan_document

    record = _record(store, args.plan_id)
    if args.json:
        print_json({"store": store.url, **record_document(record), "plan": plan_document(plan)})
        return 0
    from hexiseq.report import format_plan

    print(
        f"plan {record.id} ({record.label}), saved {record.created_at:%Y-%m-%d %H:%M} UTC "
        f"in {store.url}"
    )
    print(format_plan(plan))
    print(f"knobs: {', '.join(f'{k}={v}' for k, v in plan.knobs.items())}")
    return 0


def _export(args: argparse.Namespace, plan: Plan) -> int:
    if args.out == STDOUT:
        print(plan.to_json_text())
        return 0
    from hexiseq.cli.plan import write_plan

    write_plan(plan, args.out, "--out")
    print(f"plan {args.plan_id} written to {args.out}")
    return 0
