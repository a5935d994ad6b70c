"""Streamlit pages: each file is run by `st.navigation`, lays out views and imports nothing
from other pages."""
