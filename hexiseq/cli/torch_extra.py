"""The commands that need torch (`run`, `profile`) say how to install it when it is missing,
in one line, instead of failing on an import deep inside (or inside torchrun's ranks)."""

from __future__ import annotations

import importlib.util

from hexiseq.errors import InputError

TORCH_EXTRA = "runtime"
"""The extra of pyproject.toml that brings torch."""
INSTALL_HINT = (
    f"pip install 'hexiseq[{TORCH_EXTRA}]' (in a checkout: pip install -e '.[{TORCH_EXTRA}]')"
)


def torch_installed() -> bool:
    """Whether `import torch` can find torch (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def require_torch(command: str) -> None:
    """InputError (exit 2, one line) naming the extra to install when torch is missing."""
    if not torch_installed():
        raise InputError(f"{command} needs torch, which is not installed: {INSTALL_HINT}")
