"""Throughput page: plan vs baselines, the search's history and Pareto front, predicted
vs measured runtime runs, and the re-plans of `hexiseq run` launches."""

from __future__ import annotations

import hashlib

import streamlit as st

from hexiseq.dashboard import _session
from hexiseq.dashboard.views import replans as replan_views
from hexiseq.dashboard.views import throughput as views
from hexiseq.errors import HexiseqError
from hexiseq.store import display_url, mask_url_passwords

RUN_HINT = (
    "No runtime runs in the store. Write a plan with `hexiseq plan ... --out plan.json`, then "
    "`hexiseq run --plan plan.json --steps 5 --store <this store's URL>`."
)
REPLAN_HINT = (
    "No re-plans in the store. `hexiseq run --replan` re-plans when a rank runs slower than "
    "at its start or a device is lost, and records each re-plan here with its predicted and "
    "measured gain."
)
ALL_LAUNCHES = "all launches"
STUDY_HINT = (
    "Studies kept by `hexiseq plan ... --trials 40 --storage <this store's URL>` show here, and "
    "those of the storage given to `hexiseq dashboard --optuna-storage URL`; or run a search on "
    "the What-if page."
)


def _baselines(selected: _session.SelectedPlan) -> None:
    st.subheader("Plan vs baselines")
    _session.caption_prediction_source(selected.plan)
    if not selected.baselines:
        st.info("No baselines for this plan (none saved and none could be scored).")
        return
    frame = views.throughput_frame(selected.plan, selected.baselines)
    st.plotly_chart(views.throughput_figure(frame), key="throughput")
    st.dataframe(frame, hide_index=True)


def _whatif_search() -> None:
    result = st.session_state[_session.WHATIF_KEY]["result"]
    values = [t.tokens_per_s for t in result.trials if t.params]
    history = views.search_history_frame(values)
    title = f"What-if search history ({result.study_name})"
    st.plotly_chart(views.search_history_figure(history, title), key="whatif_history")
    if result.pareto:
        points = [
            (p.predicted.tokens_per_s, 1 - p.predicted.max_memory_fraction) for p in result.pareto
        ]
        st.plotly_chart(views.pareto_figure(views.pareto_frame(points)), key="whatif_pareto")


def _stored_study() -> None:
    import optuna

    # Only what the operator configured, never a typed URL: a visitor must not make the app
    # open (or create) a database of their choosing. The store's own database comes first.
    storages = _session.optuna_storages()
    choice = st.selectbox(
        "Optuna storage",
        list(storages),
        format_func=_session.optuna_storage_label,
        key="optuna_storage",
    )
    storage, shown = storages[choice], display_url(storages[choice])
    try:
        names = optuna.study.get_all_study_names(storage=storage)
    except Exception as error:  # optuna raises many kinds for a bad URL; say it in one line
        reason = mask_url_passwords((str(error).splitlines() or [type(error).__name__])[0])
        st.error(f"Cannot read Optuna storage {shown}: {reason}")
        return
    if not names:
        st.info(f"No studies in {shown}. {STUDY_HINT}")
        return
    name = st.selectbox("Study", names, key="optuna_study")
    values = views.study_values(optuna.load_study(study_name=name, storage=storage).trials)
    history = views.search_history_frame([v[0] if v else None for v in values])
    st.plotly_chart(views.search_history_figure(history, f"Study {name}"), key="study_history")
    points = [v[:2] for v in values if v and len(v) >= 2 and v[0] > 0]
    if points:
        st.plotly_chart(views.pareto_figure(views.pareto_frame(points)), key="study_pareto")


def _plan_of_run(run: dict, plans_by_hash: dict) -> object:
    if run["plan_id"] is not None:
        try:
            return _session.load_saved_plan(run["plan_id"])
        except HexiseqError:
            return None
    return plans_by_hash.get(run["plan_hash"])


def _runs() -> None:
    st.subheader("Predicted vs measured (runtime runs)")
    store = _session.store()
    runs = store.list_runtime_runs()
    if not runs:
        st.info(RUN_HINT)
        return
    plans_by_hash = {}
    if any(run["plan_id"] is None for run in runs):
        for record in _session.saved_plans()[:200]:
            text = store.get_plan_json(record.id)
            plans_by_hash[hashlib.sha256(text.encode()).hexdigest()] = _session.load_saved_plan(
                record.id
            )
    measurements = {run["id"]: store.runtime_measurements(run["id"]) for run in runs}
    plans = {run["id"]: _plan_of_run(run, plans_by_hash) for run in runs}
    frame = views.runs_frame(runs, measurements, plans)
    st.plotly_chart(views.predicted_vs_measured_figure(frame), key="runs")
    st.dataframe(frame, hide_index=True)
    run_id = st.selectbox("Run, per rank", list(frame["run"]), key="run_choice")
    if plans.get(run_id) is not None:
        ranks = views.rank_measured_frame(plans[run_id], measurements[run_id])
        st.dataframe(ranks, hide_index=True)
    else:
        st.caption("The plan of this run is not in the store: no prediction to compare with.")


def _replans() -> None:
    st.subheader("Re-plans (hexiseq run)")
    records = _session.store().list_replans()
    if not records:
        st.info(REPLAN_HINT)
        return
    launches = list(dict.fromkeys(record.launch_id for record in records))
    if len(launches) > 1:
        launch = st.selectbox("Launch", [ALL_LAUNCHES, *launches], key="replan_launch")
        if launch != ALL_LAUNCHES:
            records = [record for record in records if record.launch_id == launch]
    frame = replan_views.replans_frame(records)
    st.plotly_chart(replan_views.replan_gain_figure(frame), key="replan_gains")
    st.dataframe(frame, hide_index=True)


def main() -> None:
    st.title("Throughput")
    _session.sidebar()
    selected = _session.selected_plan()
    if selected is None:
        st.info(_session.PLAN_HINT)
    else:
        _baselines(selected)
    st.subheader("Search: Optuna history and Pareto front")
    if selected is not None and selected.source == "what-if search":
        _whatif_search()
    with st.expander("Optuna study from a configured storage", expanded=True):
        _stored_study()
    _runs()
    _replans()


main()
