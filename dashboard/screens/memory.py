"""Memory headroom page: used vs capacity per device by term, the 95 % limit, and what the
baselines would need."""

from __future__ import annotations

import streamlit as st

from hexiseq.dashboard import _session
from hexiseq.dashboard.views import memory as views


def main() -> None:
    st.title("Memory headroom")
    _session.sidebar()
    selected = _session.selected_plan()
    if selected is None:
        st.info(_session.PLAN_HINT)
        return
    plan = selected.plan
    _session.caption_prediction_source(plan)
    st.plotly_chart(views.memory_figure(plan), key="memory")
    st.dataframe(views.memory_frame(plan).round(3), hide_index=True)
    st.subheader("Plan vs baselines")
    if not selected.baselines:
        st.info("No baselines for this plan (none saved and none could be scored).")
        return
    st.plotly_chart(views.baseline_memory_figure(plan, selected.baselines), key="baselines")
    frame = views.baseline_memory_frame(plan, selected.baselines)
    short = frame[frame["status"] != "fits"].drop_duplicates("candidate")
    for row in short.itertuples():
        st.warning(f"{row.candidate}: {row.reason}")


main()
