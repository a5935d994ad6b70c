"""`SearchOptions`: plan_search's knobs in one validated object, keywords still accepted."""

from __future__ import annotations

import pytest

from hexiseq.errors import InputError
from hexiseq.search import SearchOptions, plan_search
from hexiseq.search.options import search_options


def test_options_object_and_keywords_give_the_same_search():
    by_keywords = plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=6, seed=2)
    by_object = plan_search(
        "cpu-emulated-2type", "tiny", 8192, options=SearchOptions(n_trials=6, seed=2)
    )
    assert by_keywords.best == by_object.best
    assert [t.params for t in by_keywords.trials] == [t.params for t in by_object.trials]


def test_options_and_keywords_together_are_refused():
    with pytest.raises(InputError, match="either options= or option keywords"):
        plan_search("cpu-emulated-2type", "tiny", 8192, options=SearchOptions(), seed=3)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"time_budget_s": 0}, r"time budget must be positive seconds \(got 0\)"),
        ({"time_budget_s": float("nan")}, "time budget must be positive seconds"),
        ({"n_trials": 0}, r"n_trials must be at least 1 \(got 0\)"),
        ({"workers": 0}, r"workers must be from 1 to 256 \(got 0\)"),
        ({"workers": 10**6}, r"workers must be from 1 to 256 \(got 1000000\)"),
        ({"cost_model": "datasheet"}, "cost_model must be a hexiseq cost model"),
        ({"study_name": ""}, "study name must not be empty"),
        ({"seed": "seven"}, "search option seed"),
        ({"trials": 5}, "plan_search has no option 'trials'; options: time_budget_s"),
    ],
)
def test_bad_options_get_one_clear_message(keywords, message):
    with pytest.raises(InputError, match=message):
        search_options(**keywords)


def test_a_bad_storage_url_is_one_line_with_its_password_masked():
    with pytest.raises(InputError) as caught:
        search_options(storage="postgresql://me:hunter2@host:notaport/db")
    assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value)


def test_checkpointing_options_follow_the_setting():
    assert SearchOptions().checkpointing_options == (False, True)
    assert SearchOptions(activation_checkpointing=True).checkpointing_options == (True,)
    assert not SearchOptions().searching and SearchOptions(n_trials=3).searching


def test_a_cluster_beyond_the_planner_is_refused_up_front(monkeypatch):
    from hexiseq import Cluster
    from hexiseq.search.api import MAX_PLANNED_DEVICES

    huge = Cluster.from_dict(
        {
            "name": "huge",
            "nodes": [{"name": f"n{i}", "gpu": "H100-SXM", "count": 8} for i in range(12500)],
            "network": {"inter_node_GBps": 50},
        }
    )
    import hexiseq.search.api as api

    def no_planning(*args, **kwargs):
        raise AssertionError("the search started")

    monkeypatch.setattr(api, "all_baselines", no_planning)
    with pytest.raises(InputError, match=f"at most {MAX_PLANNED_DEVICES:,}"):
        plan_search(huge, "llama3-8b", "1M")
