"""The Streamlit dashboard (docs/design.md §10), started by `hexiseq dashboard`.

`views/`: pure builders (plans, records and DataFrames in; plotly figures and DataFrames out),
tested directly. `app.py` + `screens/`: thin Streamlit pages that lay the views out; `_session`
holds what the pages share (store, selected plan, what-if result). `screenshots.py` drives the
live app with headless Chromium. Nothing imports this package; it never imports the runtime.
"""
