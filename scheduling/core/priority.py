"""The `X-LlamaSwap-Priority` request header: parsing and bands. Pure.

A caller states how urgent its request is with a signed integer, or with one of three aliases:
`interactive` (+100), `normal` (0), `batch` (-100), in any case. Absent, empty or unparseable
means 0 and is never an error. Values are not clamped here, so a caller can compose a band and
an offset itself (`interactive` + 3 = 103); a key's range, where one is configured, clamps them
in gpuproxy/proxy/urgency.py. Bands sit 100 apart and the swap-affinity bonus is at
most 99, so affinity never promotes a request into the next band at equal age.
"""

from __future__ import annotations

import re

HEADER = "x-llamaswap-priority"  # lower-case, as ASGI scopes carry header names

INTERACTIVE = 100
NORMAL = 0
BATCH = -100

BANDS = ("interactive", "normal", "batch")  # highest first

ALIASES = {"interactive": INTERACTIVE, "normal": NORMAL, "batch": BATCH}

# OpenAI's `service_tier` body field, counted when the header is absent: clients built on the
# OpenAI SDK can say "flex" (cheap, slow) or "priority" without knowing our header.
SERVICE_TIERS = {"priority": INTERACTIVE, "flex": BATCH, "default": NORMAL, "auto": NORMAL}

# A band boundary sits half way between the aliases.
INTERACTIVE_FROM = 50  # priority >= this is interactive
BATCH_UPTO = -50  # priority <= this is batch

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_INTEGER = re.compile(r"([+-]?)([0-9]+)")  # ASCII digits only (no "1_000", "0x10")


def parse_priority(value: str | bytes | None) -> int:
    """The priority a header value asks for; 0 when absent, empty or unparseable.

    Accepted: an optional sign and decimal ASCII digits (`5`, `-20`, `+7`, `007`) within the
    signed 64-bit range, or an alias (any case). Spaces and tabs around the value (HTTP's
    optional whitespace) are ignored. Everything else (`1e3`, `5 5`, `0x10`, `1_000`, `+ 7`,
    `9223372036854775808`) is unparseable and means 0.
    """
    if value is None:
        return NORMAL
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("latin-1")  # HTTP header bytes; never fails
    text = value.strip(" \t")
    if not text:
        return NORMAL
    alias = ALIASES.get(text.lower()) if text.isascii() else None
    if alias is not None:
        return alias
    m = _INTEGER.fullmatch(text)
    if m is None:
        return NORMAL
    digits = m.group(2).lstrip("0") or "0"
    if len(digits) > 19:  # beyond int64 for sure; also keeps int() off huge strings
        return NORMAL
    n = int(digits)
    if m.group(1) == "-":
        n = -n
    if not _INT64_MIN <= n <= _INT64_MAX:
        return NORMAL
    return n


def band(priority: int) -> str:
    """The band label of a priority: `interactive` at >= 50, `batch` at <= -50, else
    `normal`. A label for metrics and the activity log; scheduling uses the number."""
    if priority >= INTERACTIVE_FROM:
        return "interactive"
    if priority <= BATCH_UPTO:
        return "batch"
    return "normal"


def service_tier_priority(value: object) -> int | None:
    """The priority an OpenAI `service_tier` asks for; None for anything else (unknown tiers
    and non-strings are ignored, never an error: the upstream may know tiers we do not)."""
    return SERVICE_TIERS.get(value.lower()) if isinstance(value, str) else None
