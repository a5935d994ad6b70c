"""What-if page: choose a cluster, a model, a sequence length and a time budget, run
`plan_search`, look at the result on every page, optionally save it to the store."""

from __future__ import annotations

import streamlit as st
import yaml

from hexiseq.cluster import Cluster, cluster_presets
from hexiseq.dashboard import _session
from hexiseq.dashboard.views import plan as plan_views
from hexiseq.dashboard.views import throughput as throughput_views
from hexiseq.errors import HexiseqError, InputError
from hexiseq.model import ModelSpec, model_presets
from hexiseq.units import format_tokens, parse_seq_len

DEFAULT_CLUSTER, DEFAULT_MODEL, DEFAULT_SEQ_LEN = "h100x8-a100x8", "llama-30b", "512k"
COST_MODELS = ("auto", "datasheet", "fitted")
"""The choices of `hexiseq plan --cost-model`, read from this dashboard's store."""


def _index(options: list[str], default: str) -> int:
    return options.index(default) if default in options else 0


def _cluster(preset: str, upload) -> Cluster:
    """The uploaded YAML when there is one, else the preset."""
    if upload is None:
        return Cluster.preset(preset)
    try:
        document = yaml.safe_load(upload.getvalue().decode("utf-8", "replace"))
    except yaml.YAMLError as error:
        raise InputError(f"cluster file {upload.name}: not valid YAML ({error})") from None
    return Cluster.from_dict(document, source=f"cluster file {upload.name}")


def _form() -> dict | None:
    """The search's inputs once the form is submitted, else None."""
    presets, models = list(cluster_presets()), list(model_presets())
    with st.form("whatif"):
        left, right = st.columns(2)
        preset = left.selectbox(
            "Cluster preset", presets, _index(presets, DEFAULT_CLUSTER), key="whatif_cluster"
        )
        upload = left.file_uploader(
            "... or a cluster YAML", type=["yaml", "yml"], key="whatif_cluster_yaml"
        )
        model = right.selectbox("Model", models, _index(models, DEFAULT_MODEL), key="whatif_model")
        seq_len = right.text_input(
            "Sequence length (131072, 128k, 1M)", DEFAULT_SEQ_LEN, key="whatif_seq_len"
        )
        budget_s = right.number_input(
            "Optuna time budget, s (0: greedy short list only)",
            0.0,
            600.0,
            0.0,
            key="whatif_budget_s",
        )
        pareto = right.checkbox(
            "Throughput vs memory headroom (Pareto front)", key="whatif_pareto"
        )
        cost_model = right.radio(
            "Cost model",
            COST_MODELS,
            horizontal=True,
            key="whatif_cost_model",
            help="auto: the store's newest fit for the GPU types it covers (fits that missed "
            "their goal left to the datasheet), the datasheet elsewhere; fitted: the fit for "
            "every type, forced",
        )
        if not st.form_submit_button("Run the search"):
            return None
    return {
        "preset": preset,
        "upload": upload,
        "model": model,
        "seq_len": seq_len,
        "budget_s": budget_s,
        "pareto": pareto,
        "cost_model": cost_model,
    }


def _search(inputs: dict) -> None:
    from hexiseq.search import plan_search
    from hexiseq.search.predict import resolve_cost_model

    cluster = _cluster(inputs["preset"], inputs["upload"])
    model, seq_len = ModelSpec.preset(inputs["model"]), parse_seq_len(inputs["seq_len"])
    cost = resolve_cost_model(inputs["cost_model"], _session.store(), cluster.gpu_types)
    with st.spinner(f"Searching plans for {model.name} on {cluster.name} ..."):
        result = plan_search(
            cluster,
            model,
            seq_len,
            time_budget_s=inputs["budget_s"] or None,
            multi_objective=inputs["pareto"],
            cost_model=cost,
        )
    label = f"{model.name} on {cluster.name}, {format_tokens(seq_len)}"
    st.session_state[_session.WHATIF_KEY] = {"result": result, "label": label}
    _session.show_next_run(_session.WHATIF_CHOICE)


def _show(entry: dict) -> None:
    result = entry["result"]
    st.subheader(f"Result: {entry['label']}")
    st.caption("Every page now shows this plan (sidebar: what-if).")
    _session.caption_prediction_source(result.best)
    frame = throughput_views.throughput_frame(result.best, result.baselines, result.data_parallel)
    st.dataframe(frame, hide_index=True)
    speedup = result.speedup_over_data_parallel()
    if speedup is not None and speedup < 1.0:
        st.warning(
            "Running each GPU type as its own data-parallel replica is predicted faster than "
            f"this plan (hexiseq {speedup:.2f}x of it); hexiseq cannot run replicas yet."
        )
    st.plotly_chart(plan_views.segments_figure(result.best), key="whatif_segments")
    if st.button("Save the plan and its baselines to the store", key="whatif_save"):
        plan_id = _session.save_result(result)
        shown = _session.shown_store_url()
        st.success(f"Saved to {shown} as plan {plan_id} (baselines beside it).")


def main() -> None:
    st.title("What-if")
    _session.sidebar()
    inputs = _form()
    if inputs is not None:
        try:
            _search(inputs)
        except HexiseqError as error:
            # The previous result must not stay on screen with a live Save button beside this
            # error: a wrong plan was saved that way.
            st.session_state.pop(_session.WHATIF_KEY, None)
            st.error(str(error))
            return
    entry = st.session_state.get(_session.WHATIF_KEY)
    if entry is None:
        st.info("Choose a cluster, a model and a sequence length, then run the search.")
        return
    _show(entry)


main()
