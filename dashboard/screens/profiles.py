"""Profiles page: measurements vs fitted curves per device and op, residuals, held-out error."""

from __future__ import annotations

import streamlit as st

from hexiseq.costmodel import FittedCostModel, RuntimeSource, memory_points
from hexiseq.dashboard import _session
from hexiseq.dashboard.views import profiles as views
from hexiseq.errors import HexiseqError

PROFILE_HINT = (
    "No profiles yet — run `hexiseq profile --device cpu --quick`, then `hexiseq fit` "
    "(both with `--store <this store's URL>`)."
)
FIT_HINT = "No fitted model in the store yet — run `hexiseq fit` to fit these measurements."


def _document():
    text = _session.store().latest_fitted_model()
    if text is None:
        st.info(FIT_HINT)
        return None
    try:
        return FittedCostModel.from_json(text, "stored fitted model").document
    except HexiseqError as error:
        st.error(str(error))
        return None


def main() -> None:
    st.title("Profiles")
    _session.sidebar()
    measurements = _session.store().profile_measurements()
    if not measurements:
        st.info(PROFILE_HINT)
        return
    document = _document()
    frame = views.profile_frame(measurements, document)
    families = list(dict.fromkeys(frame["family"]))
    family = st.selectbox("Device type and op", families, key="profile_family")
    left, right = st.columns(2)
    left.plotly_chart(views.profile_figure(frame, family), key="profile_fit")
    right.plotly_chart(views.residuals_figure(frame, family), key="profile_residuals")
    failed = frame[(frame["family"] == family) & (frame["status"] != "ok")]
    if len(failed):
        st.caption(f"{len(failed)} point(s) failed (OOM or error) and are not fitted.")
    if document is not None:
        st.subheader("Held-out error of every fit")
        st.dataframe(views.heldout_frame(document).round(2), hide_index=True)
        st.caption(f"fitted {document.created_at}; loss: {document.loss}")
        for skipped in document.skipped:
            st.caption(f"not fitted: {skipped.what} ({skipped.reason})")
    _memory_calibration(document)


def _memory_calibration(document) -> None:
    """Measured peaks of `hexiseq run` against the memory model, and its calibration."""
    sources = [RuntimeSource(*run) for run in _session.store().runtime_peaks()]
    points = memory_points(sources)
    if not points:
        return
    st.subheader("Memory calibration")
    fits = document.memory if document is not None else ()
    for device_type in dict.fromkeys(p.device_type for p in points):
        figure = views.memory_calibration_figure(points, fits, device_type)
        st.plotly_chart(figure, key=f"memory_calibration_{device_type}")
    if not fits:
        st.caption("Not calibrated yet — `hexiseq fit` calibrates the model by these peaks.")


main()
