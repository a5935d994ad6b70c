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


PAGE_TABLE = (
    ("plan.py", "Plan", "plan"),
    ("cluster.py", "Cluster", "cluster"),
    ("memory.py", "Memory headroom", "memory"),
    ("throughput.py", "Throughput", "throughput"),
    ("profiles.py", "Profiles", "profiles"),
    ("whatif.py", "What-if", "whatif"),
)
# Script, navigation title, URL path: each explicit, so what a deep link shows and where it
# leads never depend on file names. The first page is the default (served at /).


def main() -> None:
    st.set_page_config(page_title="hexiseq", layout="wide")
    pages = [
        st.Page(PAGES / script, title=title, url_path=url_path, default=index == 0)
        for index, (script, title, url_path) in enumerate(PAGE_TABLE)
    ]
    st.navigation(pages).run()


main()
