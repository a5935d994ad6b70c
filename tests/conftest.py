"""Shared test helpers live beside this file (`cli_runner`); pytest puts this folder on
sys.path because it holds a conftest."""
