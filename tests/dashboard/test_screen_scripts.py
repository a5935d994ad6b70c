"""The Streamlit scripts hold no bare string but their docstring: Streamlit's magic prints any
other string expression on the page (two notes meant for readers showed on every page)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).parents[2] / "dashboard"
SCRIPTS = [DASHBOARD / "app.py", *sorted((DASHBOARD / "screens").glob("*.py"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_no_module_level_string_but_the_docstring(script):
    body = ast.parse(script.read_text()).body
    strings = [
        node.lineno
        for index, node in enumerate(body)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        and index > 0
    ]
    assert strings == [], f"{script.name}: bare strings at lines {strings} would be printed"
