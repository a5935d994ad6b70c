"""Injected faults: `RANK:FACTOR@STEP` slowdowns and `RANK@STEP` failures."""

from __future__ import annotations

import pytest

from hexiseq.injections import (
    FailureInjection,
    SlowdownInjection,
    check_ranks,
    parse_failure,
    parse_slowdown,
)


def test_parse_and_print_round_trip():
    assert parse_slowdown("1:2.5@3") == SlowdownInjection(1, 2.5, 3)
    assert parse_failure("2@4") == FailureInjection(2, 4)
    assert str(parse_slowdown("1:2@3")) == "1:2@3"
    assert parse_failure(str(FailureInjection(0, 7))) == FailureInjection(0, 7)


@pytest.mark.parametrize(
    "text, message",
    [
        ("1:2", "is not RANK:FACTOR@STEP"),
        ("1@3", "is not RANK:FACTOR@STEP"),
        ("x:2@3", "RANK must be a whole number"),
        ("1:2@-3", "STEP must be a whole number"),
        ("1:fast@3", "FACTOR must be a number"),
        ("1:0.5@3", "FACTOR must be a number in 1..100"),
        ("1:inf@3", "FACTOR must be a number in 1..100"),
        ("1:nan@3", "FACTOR must be a number in 1..100"),
    ],
)
def test_bad_slowdowns(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slowdown(text)


@pytest.mark.parametrize("text", ["2", "a@1", "1@", "@3", "1.5@2"])
def test_bad_failures(text):
    with pytest.raises(ValueError, match="RANK@STEP|whole number"):
        parse_failure(text)


def test_check_ranks_names_the_injection():
    assert check_ranks([FailureInjection(3, 1)], 4) is None
    assert check_ranks([], 4) is None
    message = check_ranks([SlowdownInjection(4, 2.0, 0)], 4)
    assert message == "injection 4:2@0: the plan has ranks 0..3 (got rank 4)"
