"""The drift monitor: every rank's compute against the plan's prediction, step by step."""

from __future__ import annotations

import pytest

from hexiseq.runtime._drift import BASELINE_STEPS, PATIENCE, DriftMonitor

PREDICTED = [1.0, 2.0, 4.0]


def feed(monitor, rows, first_step=0):
    """Observe each row of measured seconds; the drifts reported, by step."""
    return {
        step: drift
        for step, row in enumerate(rows, start=first_step)
        if (drift := monitor.observe(step, row)) is not None
    }


def test_a_rank_slower_for_patience_steps_is_reported_by_its_factor():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    start = [[9.0, 9.0, 9.0]] + [[1.5, 3.2, 5.0]] * BASELINE_STEPS  # warm-up, then the base
    slow = [[1.5 * 2, 3.2, 5.0]] * PATIENCE
    reports = feed(monitor, start + slow)
    step = len(start) + PATIENCE - 1
    assert list(reports) == [step]
    assert reports[step].factors == {0: pytest.approx(2.0)}
    assert reports[step].drift == pytest.approx((2.0, 1.0, 1.0))
    assert "rank 0 2.00x slower" in reports[step].describe()


def test_one_slow_step_is_noise_and_the_band_holds():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    base = [1.0, 2.0, 4.0]
    rows = [base] * (1 + BASELINE_STEPS) + [[2.0, 2.0, 4.0], base, [1.25, 2.5, 3.2]] * 3
    assert feed(monitor, rows) == {}


def test_a_rank_measured_slow_before_is_reported_when_it_recovers():
    monitor = DriftMonitor(PREDICTED, [False, True, False], threshold=1.3)
    rows = [[1.0, 4.0, 4.0]] * (1 + BASELINE_STEPS) + [[1.0, 2.0, 4.0]] * PATIENCE
    reports = feed(monitor, rows)
    assert [r.factors for r in reports.values()] == [{1: pytest.approx(0.5)}]
    # a rank never measured slow that gets faster moves nothing
    other = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    assert feed(other, rows) == {}


def test_rebase_takes_present_speeds_as_the_start():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    rows = [[1.0, 2.0, 4.0]] * (1 + BASELINE_STEPS) + [[3.0, 2.0, 4.0]] * PATIENCE
    assert len(feed(monitor, rows)) == 1
    monitor.rebase()
    assert feed(monitor, [[3.0, 2.0, 4.0]] * 4, first_step=len(rows)) == {}


@pytest.mark.parametrize(
    "predicted, slowed, threshold, message",
    [
        ([1.0, 0.0], [False, False], 1.3, "predicted compute must be > 0"),
        ([1.0], [False, False], 1.3, "one prediction and one slowed flag per rank"),
        ([1.0], [False], 1.0, "threshold must be > 1"),
    ],
)
def test_bad_monitors(predicted, slowed, threshold, message):
    with pytest.raises(ValueError, match=message):
        DriftMonitor(predicted, slowed, threshold)


class FakeEvent:
    """A CUDA event stand-in: `record` reads a clock the test moves."""

    clock_ms = 0.0

    def record(self) -> None:
        self.at_ms = FakeEvent.clock_ms

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at_ms - self.at_ms


def test_gpu_phases_time_the_union_of_phases_minus_the_waits_inside():
    import torch

    from hexiseq.runtime._emulation import ComputePadding, GpuPhases, communication_phase

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    padding = ComputePadding(model, 1.0, timed=True, gpu=GpuPhases(event=FakeEvent))
    try:
        FakeEvent.clock_ms = 0.0
        padding._start()  # two overlapping phases: one union of 10 ms
        FakeEvent.clock_ms = 4.0
        padding._start()
        with communication_phase():  # the stream waited 3 ms on a collective
            FakeEvent.clock_ms = 7.0
        FakeEvent.clock_ms = 8.0
        padding._end()
        FakeEvent.clock_ms = 10.0
        padding._end()
        FakeEvent.clock_ms = 50.0  # not in a phase
        padding._start()
        FakeEvent.clock_ms = 52.0
        padding._end()
        assert padding.device_s == 0.0  # nothing read before the step has finished
        padding.settle()
        assert padding.device_s == pytest.approx((10 - 3 + 2) / 1e3)
        padding.settle()  # read once
        assert padding.device_s == pytest.approx(9e-3)
    finally:
        padding.remove()


def test_every_rank_slower_alike_moves_no_work():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    rows = [[1.0, 2.0, 4.0]] * (1 + BASELINE_STEPS) + [[2.0, 4.0, 8.0]] * (PATIENCE + 2)
    assert feed(monitor, rows) == {}


def test_one_fast_start_step_is_not_the_start():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    start = [[9.0, 9.0, 9.0], [1.0, 2.0, 4.0], [0.5, 2.0, 4.0], [1.0, 2.0, 4.0]]
    assert feed(monitor, start + [[1.0, 2.0, 4.0]] * (PATIENCE + 2)) == {}


def test_the_last_drift_of_every_rank_is_kept_for_the_step_log():
    monitor = DriftMonitor(PREDICTED, [False] * 3, threshold=1.3)
    feed(monitor, [[1.0, 2.0, 4.0]] * (1 + BASELINE_STEPS))
    assert monitor.last_drift is None  # no baseline before these steps are in
    feed(monitor, [[1.2, 2.0, 4.0]], first_step=1 + BASELINE_STEPS)
    assert monitor.last_drift == pytest.approx((1.2, 1.0, 1.0))
    monitor.rebase()
    assert monitor.last_drift is None
