"""The study loop's sampling (`search.sampling`): a stored study is sampled on an in-memory
mirror and each finished trial written once; workers score what this process samples."""

from __future__ import annotations

import optuna
import pytest

from hexiseq.plan import Plan
from hexiseq.search import plan_search, sampling

CASE = ("h100x8-a100x8", "llama3-8b", "256k")


def _sampled(result) -> list[dict]:
    """The params of the search's study trials, in order (the polish's come after them, the
    baselines' have none)."""
    return [t.params for t in result.trials if t.params]


def test_a_stored_search_samples_the_same_trials_as_one_in_memory(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    in_memory = plan_search(*CASE, n_trials=24, seed=5)
    stored = plan_search(*CASE, n_trials=24, seed=5, storage=url)
    study = optuna.load_study(study_name=stored.study_name, storage=url)
    assert [t.params for t in study.trials] == _sampled(in_memory)[:24]
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}
    assert stored.best.predicted.tokens_per_s == in_memory.best.predicted.tokens_per_s


def test_each_sampled_trial_is_written_once_marked_as_this_search(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search(*CASE, n_trials=4, storage=url, study_name="s")  # the short list, stored
    plan_search(*CASE, n_trials=6, storage=url, study_name="s")
    study = optuna.load_study(study_name="s", storage=url)
    writers = [t.system_attrs.get(sampling.WRITER_ATTR) for t in study.trials]
    assert writers[:4] == [None] * 4  # the short list is added whole, not sampled
    assert len(writers) == 10 and len(set(writers[4:])) == 1 and writers[4] is not None


def _trial(value: float, x: int) -> optuna.trial.FrozenTrial:
    distribution = optuna.distributions.CategoricalDistribution([1, 2, 3, 4])
    return optuna.trial.create_trial(params={"x": x}, distributions={"x": distribution},
                                     values=[value])  # fmt: skip


def test_the_mirror_takes_in_what_other_processes_finished_but_not_its_own(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    stored = optuna.create_study(storage=url, study_name="m", direction="maximize")
    stored.add_trial(_trial(1.0, 1))
    mirror = sampling._Mirror.of(stored)
    assert [t.value for t in mirror.memory.trials] == [1.0]
    own = mirror.memory.ask()
    own.suggest_categorical("x", [1, 2, 3, 4])
    mirror.finished(mirror.memory, mirror.memory.tell(own, 2.0))  # written to the storage
    other = optuna.load_study(study_name="m", storage=url)  # another process's handle
    other.add_trial(_trial(3.0, 3))
    mirror.take_in()
    mirror.take_in()  # twice: nothing is copied twice
    assert sorted(t.value for t in mirror.memory.trials) == [1.0, 2.0, 3.0]
    assert sorted(t.value for t in stored.trials) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("stored", [True, False], ids=["stored", "in-memory"])
def test_workers_score_exactly_the_trials_asked(tmp_path, stored, monkeypatch):
    sampled = []
    with_workers = sampling._sample_with_workers

    def keeping_the_study(study, *args):
        sampled.append(study)  # the mirror, or the study in memory
        return with_workers(study, *args)

    monkeypatch.setattr(sampling, "_sample_with_workers", keeping_the_study)
    url = f"sqlite:///{tmp_path / 'study.db'}" if stored else None
    result = plan_search(*CASE, n_trials=16, workers=2, seed=3, storage=url)
    assert isinstance(result.best, Plan)
    (study,) = sampled
    if stored:
        study = optuna.load_study(study_name=result.study_name, storage=url)
    assert len(study.trials) == 16  # the short list, then the trials sampled: exactly
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}


def test_a_write_failing_with_workers_is_one_store_error(tmp_path, monkeypatch):
    """The writer thread's failure surfaces at the next trial as the storage's one line."""
    from sqlalchemy.exc import OperationalError

    from hexiseq.errors import StoreError

    url = f"sqlite:///{tmp_path / 'study.db'}"
    plan_search(*CASE, n_trials=4, storage=url, study_name="s")

    def refused(*_args, **_kwargs):
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    monkeypatch.setattr(optuna.storages.RDBStorage, "_create_new_trial", refused)
    with pytest.raises(StoreError) as caught:
        plan_search(*CASE, n_trials=12, storage=url, study_name="s", workers=2)
    assert "disk I/O error" in str(caught.value) and "\n" not in str(caught.value)


def test_a_choice_is_scored_once_however_often_it_is_sampled(monkeypatch):
    """Trials repeating a choice (TPE does, on a small space) are told the first one's
    score: the workers are sent each distinct choice once."""
    sent = []
    submit = sampling.ProcessPoolExecutor.submit

    def counting(pool, function, *args):
        if function is sampling._score:
            sent.append(tuple(sorted(args[0].items())))
        return submit(pool, function, *args)

    monkeypatch.setattr(sampling.ProcessPoolExecutor, "submit", counting)
    result = plan_search("cpu-emulated-2type", "tiny", 8192, n_trials=30, workers=2, seed=1)
    study_trials = [t.params for t in result.trials if t.params][:30]
    distinct = {tuple(sorted(p.items())) for p in study_trials}
    assert len(sent) == len(set(sent))
    assert len(distinct) < len(study_trials)  # the case repeats choices: the test has teeth
    assert set(sent) <= distinct


class _Queue:
    """Trials 0..count-1: 0 and 2 wait for a worker; 1 and every one from 3 on repeat a
    choice scored already, so ask() tells them at once, the last ones with no worker busy."""

    def __init__(self) -> None:
        self.asked, self.told, self.running = 0, 0, 0

    @property
    def busy(self) -> int:
        return self.running

    def ask(self) -> None:
        if self.asked not in (0, 2):
            self.told += 1
        else:
            self.running += 1
        self.asked += 1

    def tell_finished(self) -> None:
        self.told += self.running
        self.running = 0


class _Bar:
    def __init__(self) -> None:
        self.shown = []

    def show(self, told: int) -> None:
        self.shown.append(told)


def test_the_bar_ends_at_the_count_when_the_last_trial_was_told_at_once():
    queue, bar = _Queue(), _Bar()
    sampling._ask_and_tell(queue, 2, 7, None, bar)
    assert queue.asked == queue.told == 7
    assert bar.shown[-1] == 7
