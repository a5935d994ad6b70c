"""Pure view builders of the dashboard: plans, records and DataFrames in, plotly figures and
pandas DataFrames out. No Streamlit, no store, no I/O: the pages lay these out, the tests call
them directly."""
