"""What a request says about how urgent it is and how long it has waited, decided once.

The priority this node *applies* (`applied_priority`) is the one the scheduler gets and the
one a peer is told (gpuproxy/proxy/peers.py): both read it from here, so a clamp added later
(per-key ranges) reaches both. The arrival a trusted peer carries (`X-LlamaSwap-Arrived`) is
honoured only from a caller whose key is marked trusted peer; anyone else's is ignored, as an
ordinary client's header (docs/scheduling.md, "Priority across peers").
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from typing import Any

from gpuproxy.proxy.auth import presented_key
from scheduling.catalog import Catalog
from scheduling.core.priority import HEADER, parse_priority, service_tier_priority

PRIORITY_HEADER = HEADER.encode()
QUEUE_TIMEOUT_HEADER = b"x-llamaswap-queue-timeout"
ARRIVED_HEADER = b"x-llamaswap-arrived"
# The oldest a carried arrival may make a request: a peer's clock can be wrong, and an age of
# days would put its requests ahead of everything here for as long.
MAX_AGE = 24 * 3600.0


def applied_priority(headers: Mapping[bytes, bytes], json_body: dict[str, Any] | None) -> int:
    """The header's priority; without the header, OpenAI's `service_tier` in the body."""
    header = headers.get(PRIORITY_HEADER)
    if header is None and json_body is not None:
        tier = service_tier_priority(json_body.get("service_tier"))
        if tier is not None:
            return tier
    return parse_priority(header)


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
    key = presented_key(headers.get(b"authorization", b"").decode("latin-1"),
                        headers.get(b"x-api-key", b"").decode("latin-1"))
    if key is None:
        return False
    return hashlib.sha256(key.encode()).hexdigest() in catalog.trusted_peer_keys


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
