"""One request's activity record, filled in as the request moves through the proxy.

The consumer creates it on arrival, notes each milestone (dispatch, first byte, end) and the
outcome, and hands the finished row to the writer in its `finally`: O(1), never the database.
Plain Python; the writer turns the row into a `RequestLog`.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import time
import uuid
from collections.abc import Mapping
from typing import Any

from activity import endpoints, outcomes
from scheduling.core.events import Dispatch
from scheduling.core.priority import band as band_of

USER_AGENT_MAX = 300
END_USER_MAX = 255  # activity.models.END_USER_MAX
#: What API keys look like (OpenAI's and Anthropic's `sk-`, ours too): never kept as an end user.
_KEY_PREFIXES = ("sk-",)


def _wall(monotonic: float, anchor: tuple[float, float]) -> dt.datetime:
    """A monotonic instant as UTC wall time, via one (monotonic, wall) pair per request."""
    mono0, wall0 = anchor
    return dt.datetime.fromtimestamp(wall0 + (monotonic - mono0), tz=dt.UTC)


class RequestRecord:
    __slots__ = ("_anchor", "bytes_out", "client", "client_ip", "dispatch", "dispatched",
                 "end_user", "error", "finished", "first_byte", "method", "model",
                 "model_requested", "outcome", "path", "priority", "priority_asked", "received",
                 "request_id", "scheduler", "status_code", "stream", "swap_s",
                 "upstream_retries", "usage", "user_agent")

    def __init__(self, method: str, path: str, client: str, user_agent: str) -> None:
        now = time.monotonic()
        self._anchor = (now, time.time())
        self.request_id = uuid.uuid4()
        self.received = now
        self.method = method
        self.path = path
        self.client = client  # the address until an API key names the caller
        self.client_ip = client
        self.end_user = ""
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

    def note_request(self, model: str, stream: bool, body: Any,
                     headers: Mapping[bytes, bytes]) -> None:
        """What the parsed body says: the model, whether it streams, and its end user
        (OpenAI's `user`, Anthropic's `metadata.user_id`): cut to 255 characters, and never
        a credential: a value that is the request's own key or looks like one is dropped."""
        self.model_requested = model
        self.stream = stream
        if not isinstance(body, dict):
            return
        user = body.get("user")
        if not isinstance(user, str):
            metadata = body.get("metadata")
            user = metadata.get("user_id") if isinstance(metadata, dict) else None
        if not isinstance(user, str) or not (user := user.strip()):
            return
        if user.startswith(_KEY_PREFIXES) or _is_credential(user, headers):
            return
        self.end_user = user[:END_USER_MAX]

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
                             "seq": d.seq, **({"budget_override": True}
                                              if d.budget_override else {})}
                            if d else None),
            "queue_wait_ms": round(d.queue_wait * 1000, 3) if d else (
                ms(self.received, self.finished) if self.outcome == outcomes.CANCELLED_QUEUED
                else None),
            "swap_ms": round(self.swap_s * 1000, 3) if self.swap_s is not None else None,
            "duration_ms": ms(self.received, self.finished),
            "ttft_ms": ms(self.dispatched, self.first_byte),
            "stream": self.stream,
            "input_tokens": getattr(u, "input_tokens", None),
            "output_tokens": getattr(u, "output_tokens", None),
            "output_tokens_counted": bool(getattr(u, "output_counted", False)),
            "draft_tokens": getattr(u, "draft_tokens", None),
            "draft_accepted_tokens": getattr(u, "draft_accepted_tokens", None),
            # the names before issue 20, now aliases (docs/activity.md)
            "prompt_tokens": getattr(u, "input_tokens", None),
            "completion_tokens": getattr(u, "output_tokens", None),
            "cached_tokens": getattr(u, "cached_tokens", None),
            "prompt_tps": getattr(u, "prompt_tps", None),
            "generation_tps": getattr(u, "generation_tps", None),
            "scheduler": self.scheduler,
            "client": self.client,
            "client_ip": _ip_or_none(self.client_ip),
            "end_user": self.end_user,
            "endpoint": endpoints.endpoint(self.path) if self.path else "",
            "user_agent": self.user_agent,
            "error": self.error,
            "upstream_retries": self.upstream_retries,
        }


def _ip_or_none(text: str) -> str | None:
    """An address the `inet` column takes, or None: a batch with one bad value would fail
    whole (a Unix socket's peer is a path, a test client's a name)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _is_credential(value: str, headers: Mapping[bytes, bytes]) -> bool:
    """Whether `value` is the key this request presented: Bearer, Basic's password (as
    gpuproxy/proxy/auth.py reads keys) or X-Api-Key."""
    raw = value.encode("latin-1", "replace")
    auth = headers.get(b"authorization", b"")
    scheme, _, token = auth.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() == b"basic":
        try:
            token = base64.b64decode(token, validate=True).partition(b":")[2]
        except ValueError:
            token = b""
    return raw in (token, headers.get(b"x-api-key", b"").strip()) or raw == auth.strip()
