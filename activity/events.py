"""The model events (`ModelEvent`, table `activity_modelevent`): their kinds and reasons, one
spelling each, and the row a process's event becomes.

Stdlib only, no Django: `gpuproxy.upstream` (which must not import Django) reports its
transitions with these kinds, and the shell adds the reason it knows (why a stop was asked)
before the row goes to the events writer (`activity.writer.event_writer`), which writes it
off the event loop like a request's row.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

# kinds: what happened to the model's process
LOAD = "load"  # its process was spawned (pid known from here on)
READY = "ready"  # it passed its health check; duration: spawn to ready
UNLOAD = "unload"  # it stopped because a stop was asked; duration: the stop's
IDLE_UNLOAD = "idle_unload"  # it stopped because its ttl ran out; duration: the stop's
CRASH = "crash"  # a ready process exited on its own; duration: ready to exit
START_FAILED = "start_failed"  # it never became ready; duration: spawn (or try) to failure
RESTART = "restart"  # a restart began (asked, or its definition changed): unload + load follow

#: kind -> one-line description (also the documentation of the set).
KINDS: dict[str, str] = {
    LOAD: "the model's process was started (its pid is known from here on)",
    READY: "the process passed its health check; duration_ms: from spawn to ready",
    UNLOAD: "the process stopped because a stop was asked (see reason); duration_ms: the stop",
    IDLE_UNLOAD: "the process stopped because its ttl ran out; duration_ms: the stop",
    CRASH: "a ready process exited on its own; duration_ms: how long it had been ready",
    START_FAILED: "the process never became ready; duration_ms: from spawn to the failure",
    RESTART: "a restart began (asked, or the definition changed); an unload and a load follow",
}

# reasons: why it happened, as far as the proxy knows
REQUEST = "request"  # a request needed the model (a load, its ready, its failure)
SWAP = "swap"  # stopped to make room for another model's load (detail: which)
TTL = "ttl"  # idle for its ttl
ADMIN = "admin"  # an operator or the API asked (unload, unload-all)
CONFIG = "config"  # its definition was removed, disabled or changed
CRASHED = "crash"  # it exited on its own
SHUTDOWN = "shutdown"  # the proxy is exiting

REASONS: dict[str, str] = {
    REQUEST: "a request needed the model (request_id: the request that caused the load, "
             "when known)",
    SWAP: "stopped to make room for another model's load (detail names it)",
    TTL: "idle for longer than its ttl",
    ADMIN: "an operator or the API asked (unload, unload-all, restart)",
    CONFIG: "its definition was removed, disabled or changed",
    CRASHED: "its process exited on its own",
    SHUTDOWN: "the proxy was shutting down",
}

KIND_MAX_LENGTH = max(len(k) for k in KINDS)
REASON_MAX_LENGTH = max(len(r) for r in REASONS)
KIND_CHOICES = [(k, k) for k in KINDS]
REASON_CHOICES = [(r, r) for r in REASONS]
DETAIL_MAX = 500


def row(model: str, kind: str, *, pid: int | None = None, seconds: float | None = None,
        reason: str = "", detail: str = "", request_id: str | None = None,
        at: dt.datetime | None = None) -> dict[str, Any]:
    """The events writer's row. `detail` is what the operator may read (an exit status, the
    model a swap made room for): callers never put a command line or an environment in it,
    since those can hold secrets."""
    if kind not in KINDS:
        raise ValueError(f"unknown model event kind {kind!r}; one of {', '.join(KINDS)}")
    if reason and reason not in REASONS:
        raise ValueError(f"unknown model event reason {reason!r}; one of {', '.join(REASONS)}")
    return {
        "at": at if at is not None else dt.datetime.now(dt.UTC),
        "model": model,
        "kind": kind,
        "reason": reason,
        "pid": pid,
        "duration_ms": None if seconds is None else round(seconds * 1000.0, 3),
        "request_id": _uuid(request_id),
        "detail": detail[:DETAIL_MAX],
    }


def _uuid(value: str | None) -> uuid.UUID | None:
    """A request id as the column takes it; anything else is no id (never a rejected row)."""
    try:
        return uuid.UUID(value) if value else None
    except ValueError:
        return None
