"""Parsing quantities users type: sequence lengths like 128k or 1M."""

from __future__ import annotations

import re

from hexiseq.errors import InputError

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_PATTERN = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


MAX_SEQ_LEN = 2**27
"""128M tokens: far beyond any model's context today, and small enough that every count the
planner derives from it stays a machine integer."""


def parse_seq_len(text: str | int) -> int:
    """Tokens in a sequence: `131072`, `128k` (= 131072) or `1M` (= 1048576).

    `k` and `M` are binary (1024, 1024²), as sequence lengths are quoted in the field.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise InputError(
            f"--seq-len {text!r} is not a length; allowed: a whole number of tokens "
            "(131072) or one with k/M (128k, 1M)"
        )
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.match(text)
        if not match:
            raise InputError(
                f"--seq-len {text!r} is not a length; allowed: a whole number of tokens "
                "(131072) or one with k/M (128k, 1M)"
            )
        value = int(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 2:
        raise InputError(f"--seq-len must be at least 2 tokens (got {value})")
    if value > MAX_SEQ_LEN:
        raise InputError(
            f"--seq-len {value:,} is beyond the longest sequence hexiseq plans "
            f"({MAX_SEQ_LEN:,} tokens, {format_tokens(MAX_SEQ_LEN)})"
        )
    return value


def format_tokens(count: int) -> str:
    """`524288` -> `512K`, `1048576` -> `1M`, else the number."""
    for unit, size in (("M", 1024**2), ("K", 1024)):
        if count % size == 0 and count >= size:
            return f"{count // size}{unit}"
    return str(count)
