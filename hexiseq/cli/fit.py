"""`hexiseq fit` and the cost-model choice of `hexiseq plan`: thin shells over
`hexiseq.costmodel.fit_cost_model` and `FittedCostModel` (imported on use: fitting loads
scikit-learn, which `hexiseq --help` should not wait for)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hexiseq.cli.output import add_json_argument, print_json
from hexiseq.errors import InputError
from hexiseq.store import STORE_URL_HELP

if TYPE_CHECKING:
    from hexiseq.costmodel import CostModel, FittedDocument, ProfileSource, RuntimeSource
    from hexiseq.store import Store

COST_MODEL_CHOICES = ("auto", "datasheet", "fitted")


def add_fit_parser(commands: Any) -> None:
    """Register `hexiseq fit` on the CLI's subcommands."""
    fit = commands.add_parser(
        "fit",
        help="fit the cost model to the profiles in the store and print its held-out errors",
        description="Fit op-time regressions and link models to every ok profile measurement "
        "in the store, save them as a fitted model and print the held-out errors "
        "(extrapolation to the largest third, leave one device type out).",
    )
    fit.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL of the store with the profiles {STORE_URL_HELP}",
    )
    add_json_argument(
        fit, "the fitted model's id and every fit's held-out errors, what was skipped"
    )


def add_cost_model_argument(plan: argparse.ArgumentParser) -> None:
    """`hexiseq plan --cost-model auto|datasheet|fitted`."""
    plan.add_argument(
        "--cost-model",
        choices=COST_MODEL_CHOICES,
        default="auto",
        help="auto: the newest fitted model in --store for the device types and op families "
        "it covers whose held-out error met its goal (5 %% compute, 10 %% links), the "
        "datasheet elsewhere (datasheet only with --no-store); fitted: every fit of that "
        "model, also those that missed their goal (forced, and said so), an error when the "
        "store has none; datasheet: datasheet peaks x published efficiencies",
    )


def run_fit(args: argparse.Namespace) -> int:
    """Fit, save and print the held-out table; InputError when there is nothing to fit."""
    from hexiseq.costmodel import FittedCostModel, format_heldout_table
    from hexiseq.store import Store

    with Store.open(args.store, create=False) as store:
        document = fit_store_profiles(store)
        model = FittedCostModel(document)
        fitted_id = store.save_fitted_model(model.to_json())
        url = store.url
    if args.json:
        print_json(fit_document(document, fitted_id, url, model.covered_types))
        return 0
    print(format_heldout_table(document))
    only = "links only" if document.links else "memory calibration only"
    covered = ", ".join(model.covered_types) or f"no device type ({only})"
    print(f"\nsaved to {url} as fitted model {fitted_id}; `hexiseq plan --store {url}` uses it")
    print(f"for {covered} and the datasheet for every other GPU type", end="")
    calibrated = ", ".join(dict.fromkeys(fit.device_type for fit in document.memory))
    print(f"; memory calibrated by measured peaks for {calibrated}" if calibrated else "")
    return 0


_FIT_FIELDS = {
    "ops": {"device_type", "op", "dtype", "emulation_slowdown", "points", "fit_mape"},
    "links": {"link_class", "op", "device_type", "points", "fit_mape"},
    "memory": {"device_type", "memory_measure", "reserve_bytes", "scale", "points", "fit_mape"},
}


def fit_document(
    document: FittedDocument, fitted_id: int, url: str, covered_types: Sequence[str]
) -> dict[str, Any]:
    """What `hexiseq fit --json` prints: where the fit went, the device types it covers, each
    fit's identity, points and held-out errors (`heldout`: extrapolation to the largest third,
    leave one device type out, the goal and whether it was met), and what was skipped."""
    fits = {
        kind: [
            {**fit.model_dump(mode="json", include=fields), "heldout": _heldout(fit)}
            for fit in getattr(document, kind)
        ]
        for kind, fields in _FIT_FIELDS.items()
    }
    return {
        "store": url,
        "fitted_model_id": fitted_id,
        "covered_types": list(covered_types),
        **fits,
        "skipped": [skipped.model_dump(mode="json") for skipped in document.skipped],
        "sources": [source.model_dump(mode="json") for source in document.sources],
    }


def _heldout(fit) -> dict[str, Any]:
    return fit.heldout.model_dump(mode="json")


def read_profile_sources(store: Store, *, required: bool = True) -> list[ProfileSource]:
    """Every profile run of `store` with its measurements; InputError if there is none and
    `required`."""
    from hexiseq.costmodel import ProfileSource

    runs = store.profile_measurements_by_run()
    if not runs and required:
        raise InputError(
            f"store {store.url} holds no profile measurements; run `hexiseq profile "
            f"--device cpu --quick --store {store.url}` first"
        )
    return [
        ProfileSource(run_id, started_at.isoformat(), measurements)
        for run_id, started_at, measurements in runs
    ]


def read_runtime_sources(store: Store) -> list[RuntimeSource]:
    """Every runtime run of `store` with each rank's peak memory (calibrates memory)."""
    from hexiseq.costmodel import RuntimeSource

    return [RuntimeSource(*run) for run in store.runtime_peaks()]


def fit_store_profiles(store: Store) -> FittedDocument:
    """Fit every ok measurement of `store` and calibrate memory by its runtime runs;
    InputError when it holds neither, or no family has enough points."""
    from hexiseq.costmodel import fit_cost_model

    runtime_runs = read_runtime_sources(store)
    profiles = read_profile_sources(store, required=not runtime_runs)
    document = fit_cost_model(profiles, runtime_runs=runtime_runs)
    if not document.ops and not document.links and not document.memory:
        reasons = "; ".join(f"{s.what}: {s.reason}" for s in document.skipped[:3])
        ok_rows = sum(source.ok_rows for source in document.sources)
        raise InputError(
            f"store {store.url}: nothing to fit ({ok_rows} ok measurements"
            + (f"; {reasons}" if reasons else "")
            + ")"
        )
    return document


def plan_cost_model(args: argparse.Namespace, store: Store | None) -> CostModel | None:
    """The cost model `hexiseq plan` passes to `plan_search` (None: the datasheet default).

    `store` is the store the plans go to (None with --no-store); `--cost-model fitted` opens
    `--store` for reading when it is None and forces fits that missed their goal (`auto`
    leaves those op families to the datasheet; the labels say which). Raises InputError when
    `fitted` finds no fitted model, or the stored document is corrupt.
    """
    if args.cost_model == "datasheet" or (store is None and args.cost_model == "auto"):
        return None
    if store is None:
        from hexiseq.store import Store

        with Store.open(args.store, create=False) as own_store:
            return _latest_fitted(own_store, required=True)
    return _latest_fitted(store, required=args.cost_model == "fitted")


def _latest_fitted(store: Store, *, required: bool) -> CostModel | None:
    """The newest fitted model of `store`, forced when `required` (`--cost-model fitted`)."""
    text = store.latest_fitted_model()
    if text is None:
        if required:
            raise InputError(
                f"--cost-model fitted: store {store.url} holds no fitted model; run "
                f"`hexiseq fit --store {store.url}` after `hexiseq profile`"
            )
        return None
    from hexiseq.costmodel import FittedCostModel

    return FittedCostModel.from_json(
        text, source=f"store {store.url}: latest fitted model", forced=required
    )
