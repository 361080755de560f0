"""Values in messages and as llama-swap writes them: key paths, what a value is, Go's `%v` for
numbers, Go durations, and the JSON check for what lands in a JSONField.

Shared by the reader, the macros and the sections; no state, no YAML.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

from scheduling.llamaswap.errors import ConfigError


def join_path(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def go_float(value: float) -> str:
    """A float as Go's `%v` prints it, which is how llama-swap puts a macro into a string."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)
    digits = list(digit_tuple)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exponent += 1
    text = "".join(map(str, digits))
    count = len(digits)
    point = count + exponent
    exp = point - 1
    minus = "-" if sign else ""
    if exp < -4 or exp >= 6:  # strconv 'g' with the shortest precision switches at 1e6
        mantissa = text[0] + ("." + text[1:] if count > 1 else "")
        return f"{minus}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{minus}0.{'0' * -point}{text}"
    if point >= count:
        return f"{minus}{text}{'0' * (point - count)}"
    return f"{minus}{text[:point]}.{text[point:]}"


def go_str(value: Any) -> str:
    """How llama-swap writes a macro value into a string (`fmt.Sprintf("%v")`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return go_float(value)
    return str(value)


_MICRO = Fraction(1, 10**6)
_DURATION_UNITS = {"ns": Fraction(1, 10**9), "us": _MICRO, "\u00b5s": _MICRO, "\u03bcs": _MICRO,
                   "ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60),
                   "h": Fraction(3600)}
_DURATION_PART = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
_DURATION = re.compile(rf"[-+]?(?:0|(?:{_DURATION_PART})+)")
_DURATION_SPLIT = re.compile(r"([0-9.]+)([^0-9.]+)")
_DURATION_MAX = Fraction(2**63 - 1, 10**9)  # Go's time.Duration is int64 nanoseconds


def parse_go_duration(text: str) -> float:
    """Seconds in a Go duration string ("15s", "1m30s", "1.5h"), read as Go's
    `time.ParseDuration` reads it, since that is what llama-swap accepts for `performance.every`.

    Summed exactly (not in float steps) so that `format_go_duration`'s output reads back as the
    very same float, which is what keeps export → import free of spurious changes.
    """
    if not _DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a duration")
    total = sum((Fraction(number if not number.endswith(".") else number[:-1] or "0")
                 * _DURATION_UNITS[unit]
                 for number, unit in _DURATION_SPLIT.findall(text)), Fraction(0))
    if total > _DURATION_MAX:
        raise ValueError(f"{text!r} is longer than a Go duration can be")
    return float(-total if text.startswith("-") else total)


def format_go_duration(seconds: float) -> str:
    """Seconds as a duration string that Go (and `parse_go_duration`) reads back unchanged."""
    if not math.isfinite(seconds):
        raise ValueError(f"{seconds} seconds is not a duration")
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    # repr is the shortest text that reads back as this float, with no exponent in 1e-4..1e16.
    return f"{seconds!r}s"


def check_json(value: Any, path: str) -> None:
    """JSONField (PostgreSQL jsonb) takes only JSON: no NaN, dates, sets or non-string keys."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(path, f"{go_float(value)} cannot be stored; use a finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(join_path(path, key), f"keys must be strings; quote {key!r}")
            check_json(item, join_path(path, key))
        return
    raise ConfigError(path, f"{describe(value)} cannot be stored; use a string, number, "
                            "boolean, list or mapping")
