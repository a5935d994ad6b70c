"""The step a plan is for as search options: sequences per step (`micro_batches`) and the
compute precision (`precision`), validated, planned, named in the study and kept apart there."""

from __future__ import annotations

import optuna
import pytest

from hexiseq import InputError
from hexiseq.search import plan_search
from hexiseq.search.options import search_options


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"micro_batches": 0}, "micro_batches"),
        ({"micro_batches": 2.5}, "micro_batches"),
        ({"micro_batches": 10**6}, "micro_batches"),
        ({"micro_batches": True}, "micro_batches"),
        ({"precision": "fp16"}, "precision"),
        ({"precision": 16}, "precision"),
    ],
)
def test_bad_step_options_are_one_input_error(keywords, message):
    with pytest.raises(InputError, match=message):
        search_options(**keywords)


def test_the_plan_is_for_the_precision_and_micro_batches_asked():
    one = plan_search("h100x8-a100x8", "llama3-8b", "64k").best
    assert (one.train.micro_batches, one.train.compute_dtype_bytes) == (1, 2)
    four = plan_search("h100x8-a100x8", "llama3-8b", "64k", micro_batches=4).best
    assert four.train.micro_batches == 4
    # Four sequences one after another: about four steps' work, the optimizer once.
    assert 3.5 < four.predicted.step_time_s / one.predicted.step_time_s < 4.05
    assert four.predicted.tokens_per_s >= 0.95 * one.predicted.tokens_per_s
    fp32 = plan_search("h100x8-a100x8", "llama3-8b", "64k", precision="fp32").best
    assert fp32.train.compute_dtype_bytes == 4
    assert fp32.predicted.step_time_s > one.predicted.step_time_s
    cpu = plan_search("cpu-emulated-2type", "tiny", 512).best
    bf16 = plan_search("cpu-emulated-2type", "tiny", 512, precision="bf16").best
    assert (cpu.train.compute_dtype_bytes, bf16.train.compute_dtype_bytes) == (4, 2)


def test_a_stored_study_is_not_reused_for_another_step(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=3, storage=url, study_name="s")
    with pytest.raises(InputError, match=r"scored for another step \(micro_batches 1 \(now 2\)"):
        plan_search("cpu-emulated-2type", "tiny", 512, n_trials=3, storage=url,
                    study_name="s", micro_batches=2)  # fmt: skip
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=4, storage=url, study_name="s")
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=2, storage=url, micro_batches=2)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage=url)}
    assert names == {"s", "cpu-emulated-2type/tiny/512/throughput/2-micro-batches"}
