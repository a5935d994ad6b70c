"""Errors that hexiseq raises on purpose; each carries a one-line message for the user."""

from __future__ import annotations


class HexiseqError(Exception):
    """Base class: an error whose message is meant for the user as it is (no traceback)."""


class InputError(HexiseqError, ValueError):
    """Bad user input: a file, a field or an argument that is not allowed. Says what is allowed."""


class InfeasibleError(HexiseqError):
    """No plan fits in memory.

    `missing_bytes` maps a rank to how many bytes it lacks under the 95 % memory limit in the
    least-bad plan tried; the message says the total and where.
    """

    def __init__(self, message: str, missing_bytes: dict[int, int] | None = None) -> None:
        super().__init__(message)
        self.missing_bytes = dict(missing_bytes or {})


class StoreError(HexiseqError):
    """The store could not do what was asked of a valid request: the disk is full, the file
    read-only or locked, the server gone. Names the store; nothing of the failed write stays."""
