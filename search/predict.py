"""`hexiseq.predict`: predict an existing plan again with the current simulator, memory model
and cost model (docs/design.md §4), e.g. a plan written by an earlier hexiseq, or one planned on
the datasheet before the cluster was profiled.

The cost model is chosen as `hexiseq plan --cost-model` chooses it (`plan_cost_model` of
`hexiseq.cli.fit`), from the store's newest fitted model; the plan is then simulated exactly
as the search scored it: same layout, same per-rank state fractions.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from hexiseq.cli.fit import COST_MODEL_CHOICES, plan_cost_model
from hexiseq.costmodel import CostModel, DatasheetCostModel, simulate_step
from hexiseq.errors import InputError
from hexiseq.plan import Plan, Prediction
from hexiseq.search._evaluate import plan_prediction
from hexiseq.search.replicas import predict_replicas
from hexiseq.store import STORE_URL_ENV, Store

_COST_MODEL_METHODS = ("label", "gemm_time_s", "attention_time_s", "transfer_time_s")
_SQLITE_FILE_URL = re.compile(r"^sqlite(\+\w+)?:///([^?]+)")


def predict(
    plan: Plan, store: str | Store | None = None, cost_model: str | CostModel = "auto"
) -> Prediction:
    """Simulate `plan` (its cluster, model, train spec, layout and per-rank state fractions)
    under the current models; the result compares with `plan.predicted`.

    `cost_model`: "auto" (the store's newest fitted model for the GPU types it covers, the
    datasheet elsewhere), "fitted" (the same, but InputError unless it covers every GPU type
    of the plan), "datasheet", or a `CostModel`. `store`: a `Store`, a store URL, or None:
    $HEXISEQ_STORE_URL, else no store (then "auto" is the datasheet). Raises InputError for a
    bad choice, a store that cannot be opened or a missing SQLite file.
    """
    if not isinstance(plan, Plan):
        raise InputError(f"predict: expected a hexiseq Plan, got {type(plan).__name__}")
    if isinstance(cost_model, str) and cost_model == "datasheet":
        cost: CostModel = DatasheetCostModel()
    else:
        with open_prediction_store(store) as opened:
            cost = resolve_cost_model(cost_model, opened, plan.cluster.gpu_types)
    if plan.data_parallel:
        return predict_replicas(plan, cost)
    fractions = [assignment.state_fraction for assignment in plan.assignments]
    step = simulate_step(plan.cluster, plan.model, plan.train, plan.layout(), cost, fractions)
    return plan_prediction(step)


def resolve_cost_model(
    choice: str | CostModel, store: Store | None, gpu_types: Iterable[str]
) -> CostModel:
    """The cost model `choice` names (see `predict`), read from `store` (None: no store).

    Raises InputError for an unknown choice, "fitted" without a store or a fitted model, or a
    fitted model that leaves one of `gpu_types` to the datasheet.
    """
    if not isinstance(choice, str):
        missing = [name for name in _COST_MODEL_METHODS if not hasattr(choice, name)]
        if missing:
            raise InputError(
                f"cost_model: {type(choice).__name__} is not a CostModel (no "
                f"{', '.join(missing)}); give one of {', '.join(COST_MODEL_CHOICES)} or a "
                "CostModel"
            )
        return choice
    if choice not in COST_MODEL_CHOICES:
        raise InputError(
            f"cost model {choice!r} is not one of {', '.join(COST_MODEL_CHOICES)} "
            "(or a CostModel object)"
        )
    if store is None and choice == "fitted":
        raise InputError(
            "--cost-model fitted needs a store with a fitted model: give --store URL "
            f"(Python: store=) or set ${STORE_URL_ENV}"
        )
    # `plan_cost_model` reads only `cost_model` from its arguments when it is given the store.
    cost = plan_cost_model(argparse.Namespace(cost_model=choice), store)
    if choice == "fitted":
        _check_covers(cost, store, gpu_types)
    return cost or DatasheetCostModel()


def _check_covers(cost: CostModel | None, store: Store | None, gpu_types: Iterable[str]) -> None:
    """`fitted` means fitted for every GPU type of the plan, not the datasheet for some."""
    covered = getattr(cost, "covered_types", ())
    uncovered = [gpu for gpu in dict.fromkeys(gpu_types) if gpu not in covered]
    if uncovered and store is not None:
        raise InputError(
            f"--cost-model fitted: the newest fitted model in store {store.url} covers "
            f"{', '.join(covered) or 'no device type'}, not {', '.join(uncovered)}; profile "
            "and fit those, or use --cost-model auto (the datasheet for them)"
        )


@contextmanager
def open_prediction_store(store: str | Store | None) -> Iterator[Store | None]:
    """The store `predict` reads: `store` itself; the store at URL `store` (closed on exit);
    else the one at $HEXISEQ_STORE_URL; else None. A SQLite file must exist already (a typo
    must not create an empty store and fall back to the datasheet in silence)."""
    if isinstance(store, Store):
        yield store
        return
    url = store if store is not None else os.environ.get(STORE_URL_ENV) or None
    if url is None:
        yield None
        return
    if not isinstance(url, str):
        raise InputError(f"store: expected a URL or a Store, got {type(url).__name__}")
    with Store.open(url, create=False) as opened:
        yield opened
