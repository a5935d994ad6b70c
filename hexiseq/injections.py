"""Faults injected into a run to exercise re-planning on an emulated cluster (`hexiseq run
--inject-slowdown RANK:FACTOR@STEP`, `--inject-failure RANK@STEP`).

A slowdown makes rank RANK's device FACTOR times slower from step STEP on (its compute padded
by sleeping, as `emulation_slowdown` pads a CPU test device); a failure kills rank RANK's
process outright (SIGKILL: no exception, no goodbye, as a lost node) when step STEP begins.
Parsed here, in the core, because both the launcher (which carries them across re-plans, its
ranks numbered again) and the runtime (which applies them) read them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_INJECTED_SLOWDOWN = 100.0


@dataclass(frozen=True, order=True)
class SlowdownInjection:
    """Rank `rank`'s device `factor` times slower from step `step` on."""

    rank: int
    factor: float
    step: int

    def __str__(self) -> str:
        return f"{self.rank}:{self.factor:g}@{self.step}"


@dataclass(frozen=True, order=True)
class FailureInjection:
    """Rank `rank` killed when step `step` begins."""

    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.rank}@{self.step}"


def parse_slowdown(text: str) -> SlowdownInjection:
    """`RANK:FACTOR@STEP`; ValueError with what is allowed otherwise."""
    where, at, step = text.partition("@")
    rank, colon, factor = where.partition(":")
    if not (at and colon):
        raise ValueError(
            f"'{text}' is not RANK:FACTOR@STEP (e.g. 1:2@3: rank 1 2x slower from step 3)"
        )
    value = _number(factor, text)
    if not (math.isfinite(value) and 1.0 <= value <= MAX_INJECTED_SLOWDOWN):
        raise ValueError(
            f"'{text}': FACTOR must be a number in 1..{MAX_INJECTED_SLOWDOWN:g} (times slower)"
        )
    return SlowdownInjection(_whole(rank, "RANK", text), value, _whole(step, "STEP", text))


def parse_failure(text: str) -> FailureInjection:
    """`RANK@STEP`; ValueError with what is allowed otherwise."""
    rank, at, step = text.partition("@")
    if not at:
        raise ValueError(f"'{text}' is not RANK@STEP (e.g. 2@4: rank 2 lost when step 4 begins)")
    return FailureInjection(_whole(rank, "RANK", text), _whole(step, "STEP", text))


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` as an argparse type: its ValueError becomes the one-line usage error."""

    def parsed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parsed.__name__ = parse.__name__.removeprefix("parse_")
    return parsed


def add_injection_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--inject-slowdown` and `--inject-failure`, each repeatable (`hexiseq run` and the
    runtime's own command line take the same)."""
    parser.add_argument(
        "--inject-slowdown",
        type=argument_type(parse_slowdown),
        action="append",
        default=[],
        metavar="RANK:FACTOR@STEP",
        help=f"emulate rank RANK's device FACTOR (1..{MAX_INJECTED_SLOWDOWN:g}) times slower "
        "from step STEP on (CPU ranks: it sleeps)",
    )
    parser.add_argument(
        "--inject-failure",
        type=argument_type(parse_failure),
        action="append",
        default=[],
        metavar="RANK@STEP",
        help="kill rank RANK outright (SIGKILL, a lost device) when step STEP begins",
    )


def check_ranks(
    injections: Iterable[SlowdownInjection | FailureInjection], world_size: int
) -> str | None:
    """A message naming the first injection whose rank the run does not have, or None."""
    for injection in injections:
        if not 0 <= injection.rank < world_size:
            return (
                f"injection {injection}: the plan has ranks 0..{world_size - 1} "
                f"(got rank {injection.rank})"
            )
    return None


def _whole(text: str, name: str, whole: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"'{whole}': {name} must be a whole number >= 0 (got '{text}')")
    return int(text)


def _number(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"'{whole}': FACTOR must be a number (got '{text}')") from None
