"""Property: whatever plan_search is given, it returns a plan or raises one InputError /
InfeasibleError, never anything else (issue 17's boundary, over the search's entry point)."""

from __future__ import annotations

import math
import signal
from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hexiseq import InfeasibleError, Plan
from hexiseq.errors import InputError
from hexiseq.search import plan_search

WRONG_TYPES = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.floats(allow_nan=True, allow_infinity=True),
)
OPTIONS = {
    "seed": st.one_of(st.integers(-(2**40), 2**40), WRONG_TYPES),
    "n_trials": st.one_of(st.integers(-3, 6), WRONG_TYPES),
    "time_budget_s": st.one_of(
        st.floats(min_value=-1.0, max_value=0.3), st.just(math.inf), st.just(math.nan), WRONG_TYPES
    ),
    "workers": st.one_of(st.integers(-2, 3), WRONG_TYPES),
    "multi_objective": st.one_of(st.booleans(), WRONG_TYPES),
    "activation_checkpointing": st.one_of(st.none(), st.booleans(), WRONG_TYPES),
    "study_name": st.one_of(st.text(max_size=4), WRONG_TYPES),
    "show_progress": st.one_of(st.just(False), WRONG_TYPES),
    "cost_model": WRONG_TYPES,
    "bogus_option": st.integers(),
}
SEQ_LENS = st.one_of(
    st.sampled_from([8192, "8k", "16K", 3, 8193, 0, -8, 10**20, "1e3", "", "8 k", 2.5, True]),
    st.integers(-10, 20000),
    st.text(max_size=5),
)


EXAMPLE_LIMIT_S = 60  # examples take well under a second; a hang fails with its input


@contextmanager
def time_limit(seconds: int):
    """Raise TimeoutError in the main thread after `seconds`: a hung search then fails as an
    example Hypothesis reports (input and the stack where it hung), not a stalled CI run."""

    def expire(signum, frame):
        raise TimeoutError(f"plan_search ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=OPTIONS), SEQ_LENS)
def test_plan_search_gives_a_plan_or_one_clear_error(options, seq_len):
    try:
        with time_limit(EXAMPLE_LIMIT_S):
            result = plan_search("cpu-emulated-2type", "tiny", seq_len, **options)
    except (InputError, InfeasibleError) as error:
        assert str(error) and "\n" not in str(error).strip()
        return
    except TypeError as error:  # only an unknown keyword may get here, as Python says
        assert "bogus_option" in str(error)
        return
    assert isinstance(result.best, Plan)
    assert result.best.predicted.tokens_per_s > 0
