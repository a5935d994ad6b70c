"""Every warning in a runtime test is an error (issue 17: the runtime runs warning-free).

The mark goes first on each test here, so a test's own `filterwarnings` marks (or
`pytest.warns`) still decide for the warnings they name. Ranks that `distributed.run_distributed`
spawns take the test's filters with them; torchrun ranks get `PYTHONWARNINGS=error` from the
test that launches them (`test_warnings`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

RUNTIME_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the collected tests under this folder `filterwarnings("error")`."""
    for item in items:
        if item.path.is_relative_to(RUNTIME_TESTS):
            item.add_marker(pytest.mark.filterwarnings("error"), append=False)
