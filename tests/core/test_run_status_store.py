"""The store's record of how runtime runs end: `end_runtime_run` and `fail_unended_runs`."""

from __future__ import annotations

import pytest

from hexiseq.errors import InputError
from hexiseq.store import Store


def _start(store: Store, launch_id: str | None = None) -> int:
    return store.save_runtime_run(
        '{"name": "p"}',
        plan_hash="abc",
        plan_name="p",
        model_name="tiny",
        seq_len=64,
        world_size=2,
        steps=2,
        backend="gloo",
        device="cpu",
        dtype="float32",
        emulation=False,
        torch_version="2.13.0",
        launch_id=launch_id,
    )


def _status(store: Store, run_id: int) -> tuple[object, object]:
    (run,) = [run for run in store.list_runtime_runs() if run["id"] == run_id]
    return run["status"], run["failure"]


def test_a_run_is_running_until_it_ends_and_keeps_its_first_ending(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = _start(store)
        assert _status(store, run_id) == ("running", None)
        store.end_runtime_run(run_id, "failed", "RuntimeError: gloo\nconnection   closed")
        assert _status(store, run_id) == ("failed", "RuntimeError: gloo connection closed")
        store.end_runtime_run(run_id, "finished")  # too late: it failed first
        assert _status(store, run_id) == ("failed", "RuntimeError: gloo connection closed")
        assert store.list_runtime_runs()[0]["finished_at"] is not None


@pytest.mark.parametrize(
    ("status", "failure", "message"),
    [
        ("done", None, "a run ends finished, replanned, failed, not 'done'"),
        ("failed", None, "a failed run needs its failure"),
        ("finished", "why", "a finished one has none"),
    ],
)
def test_an_ending_that_is_not_one_is_refused(tmp_path, status, failure, message):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        run_id = _start(store)
        with pytest.raises(InputError, match=message):
            store.end_runtime_run(run_id, status, failure)
        with pytest.raises(InputError, match="has no runtime run 99"):
            store.end_runtime_run(99, "finished")
        assert _status(store, run_id) == ("running", None)


def test_only_the_launchs_runs_still_running_are_failed(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        ended, unended, other = _start(store, "a"), _start(store, "a"), _start(store, "b")
        store.end_runtime_run(ended, "finished")
        assert store.fail_unended_runs("a", "torchrun exited with code 1") == 1
        assert _status(store, ended) == ("finished", None)
        assert _status(store, unended) == ("failed", "torchrun exited with code 1")
        assert _status(store, other) == ("running", None)
