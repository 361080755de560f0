"""The requests an upstream is answering right now, for the dashboard (and its cancel button)
and llama-swap's `/api/events` `inflight` rows.

The proxy consumer registers a request when the scheduler grants it and forgets it when it
ends; everything runs on the server's event loop, so a plain dict is enough. An entry reads
the consumer's live `RequestRecord` (bytes relayed so far, first byte) instead of copying it.
Its request headers are shown redacted, as a capture keeps them (`activity.captures.header_map`,
llama-swap's list): a view of a request in flight may reach another client, never a
credential. They are redacted when a view is made, not per request: nobody may be looking,
and the proxy's CPU per request is a measured goal (BENCHMARKS.md).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from activity.captures import header_map
from activity.record import RequestRecord
from scheduling.core.priority import band

#: llama-swap's `ui.activity.session_id` default: the headers a client's session id is read
#: from, the first present wins (LiteLLM sends the second).
SESSION_HEADERS = (b"x-session-id", b"x-litellm-session-id")
SESSION_ID_MAX = 128  # characters shown: an id, not a payload a client may make any size


def session_id(raw_headers: tuple) -> str:
    """The request's session id as llama-swap's in-flight table shows it ("" for none),
    at most SESSION_ID_MAX characters; ASGI header names are lower case already."""
    for wanted in SESSION_HEADERS:
        for name, value in raw_headers:
            if name == wanted and value.strip():
                return value.decode("latin-1").strip()[:SESSION_ID_MAX]
    return ""


def rfc3339(wall: float) -> str:
    """A wall-clock instant as Go's `time.Time` JSON (RFC 3339, UTC, `Z`)."""
    return dt.datetime.fromtimestamp(wall, tz=dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass(eq=False)
class InFlight:
    rec: RequestRecord
    model: str
    cancel: Callable[[], None]  # ends the request on an operator's word
    raw_headers: tuple = ()  # the ASGI scope's, as received; only `view` shows them, redacted
    remote_ip: str = ""  # the peer's address (the record's `client` becomes the key's name)

    @classmethod
    def of(cls, rec: RequestRecord, model: str, cancel: Callable[[], None],
           scope: dict[str, Any]) -> InFlight:
        """An entry for the ASGI request `scope`."""
        client = scope.get("client") or ("", 0)
        return cls(rec, model, cancel, tuple(scope.get("headers", ())), client[0] or "")

    def view(self, now: float) -> dict[str, Any]:
        """The dashboard's fields (the user agent and session id of llama-swap's in-flight
        table among them), then llama-swap's `InflightRequestEntry` ones (its
        `timestamp` and `elapsed_ms` count from the request's arrival, as there)."""
        r = self.rec
        arrived_wall = time.time() - (now - r.received)
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
            "user_agent": r.user_agent,  # cut to USER_AGENT_MAX by the record
            "session_id": session_id(self.raw_headers),
            "timestamp": rfc3339(arrived_wall),
            "req_path": r.path,
            "method": r.method,
            "req_headers": header_map(list(self.raw_headers)) or {},
            "remote_ip": self.remote_ip,
            "resp_headers": {},
            "resp_bytes": r.bytes_out,
            "elapsed_ms": int((now - r.received) * 1000),
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
