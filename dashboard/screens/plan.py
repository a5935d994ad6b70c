"""Plan page: per device its heads and sequence segments, per-rank time, and a side-by-side
comparison with a second plan."""

from __future__ import annotations

import streamlit as st

from hexiseq.dashboard import _session
from hexiseq.dashboard.views import plan as views


def _headline(selected: _session.SelectedPlan) -> None:
    plan = selected.plan
    st.caption(
        f"{plan.name} from {selected.source}: {plan.model.name} on {plan.cluster.name}, "
        f"{plan.train.seq_len:,} tokens"
    )
    _session.caption_prediction_source(plan)
    tokens, step, memory = st.columns(3)
    tokens.metric("tokens/s (predicted)", f"{plan.predicted.tokens_per_s:,.1f}")
    step.metric("step time", f"{plan.predicted.step_time_s:.4g} s")
    memory.metric("fullest device", f"{100 * plan.predicted.max_memory_fraction:.1f} %")


def _layout(plan) -> None:
    ranks = None
    if plan.cluster.world_size > views.DETAIL_RANKS:
        ranks = _node_drill_down(plan)
    st.plotly_chart(views.segments_figure(plan, ranks), key="segments")
    heads, times = st.columns(2)
    heads.plotly_chart(views.heads_figure(plan, ranks), key="heads")
    times.plotly_chart(views.time_breakdown_figure(plan, ranks), key="times")
    st.subheader("Devices")
    st.dataframe(views.assignments_frame(plan, ranks), hide_index=True)
    st.caption(f"knobs: {plan.knobs}")


def _node_drill_down(plan) -> list[int]:
    """A large plan: one row per node, then the ranks of the node picked (per-rank figures of
    every rank would make the page thousands of pixels tall)."""
    st.subheader("Nodes")
    st.dataframe(views.node_summary_frame(plan).round(3), hide_index=True)
    by_node = views.node_ranks(plan)
    node = st.selectbox("Ranks of node", list(by_node), key="plan_node")
    st.caption(f"{plan.cluster.world_size} ranks: showing node {node}'s {len(by_node[node])}.")
    return by_node[node]


def _compare(plan) -> None:
    st.subheader("Compare with another plan")
    choice = _session.plan_picker(st, key="compare_choice", label="Second plan")
    if choice is None:
        return
    other = _session.resolve(choice).plan
    st.dataframe(views.compare_plans_frame({"shown plan": plan, "second plan": other}))
    left, right = st.columns(2)
    for column, shown, tag in ((left, plan, "a"), (right, other, "b")):
        if shown.cluster.world_size > views.DETAIL_RANKS:  # one row per node, not per rank
            column.dataframe(views.node_summary_frame(shown).round(3), hide_index=True)
            continue
        column.plotly_chart(views.segments_figure(shown), key=f"compare_segments_{tag}")
        column.plotly_chart(views.time_breakdown_figure(shown), key=f"compare_times_{tag}")


def main() -> None:
    st.title("Plan")
    _session.sidebar()
    selected = _session.selected_plan()
    if selected is None:
        st.info(_session.PLAN_HINT)
        return
    _headline(selected)
    _layout(selected.plan)
    _compare(selected.plan)


main()
