"""An ASGI wrapper that turns Django's "suspicious" errors raised outside its own handling into
an OpenAI-style 400, instead of a crashed app and Daphne's bare 500.

Two such places, found by tests/test_fuzz.py: the static files handler checks the path
(`/static/..` raises SuspiciousFileOperation) before Django's exception middleware exists, and
ASGIRequest reads the query string while setting a charset from the Content-Type, where too
many fields raise TooManyFieldsSent.

The client gets a reason, not Django's message: SuspiciousFileOperation's names the install
path ("The joined path (...) is located outside of the base path component (/srv/.../static)").
The full message goes to the log, for the operator.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from django.core.exceptions import SuspiciousFileOperation, SuspiciousOperation

from gpuproxy.proxy.errors import error_body

logger = logging.getLogger("gpuproxy.proxy.guard")

# Where this install lives: never in a message a client reads.
_INSTALL_PATHS = sorted({p for p in (str(Path(__file__).resolve().parent.parent), sys.prefix,
                                      sys.base_prefix, sys.exec_prefix) if len(p) > 1},
                        key=len, reverse=True)


def client_reason(exc: BaseException) -> str:
    """What a client may read about a refused request: Django's message (it is about the
    request), except for a file path check, whose message names the directories it compared;
    and in any case no path of this install."""
    if isinstance(exc, SuspiciousFileOperation):
        text = ("refused: the path leaves the directory it names (a '..' segment or an "
                "absolute path)")
    elif isinstance(exc, SuspiciousOperation):
        text = f"refused: {exc}" if str(exc) else f"refused: {type(exc).__name__}"
    else:
        text = str(exc) or "bad request"
    for path in _INSTALL_PATHS:
        text = text.replace(path, "<install>")
    return text


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
            logger.warning("refused %s %s: %s", scope.get("method"), scope.get("path"), exc)
            body = error_body(client_reason(exc), code="bad_request")
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
