"""The X-LlamaSwap-Priority header: parsing edge cases and bands (scheduling/core/priority.py)."""

from __future__ import annotations

import pytest

from scheduling.core.priority import (
    BANDS,
    BATCH,
    HEADER,
    INTERACTIVE,
    NORMAL,
    band,
    parse_priority,
)


@pytest.mark.parametrize(("value", "expected"), [
    ("5", 5),
    ("-20", -20),
    (" +7 ", 7),
    ("\t+7\t", 7),
    ("007", 7),
    ("0", 0),
    ("-0", 0),
    ("103", 103),
])
def test_priority_signed_integers(value, expected):
    """A signed integer with optional surrounding spaces is taken as is: a stricter parser
    would drop `+7` or ` 5 ` (both common from shells) to 0 without telling anyone."""
    assert parse_priority(value) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("interactive", INTERACTIVE),
    ("Interactive", INTERACTIVE),
    ("INTERACTIVE", INTERACTIVE),
    ("normal", NORMAL),
    ("Normal", NORMAL),
    ("batch", BATCH),
    ("BATCH", BATCH),
    (" batch ", BATCH),
])
def test_priority_aliases_any_case(value, expected):
    """The aliases mean +100, 0, -100 in any case: `BATCH` parsed as 0 would put a batch
    job in the normal band, ahead of real batch work."""
    assert parse_priority(value) == expected
    assert (INTERACTIVE, NORMAL, BATCH) == (100, 0, -100)


@pytest.mark.parametrize("value", [
    "1e3", "5 5", "0x10", "1_000", "+ 7", "--5", "+-5", "5.0", "5.", ".5", "abc",
    "batchy", "inter active", "+", "-", "\u0665", "99999999999999999999", "9223372036854775808",
    "-9223372036854775809", "9" * 5000,
])
def test_priority_unparseable_is_zero(value):
    """Anything that is not a plain signed 64-bit integer or an alias means 0, not an error
    and not a partial parse (`1e3` read as 1, `0x10` as 0x10 = 16, a huge value crashing
    int() or overflowing a downstream int64 column)."""
    assert parse_priority(value) == 0


def test_priority_int64_bounds_are_accepted():
    """The int64 extremes are valid; one past them is not (an off-by-one would reject the
    documented range or accept values a 64-bit consumer cannot hold)."""
    assert parse_priority("9223372036854775807") == 2**63 - 1
    assert parse_priority("-9223372036854775808") == -(2**63)
    assert parse_priority("+9223372036854775807") == 2**63 - 1
    assert parse_priority("00009223372036854775807") == 2**63 - 1  # leading zeros are fine
    assert parse_priority("9223372036854775808") == 0
    assert parse_priority("-9223372036854775809") == 0


@pytest.mark.parametrize("value", [None, "", " ", "\t"])
def test_priority_absent_or_empty_is_zero(value):
    """No header (or an empty one) is the normal priority, never an error."""
    assert parse_priority(value) == 0


def test_priority_accepts_bytes():
    """ASGI hands header values as bytes: they must parse like the text (and never raise on
    non-ASCII bytes)."""
    assert parse_priority(b" +7 ") == 7
    assert parse_priority(b"-20") == -20
    assert parse_priority(b"Batch") == BATCH
    assert parse_priority(b"") == 0
    assert parse_priority(b"\xff\xfe") == 0
    assert parse_priority(bytearray(b"12")) == 12


def test_priority_is_not_clamped():
    """Callers compose band + offset themselves (interactive + 3 = 103); clamping to ±100
    would erase that offset."""
    assert parse_priority("103") == 103
    assert parse_priority("-250") == -250
    assert parse_priority("100000") == 100000


@pytest.mark.parametrize(("priority", "expected"), [
    (50, "interactive"), (49, "normal"), (-49, "normal"), (-50, "batch"),
    (0, "normal"), (100, "interactive"), (-100, "batch"), (2**63 - 1, "interactive"),
    (-(2**63), "batch"),
])
def test_priority_band_boundaries(priority, expected):
    """Bands: interactive at >= 50, batch at <= -50, else normal; an off-by-one at the
    boundaries would mislabel every `50` or `-50` request in metrics and the activity log."""
    assert band(priority) == expected


def test_priority_constants():
    """The names other modules import (the header name is matched lower-case in ASGI)."""
    assert HEADER == "x-llamaswap-priority"
    assert BANDS == ("interactive", "normal", "batch")
