"""What every page shares: the store, the plan the user is looking at, its baselines, and the
what-if result kept in `st.session_state`. The thin Streamlit shell around the pure views.

The app opens only the databases its operator configured, read from its environment (where
`hexiseq dashboard` puts them): the store ($HEXISEQ_STORE_URL) and Optuna studies
(`--optuna-storage`). A visitor chooses between them but never types a URL, and every page shows
them with the password masked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import streamlit as st

from hexiseq.dashboard.views.plan import prediction_source_line
from hexiseq.dashboard.views.records import BEST_LABEL, baseline_ids_of, plan_choice_label
from hexiseq.errors import HexiseqError
from hexiseq.plan import InfeasiblePlan, Plan
from hexiseq.store import (
    OPTUNA_STORAGE_ENV,
    PlanRecord,
    Store,
    display_url,
    store_url_from,
)

STORE_URL_KEY = "store_url"
OPTUNA_STORAGE_KEY = "optuna_storage_url"
STORE_CHOICE = "store"
OPTUNA_STORAGE_CHOICE = "optuna-storage"
PLAN_CHOICE_KEY = "plan_choice"
UPLOADS_KEY = "uploaded_plans"
WHATIF_KEY = "whatif_result"
WHATIF_CHOICE = "whatif"
PENDING_CHOICE_KEY = "pending_plan_choice"
KEPT_CHOICE_KEY = "kept_plan_choice"
"""The sidebar's plan, kept outside the widget's own state: Streamlit drops a widget's state
on a page switch, so the picker reset to the newest plan on every page."""
BASELINE_NAMES = ("uniform-usp", "ring-only", "ulysses-only", "homogeneous-subset")

PLAN_HINT = (
    "No plans yet. Run `hexiseq plan --cluster h100x8-a100x8 --model llama-30b --seq-len 512k` "
    "(it saves the plan and its baselines to the store), upload a plan JSON in the sidebar, or "
    "run a search on the **What-if** page."
)


@dataclass(frozen=True)
class SelectedPlan:
    """The plan shown, where it comes from, and its baselines (name -> plan or why not)."""

    plan: Plan
    source: str
    baselines: dict[str, Plan | InfeasiblePlan]


def store_url() -> str:
    """The store URL, password included (open it, never show it): set by a test in session
    state, else $HEXISEQ_STORE_URL, else the default."""
    if STORE_URL_KEY not in st.session_state:
        st.session_state[STORE_URL_KEY] = store_url_from(None)
    return st.session_state[STORE_URL_KEY]


def shown_store_url() -> str:
    """The store URL as pages show it: the password masked."""
    return display_url(store_url())


def optuna_storages() -> dict[str, str]:
    """Choice key -> URL of every Optuna storage the operator configured: the store's own
    database, and the `--optuna-storage` of `hexiseq dashboard` (a test sets it in session
    state) when given. Nothing a visitor types."""
    if OPTUNA_STORAGE_KEY not in st.session_state:
        st.session_state[OPTUNA_STORAGE_KEY] = os.environ.get(OPTUNA_STORAGE_ENV) or None
    storages = {STORE_CHOICE: store_url()}
    if st.session_state[OPTUNA_STORAGE_KEY] is not None:
        storages[OPTUNA_STORAGE_CHOICE] = st.session_state[OPTUNA_STORAGE_KEY]
    return storages


def optuna_storage_label(choice: str) -> str:
    """How the choice of `optuna_storages` is shown: where it comes from, the password masked."""
    where = "the store" if choice == STORE_CHOICE else "--optuna-storage"
    return f"{where}: {display_url(optuna_storages()[choice])}"


@st.cache_resource(show_spinner=False)
def _open_store(url: str) -> Store:
    return Store.open(url)


def store() -> Store:
    """The open store; a failed open shows one error line and stops the page."""
    try:
        return _open_store(store_url())
    except HexiseqError as error:
        st.error(f"Cannot open the store: {error}")
        st.stop()
        raise  # st.stop() raises; this keeps type checkers quiet


def saved_plans() -> list[PlanRecord]:
    return store().list_plans()


@st.cache_resource(show_spinner=False)
def _plan_from_text(text: str, source: str) -> Plan:
    return Plan.from_json_text(text, source=source)


def load_saved_plan(plan_id: int) -> Plan:
    return _plan_from_text(store().get_plan_json(plan_id), f"store plan {plan_id}")


@st.cache_resource(show_spinner="Scoring the baselines under the simulator ...")
def recompute_baselines(plan_json: str) -> dict[str, Plan | InfeasiblePlan]:
    """The baselines for the plan's cluster, model and sequence length, scored afresh (infeasible
    ones included, which `hexiseq plan` does not save)."""
    from hexiseq.search import plan_search

    plan = _plan_from_text(plan_json, "plan")
    try:
        return plan_search(plan.cluster, plan.model, plan.train.seq_len).baselines
    except HexiseqError:
        return {}


def plan_options() -> dict[str, str]:
    """Choice key -> label of every plan the user can look at."""
    options: dict[str, str] = {}
    if WHATIF_KEY in st.session_state:
        options[WHATIF_CHOICE] = f"what-if: {st.session_state[WHATIF_KEY]['label']}"
    for name in st.session_state.get(UPLOADS_KEY, {}):
        options[f"upload:{name}"] = f"uploaded: {name}"
    records = saved_plans()  # newest first; searched plans before their baselines
    for record in sorted(records, key=lambda r: r.label != BEST_LABEL):
        options[f"store:{record.id}"] = plan_choice_label(record)
    return options


def resolve(choice: str) -> SelectedPlan:
    """The plan behind a choice key of `plan_options`, with its baselines."""
    if choice == WHATIF_CHOICE:
        result = st.session_state[WHATIF_KEY]["result"]
        return SelectedPlan(result.best, "what-if search", dict(result.baselines))
    if choice.startswith("upload:"):
        name = choice.removeprefix("upload:")
        text = st.session_state[UPLOADS_KEY][name]
        plan = _plan_from_text(text, f"uploaded {name}")
        return SelectedPlan(plan, f"uploaded {name}", recompute_baselines(text))
    plan_id = int(choice.removeprefix("store:"))
    plan = load_saved_plan(plan_id)
    return SelectedPlan(plan, f"store plan #{plan_id}", _stored_baselines(plan_id, plan))


def _stored_baselines(plan_id: int, plan: Plan) -> dict[str, Plan | InfeasiblePlan]:
    """The baselines saved beside the plan; those `hexiseq plan` left out (infeasible ones)
    and those of a plan saved alone are scored afresh."""
    records = saved_plans()
    label = next((r.label for r in records if r.id == plan_id), BEST_LABEL)
    saved = baseline_ids_of(plan_id, records) if label == BEST_LABEL else {}
    baselines: dict[str, Plan | InfeasiblePlan] = {
        name: load_saved_plan(saved_id) for name, saved_id in saved.items()
    }
    if label == BEST_LABEL and any(name not in baselines for name in BASELINE_NAMES):
        fresh = recompute_baselines(plan.to_json_text())
        baselines.update({n: b for n, b in fresh.items() if n not in baselines})
    return {name: baselines[name] for name in BASELINE_NAMES if name in baselines}


def plan_picker(container, key: str = PLAN_CHOICE_KEY, label: str = "Plan") -> str | None:
    """A selectbox of `plan_options` in `container`; returns the chosen key (None: no plans)."""
    options = plan_options()
    if not options:
        return None
    keys = list(options)
    sidebar = key == PLAN_CHOICE_KEY
    if sidebar:
        pending = st.session_state.pop(PENDING_CHOICE_KEY, None)
        for wanted in (pending, st.session_state.get(key), st.session_state.get(KEPT_CHOICE_KEY)):
            if wanted in options:
                st.session_state[key] = wanted
                break
    if st.session_state.get(key) not in options:
        st.session_state[key] = keys[0]
    choice = container.selectbox(label, keys, format_func=options.get, key=key)
    if sidebar:
        st.session_state[KEPT_CHOICE_KEY] = choice
    return choice


def selected_plan() -> SelectedPlan | None:
    """The plan chosen in the sidebar, or None (the page then shows `PLAN_HINT`)."""
    choice = st.session_state.get(PLAN_CHOICE_KEY)
    options = plan_options()
    if choice not in options:
        choice = next(iter(options), None)
    if choice is None:
        return None
    try:
        return resolve(choice)
    except HexiseqError as error:
        st.error(str(error))
        return None


def caption_prediction_source(plan: Plan) -> None:
    """Which cost model made the plan's numbers (datasheet or fitted, per GPU type where they
    differ): on every page that shows predictions, not only the Plan page."""
    st.caption(prediction_source_line(plan))


def sidebar() -> None:
    """The sidebar every page draws: the store, the plan picker and a plan JSON upload.

    Drawn by each page rather than by the entry script: Streamlit's AppTest keeps only the
    page's own elements after the first run."""
    st.sidebar.caption(f"store: `{shown_store_url()}`")
    store()  # a store that cannot be opened stops here, with one line
    upload = st.sidebar.file_uploader("Upload a plan JSON", type=["json"], key="plan_upload")
    if upload is not None:
        error = add_upload(upload.name, upload.getvalue().decode("utf-8", "replace"))
        if error:
            st.sidebar.error(error)
    if plan_picker(st.sidebar) is None:
        st.sidebar.info("No plans in the store yet.")


def show_next_run(choice: str) -> None:
    """Make `choice` the sidebar's plan from the next run on (a widget's value cannot change
    once it is drawn in this run) and rerun."""
    st.session_state[PENDING_CHOICE_KEY] = choice
    st.rerun()


def add_upload(name: str, text: str) -> str | None:
    """Keep an uploaded plan JSON for this session; returns the error line if it is not a plan."""
    try:
        _plan_from_text(text, f"uploaded {name}")
    except HexiseqError as error:
        return str(error)
    st.session_state.setdefault(UPLOADS_KEY, {})[name] = text
    return None


def save_result(result) -> int:
    """Save a search result as `hexiseq plan` does: the best plan, then the feasible baselines,
    in one transaction. Returns the best plan's id."""
    return store().save_search_result(result.best, result.baselines, BEST_LABEL)
