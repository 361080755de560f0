"""One request's activity record, filled in as the request moves through the proxy.

The consumer creates it on arrival, notes each milestone (dispatch, first byte, end) and the
outcome, and hands the finished row to the writer in its `finally`: O(1), never the database.
Plain Python; the writer turns the row into a `RequestLog`.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Any

from activity import outcomes
from scheduling.core.events import Dispatch
from scheduling.core.priority import band as band_of

USER_AGENT_MAX = 300


def _wall(monotonic: float, anchor: tuple[float, float]) -> dt.datetime:
    """A monotonic instant as UTC wall time, via one (monotonic, wall) pair per request."""
    mono0, wall0 = anchor
    return dt.datetime.fromtimestamp(wall0 + (monotonic - mono0), tz=dt.UTC)


class RequestRecord:
    __slots__ = ("_anchor", "bytes_out", "client", "dispatch", "dispatched", "error", "finished",
                 "first_byte", "method", "model", "model_requested", "outcome", "path",
                 "priority", "priority_asked", "received", "request_id", "scheduler",
                 "status_code", "stream", "swap_s", "upstream_retries", "usage", "user_agent")

    def __init__(self, method: str, path: str, client: str, user_agent: str) -> None:
        now = time.monotonic()
        self._anchor = (now, time.time())
        self.request_id = uuid.uuid4()
        self.received = now
        self.method = method
        self.path = path
        self.client = client
        self.user_agent = user_agent[:USER_AGENT_MAX]
        self.model_requested = ""
        self.model = ""
        self.priority = 0
        self.priority_asked: int | None = None  # before the key's range (urgency.py)
        self.stream = False
        self.scheduler = ""
        self.dispatch: Dispatch | None = None
        self.dispatched: float | None = None
        self.first_byte: float | None = None
        self.finished: float | None = None
        self.swap_s: float | None = None
        self.status_code = 0
        self.outcome = ""
        self.error = ""
        self.usage: Any = None  # activity.usage.Usage once the response was parsed
        self.bytes_out = 0  # response body bytes relayed so far (the dashboard shows it)
        self.upstream_retries = 0  # sends repeated on a fresh connection (consumers.relay)

    def fail(self, status: int, outcome: str, error: str) -> None:
        self.status_code = status
        self.outcome = outcome
        self.error = error

    def row(self) -> dict[str, Any]:
        """The finished row; `finished` defaults to now."""
        if self.finished is None:
            self.finished = time.monotonic()
        d = self.dispatch
        u = self.usage

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 3)

        return {
            "request_id": self.request_id,
            "received_at": _wall(self.received, self._anchor),
            "dispatched_at": _wall(self.dispatched, self._anchor) if self.dispatched else None,
            "first_byte_at": _wall(self.first_byte, self._anchor) if self.first_byte else None,
            "finished_at": _wall(self.finished, self._anchor),
            "method": self.method,
            "path": self.path,
            "model_requested": self.model_requested,
            "model": self.model,
            "status_code": self.status_code,
            "outcome": self.outcome or outcomes.OK,
            "priority": self.priority,
            "priority_asked": self.priority_asked,
            "band": d.band if d else band_of(self.priority),
            "score": d.score if d else None,
            "score_parts": ({"priority": d.priority, "affinity": d.affinity, "aging": d.aging,
                             "seq": d.seq} if d else None),
            "queue_wait_ms": round(d.queue_wait * 1000, 3) if d else (
                ms(self.received, self.finished) if self.outcome == outcomes.CANCELLED_QUEUED
                else None),
            "swap_ms": round(self.swap_s * 1000, 3) if self.swap_s is not None else None,
            "duration_ms": ms(self.received, self.finished),
            "ttft_ms": ms(self.dispatched, self.first_byte),
            "stream": self.stream,
            "prompt_tokens": getattr(u, "prompt_tokens", None),
            "completion_tokens": getattr(u, "completion_tokens", None),
            "cached_tokens": getattr(u, "cached_tokens", None),
            "prompt_tps": getattr(u, "prompt_tps", None),
            "generation_tps": getattr(u, "generation_tps", None),
            "scheduler": self.scheduler,
            "client": self.client,
            "user_agent": self.user_agent,
            "error": self.error,
            "upstream_retries": self.upstream_retries,
        }
