"""The dashboard's entry point: `HEXISEQ_STORE_URL=URL streamlit run app.py` (what `hexiseq
dashboard` starts). Pages via `st.navigation`; each page draws the shared sidebar
(`_session.sidebar`)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

# The page scripts. Not pages/: Streamlit lists the files of a pages/ folder beside the entry
# script as navigation, file names and all, on a deep link's first load. (A comment, not a
# string: Streamlit's magic would print a bare string on every page.)
PAGES = Path(__file__).parent / "screens"


def main() -> None:
    st.set_page_config(page_title="hexiseq", layout="wide")
    navigation = st.navigation(
        [
            st.Page(PAGES / "plan.py", title="Plan", default=True),
            st.Page(PAGES / "cluster.py", title="Cluster"),
            st.Page(PAGES / "memory.py", title="Memory headroom"),
            st.Page(PAGES / "throughput.py", title="Throughput"),
            st.Page(PAGES / "profiles.py", title="Profiles"),
            st.Page(PAGES / "whatif.py", title="What-if"),
        ]
    )
    navigation.run()


main()
