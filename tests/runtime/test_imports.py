"""Tier 0: the runtime's import rules (docs/design.md §1): core and torch only (transformers in
the Hugging Face adapter, when it is applied); torch stays lazy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
FORBIDDEN = ("hexiseq.search", "hexiseq.costmodel", "hexiseq.dashboard", "hexiseq.profiler")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_imports_only_the_core_and_torch():
    files = sorted(RUNTIME.glob("*.py"))
    assert files
    for path in files:
        for name in imported_modules(path):
            assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"
            top = name.split(".")[0]
            allowed = {"hexiseq", "torch", "__future__"} | (
                {"transformers"} if path.name == "hf.py" else set()
            )
            assert top in allowed or top in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_the_hugging_face_adapter_imports_transformers_only_when_applied():
    code = "import sys, hexiseq.runtime.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_hexiseq_does_not_import_torch_but_exports_cphpattention_lazily():
    code = (
        "import sys, hexiseq; assert 'torch' not in sys.modules; "
        "from hexiseq import CPHPAttention; from hexiseq.runtime import CPHPAttention as C; "
        "assert CPHPAttention is C"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
