"""Streamlit + plotly dashboard.

Will hold (issue: dashboard): pure view builders (DataFrames, plotly figures) and thin page
modules for the cluster, plan, memory headroom, throughput, profiles and what-if pages
(DESIGN.md §10). Nothing imports this package.
"""
