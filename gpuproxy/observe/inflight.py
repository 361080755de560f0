"""The requests an upstream is answering right now, for the dashboard (and its cancel button).

The proxy consumer registers a request when the scheduler grants it and forgets it when it
ends; everything runs on the server's event loop, so a plain dict is enough. An entry reads
the consumer's live `RequestRecord` (bytes relayed so far, first byte) instead of copying it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from activity.record import RequestRecord
from scheduling.core.priority import band


@dataclass(eq=False)
class InFlight:
    rec: RequestRecord
    model: str
    cancel: Callable[[], None]  # ends the request on an operator's word

    def view(self, now: float) -> dict[str, Any]:
        r = self.rec
        return {
            "id": str(r.request_id),
            "model": self.model,
            "priority": r.priority,
            "band": band(r.priority),
            "client": r.client,
            "path": r.path,
            "stream": r.stream,
            "elapsed_s": round(now - (r.dispatched or r.received), 3),
            "bytes": r.bytes_out,
        }


_active: dict[str, InFlight] = {}
_listeners: list[Callable[[], None]] = []


def add(entry: InFlight) -> None:
    _active[str(entry.rec.request_id)] = entry
    _changed()


def remove(rec: RequestRecord) -> None:
    if _active.pop(str(rec.request_id), None) is not None:
        _changed()


def snapshot() -> list[dict[str, Any]]:
    """The requests in flight, longest-running first."""
    now = time.monotonic()
    return sorted((e.view(now) for e in _active.values()), key=lambda v: -v["elapsed_s"])


def cancel(request_id: str) -> bool:
    """End one request in flight (an operator's cancel); False when it is no longer there."""
    entry = _active.get(request_id)
    if entry is None:
        return False
    entry.cancel()
    return True


def on_change(listener: Callable[[], None]) -> None:
    _listeners.append(listener)


def _changed() -> None:
    for listener in list(_listeners):
        listener()
