"""Tests of hexiseq.units: sequence lengths as users type them."""

from __future__ import annotations

import pytest

from hexiseq import InputError, parse_seq_len
from hexiseq.units import format_tokens


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        (131072, 131072),
        ("131072", 131072),
        ("128k", 131072),
        ("128K", 131072),
        ("1M", 1048576),
        ("1m", 1048576),
        (" 512k ", 524288),
        ("\t4k\n", 4096),
        ("2", 2),
        (2, 2),
    ],
)
def test_parse_seq_len_accepts(text, tokens):
    value = parse_seq_len(text)
    assert value == tokens
    assert type(value) is int


@pytest.mark.parametrize(
    "text", ["", "   ", "abc", "1.5M", "-5", "1G", "k", "12kk", "1e6", "0x10"]
)
def test_parse_seq_len_rejects_non_lengths_saying_what_is_allowed(text):
    with pytest.raises(
        InputError, match=r"is not a length; allowed: a whole number of tokens .*128k, 1M"
    ) as info:
        parse_seq_len(text)
    assert str(info.value).startswith(f"--seq-len '{text}' is not a length")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["1", "0", "0k", 1, 0, -5])
def test_parse_seq_len_rejects_lengths_below_two(value):
    with pytest.raises(InputError, match=r"--seq-len must be at least 2 tokens \(got -?\d+\)"):
        parse_seq_len(value)


def test_parse_seq_len_errors_are_value_errors():
    # InputError is a ValueError, so callers that catch ValueError still see bad lengths.
    with pytest.raises(ValueError):
        parse_seq_len("lots")


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (524288, "512K"),
        (131072, "128K"),
        (1048576, "1M"),
        (3 * 1024**2, "3M"),
        (1024, "1K"),
        (1536 * 1024, "1536K"),  # not a whole number of M
        (1536, "1536"),  # not a whole number of K
        (1000, "1000"),  # decimal thousands are not K
        (4097, "4097"),
        (1, "1"),
    ],
)
def test_format_tokens(count, text):
    assert format_tokens(count) == text


@pytest.mark.parametrize("count", [2, 4096, 65536, 131072, 1048576, 1536 * 1024, 12345])
def test_format_tokens_round_trips_through_parse(count):
    assert parse_seq_len(format_tokens(count)) == count


@pytest.mark.parametrize("text", ["\n", "1\n2", "1k\r\nx"])
def test_parse_seq_len_names_a_text_with_line_breaks_on_one_line(text):
    with pytest.raises(InputError) as info:
        parse_seq_len(text)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message
    assert message.startswith(f"--seq-len {text!r} is not a length")
