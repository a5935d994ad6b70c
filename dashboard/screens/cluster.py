"""Cluster page: devices by node and type, the link-bandwidth heatmap, the plan's ring order."""

from __future__ import annotations

import streamlit as st

from hexiseq.dashboard import _session
from hexiseq.dashboard.views import cluster as views


def main() -> None:
    st.title("Cluster")
    _session.sidebar()
    selected = _session.selected_plan()
    if selected is None:
        st.info(_session.PLAN_HINT)
        return
    plan = selected.plan
    cluster = plan.cluster
    _session.caption_prediction_source(plan)
    st.caption(f"{cluster.name}: {cluster.world_size} devices on {len(cluster.nodes)} node(s)")
    st.subheader("Nodes")
    st.dataframe(views.nodes_frame(cluster), hide_index=True)
    heatmap, ring = st.columns(2)
    heatmap.plotly_chart(views.link_heatmap_figure(cluster), key="links")
    ring.plotly_chart(views.ring_order_figure(plan), key="ring")
    st.subheader(f"Ring order of {plan.name}")
    st.dataframe(views.ring_hops_frame(plan), hide_index=True)
    with st.expander("Devices"):
        st.dataframe(views.devices_frame(cluster), hide_index=True)


main()
