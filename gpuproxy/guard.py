"""An ASGI wrapper that turns Django's "suspicious" errors raised outside its own handling into
an OpenAI-style 400, instead of a crashed app and Daphne's bare 500.

Two such places, found by tests/test_fuzz.py: the static files handler checks the path
(`/static/..` raises SuspiciousFileOperation) before Django's exception middleware exists, and
ASGIRequest reads the query string while setting a charset from the Content-Type, where too
many fields raise TooManyFieldsSent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from django.core.exceptions import SuspiciousOperation

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class SuspiciousGuard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except SuspiciousOperation as exc:
            if started or scope.get("type") != "http":
                raise
            body = json.dumps({"error": {
                "message": f"refused: {exc}", "type": "invalid_request_error", "param": None,
                "code": "bad_request"}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
