"""What a request says about how urgent it is and how long it has waited, decided once.

The priority this node *applies* (`applied_priority`) is the one the scheduler gets and the
one a peer is told (gpuproxy/proxy/peers.py): both read it from here, so the clamp into the
caller's key's range (`ApiKey.priority_min/max/default`, else the global range in the proxy
settings; docs/scheduling.md, "Trusted priority") reaches both. The arrival a trusted peer
carries (`X-LlamaSwap-Arrived`) is honoured only from a caller whose key is marked trusted
peer; anyone else's is ignored, as an ordinary client's header (docs/scheduling.md,
"Priority across peers").
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol

from gpuproxy.proxy.auth import presented_key
from scheduling.catalog import Catalog
from scheduling.core.priority import HEADER, parse_priority, service_tier_priority

PRIORITY_HEADER = HEADER.encode()
QUEUE_TIMEOUT_HEADER = b"x-llamaswap-queue-timeout"
ARRIVED_HEADER = b"x-llamaswap-arrived"
# The oldest a carried arrival may make a request: a peer's clock can be wrong, and an age of
# days would put its requests ahead of everything here for as long.
MAX_AGE = 24 * 3600.0


# A header value that means 0 on purpose; parse_priority also gives 0 for junk, which asks
# for nothing (the key's default applies).
_ZERO = re.compile(r"[ \t]*(?:[+-]?0+|normal)[ \t]*", re.IGNORECASE)

Range = tuple[int | None, int | None, int | None]  # (min, max, default); None: unset
UNSET: Range = (None, None, None)


class Asked(Protocol):
    """Where the asked priority is kept (activity/record.py's `Rec`)."""

    priority_asked: int | None


def asked_priority(headers: Mapping[bytes, bytes], json_body: dict[str, Any] | None
                   ) -> int | None:
    """What the request asks for: the header's priority; without the header, OpenAI's
    `service_tier` in the body; None when it asks for nothing (no header and no known tier,
    or an empty or unparseable header, which the seed read as 0 and still ignores the tier)."""
    header = headers.get(PRIORITY_HEADER)
    if header is None:
        if json_body is None:
            return None
        return service_tier_priority(json_body.get("service_tier"))
    value = parse_priority(header)
    if value == 0 and not _ZERO.fullmatch(header.decode("latin-1")):
        return None
    return value


def clamp(asked: int | None, key: Range, default_range: Range) -> int:
    """The priority applied: `asked`, else the default, kept within min..max. Each of the
    key's three values falls back to the global one when the key leaves it unset, so a key
    with only a max is capped above and bounded below only as every key is (by default not
    at all). The default, else 0, is clamped too: a global max of -50 puts everything that
    asks for nothing in the batch band."""
    lo, hi, default = (k if k is not None else g for k, g in zip(key, default_range,
                                                                   strict=True))
    value = asked if asked is not None else (default if default is not None else 0)
    if hi is not None and value > hi:
        value = hi
    if lo is not None and value < lo:
        value = lo
    return value


def key_range(headers: Mapping[bytes, bytes], catalog: Catalog) -> Range:
    """The range of the key the request was let in with; UNSET without keys or a range."""
    if not catalog.priority_ranges:
        return UNSET
    digest = _digest(headers)
    return catalog.priority_ranges.get(digest, UNSET) if digest else UNSET


def applied_priority(headers: Mapping[bytes, bytes], json_body: dict[str, Any] | None,
                     catalog: Catalog, rec: Asked | None = None) -> int:
    """The priority this node applies (the scheduler's, a peer's, vLLM's): the asked one
    clamped into the caller's key's range. A trusted peer's key gets its own range only, not
    the global one: the entry node already applied its own. `rec` keeps the asked one for
    the activity row."""
    asked = asked_priority(headers, json_body)
    if rec is not None:
        rec.priority_asked = asked
    fallback = UNSET if from_trusted_peer(headers, catalog) else catalog.priority_range
    return clamp(asked, key_range(headers, catalog), fallback)


def queue_deadline(headers: Mapping[bytes, bytes], default: float) -> float | None:
    """Seconds a request may wait: `X-LlamaSwap-Queue-Timeout` (a positive number), else
    `default` (the `queue.timeout` setting; 0: no deadline). A bad header value is ignored, as
    a bad priority is: the request is still served."""
    raw = headers.get(QUEUE_TIMEOUT_HEADER)
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = 0.0
        if 0 < seconds < float("inf"):
            return seconds
    return default or None


def from_trusted_peer(headers: Mapping[bytes, bytes], catalog: Catalog) -> bool:
    """Whether the request was let in with a key marked trusted peer (`ApiKey.trusted_peer`).
    No keys defined, no trust: anyone may send any header then."""
    if not catalog.api_keys or not catalog.trusted_peer_keys:
        return False
    return _digest(headers) in catalog.trusted_peer_keys


def _digest(headers: Mapping[bytes, bytes]) -> str:
    """The SHA-256 of the presented key, as the catalog's key sets hold it; "" for none."""
    key = presented_key(headers.get(b"authorization", b"").decode("latin-1"),
                        headers.get(b"x-api-key", b"").decode("latin-1"))
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def carried_age(raw: bytes | None, now: float) -> float:
    """Seconds since the arrival `raw` names (unix epoch seconds, a float: monotonic clocks
    differ between hosts), clamped to [0, MAX_AGE]; 0 for a missing or unreadable value. A
    peer's clock ahead of ours makes an arrival in the future: 0, not a negative age."""
    if raw is None:
        return 0.0
    try:
        arrived = float(raw.strip())
    except ValueError:
        return 0.0
    if not math.isfinite(arrived):
        return 0.0
    return min(max(now - arrived, 0.0), MAX_AGE)


def age(headers: Mapping[bytes, bytes], catalog: Catalog) -> float:
    """Seconds the request waited before it came here: a trusted peer's carried arrival,
    else 0 (anyone else's `X-LlamaSwap-Arrived` is ignored)."""
    if not from_trusted_peer(headers, catalog):
        return 0.0
    return carried_age(headers.get(ARRIVED_HEADER), time.time())
