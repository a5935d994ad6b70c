"""What-if page: choose a cluster, a model, a sequence length and a time budget, run
`plan_search`, look at the result on every page, optionally save it to the store."""

from __future__ import annotations

import streamlit as st
import yaml

from hexiseq.catalog import gpu_catalog
from hexiseq.cluster import Cluster, cluster_presets
from hexiseq.dashboard import _session
from hexiseq.dashboard.views import plan as plan_views
from hexiseq.dashboard.views import throughput as throughput_views
from hexiseq.dashboard.views import whatif as whatif_views
from hexiseq.errors import HexiseqError, InputError
from hexiseq.model import ModelSpec, model_presets
from hexiseq.units import format_tokens, parse_seq_len

DEFAULT_CLUSTER, DEFAULT_MODEL, DEFAULT_SEQ_LEN = "h100x8-a100x8", "llama-30b", "512k"
COST_MODELS = ("auto", "datasheet", "fitted")  # hexiseq plan --cost-model, from this store


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


def _edited_cluster() -> Cluster:
    """The preset or uploaded cluster, as edited in the nodes table and network fields (drawn
    outside the form: they change with the cluster chosen)."""
    presets = list(cluster_presets())
    left, right = st.columns(2)
    preset = left.selectbox(
        "Cluster preset", presets, _index(presets, DEFAULT_CLUSTER), key="whatif_cluster"
    )
    upload = right.file_uploader(
        "... or a cluster YAML", type=["yaml", "yml"], key="whatif_cluster_yaml"
    )
    base = _cluster(preset, upload)
    st.caption("Edit the cluster: add or remove nodes (rows), change GPU types, counts and links.")
    tag = f"{base.name}:{upload.name if upload is not None else ''}"
    nodes = st.data_editor(
        whatif_views.editable_nodes(base),
        num_rows="dynamic",
        hide_index=True,
        key=f"whatif_nodes:{tag}",
        column_config={
            "gpu": st.column_config.SelectboxColumn("gpu", options=list(gpu_catalog())),
            "count": st.column_config.NumberColumn("count", min_value=1, max_value=1024, step=1),
            "intra_node_GBps": st.column_config.NumberColumn("intra-node GB/s", min_value=0.0),
        },
    )
    bandwidth, latency = st.columns(2)
    inter_node_GBps = bandwidth.number_input(
        "Inter-node GB/s (per GPU, one direction)",
        min_value=0.0,
        value=float(base.inter_node_GBps),
        key=f"whatif_inter_GBps:{tag}",
    )
    latency_us = latency.number_input(
        "Inter-node latency, us",
        min_value=0.0,
        value=float(base.inter_node_latency_us),
        key=f"whatif_latency_us:{tag}",
    )
    return whatif_views.edited_cluster(base, nodes, inter_node_GBps, latency_us)


def _form() -> dict | None:
    """The search's inputs once the form is submitted, else None."""
    models = list(model_presets())
    with st.form("whatif"):
        left, right = st.columns(2)
        model = left.selectbox("Model", models, _index(models, DEFAULT_MODEL), key="whatif_model")
        seq_len = left.text_input(
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
        "model": model,
        "seq_len": seq_len,
        "budget_s": budget_s,
        "pareto": pareto,
        "cost_model": cost_model,
    }


def _search(cluster: Cluster, inputs: dict) -> None:
    from hexiseq.search import plan_search
    from hexiseq.search.predict import resolve_cost_model

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
            "Running each GPU type as its own data-parallel replica, on a batch of "
            f"{result.data_parallel.sequences} sequences per step, is predicted faster than "
            f"this plan (hexiseq {speedup:.2f}x of it); plan that batch (micro-batches) and "
            "hexiseq plans data-parallel replicas sharing it."
        )
    st.plotly_chart(plan_views.segments_figure(result.best), key="whatif_segments")
    if st.button("Save the plan and its baselines to the store", key="whatif_save"):
        try:
            plan_id = _session.save_result(result)
        except HexiseqError as error:
            st.error(str(error))
            return
        shown = _session.shown_store_url()
        st.success(f"Saved to {shown} as plan {plan_id} (baselines beside it).")


def _forget_result() -> None:
    """Drop the previous search's result: it must not stay on screen (or in the sidebar) with a
    live Save button beside an error - a wrong plan was saved that way."""
    st.session_state.pop(_session.WHATIF_KEY, None)


def _run_search() -> None:
    """The cluster editor and the form; the search when the form is submitted. Any error is one
    line, and leaves no result behind."""
    try:
        cluster = _edited_cluster()
    except HexiseqError as error:
        _forget_result()
        st.error(str(error))
        cluster = None
    inputs = _form()
    if inputs is None:
        return
    _forget_result()  # before searching: whatever fails below, the old result is gone
    try:
        if cluster is None:
            raise InputError("fix the cluster above first")
        _search(cluster, inputs)
    except HexiseqError as error:
        st.error(str(error))


def main() -> None:
    st.title("What-if")
    _session.store()  # a store that cannot be opened stops here, with one line
    _run_search()
    _session.sidebar()  # after the search: a result an error cleared is not offered there
    entry = st.session_state.get(_session.WHATIF_KEY)
    if entry is None:
        st.info("Choose a cluster, a model and a sequence length, then run the search.")
        return
    _show(entry)


main()
