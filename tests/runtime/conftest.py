"""Every warning in a runtime test is an error (issue 17: the runtime runs warning-free).

The mark goes first on each test here, so a test's own `filterwarnings` marks (or
`pytest.warns`) still decide for the warnings they name. Ranks that `distributed.run_distributed`
spawns take the test's filters with them; torchrun ranks get `PYTHONWARNINGS=error` from the
test that launches them (`test_warnings`).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed import free_port

RUNTIME_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the collected tests under this folder `filterwarnings("error")`."""
    for item in items:
        if item.path.is_relative_to(RUNTIME_TESTS):
            item.add_marker(pytest.mark.filterwarnings("error"), append=False)


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group for a module's tests (CPHPAttention needs one)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
