"""One HTTP request as a plain ASGI application: an instance per request, a receive loop, and
the two ways to answer (`send_headers`, `send_body`).

The proxy path is the product's hot path, and Channels' `AsyncHttpConsumer` costs it about a
tenth of its CPU per request for things it never uses: a channel-layer lookup, a task and an
`asyncio.wait` per received message (`await_many_dispatch`), a database-connection check per
message, a wrapper frame per send (BENCHMARKS.md, "Speed"). The method names are Channels'
(`http_request`, `http_disconnect`, `send_headers`, `send_body`, `base_send`), so the proxy
reads as a consumer does; `base_send` stays the server's own callable, which
`UpstreamExchange.abort_client` unwraps to reach Daphne's request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class HttpApp:
    """Subclasses handle `http_request` (each body message) and `http_disconnect` (the client
    left, or the server finished the response): the loop ends after the disconnect."""

    scope: Scope
    base_send: Send

    def __init__(self) -> None:
        self.body: list[bytes] = []

    @classmethod
    def as_asgi(cls) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            self = cls()
            self.scope = scope
            self.base_send = send
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "http.request":
                    await self.http_request(message)
                elif kind == "http.disconnect":
                    await self.http_disconnect(message)
                    return

        app.__doc__ = cls.__doc__
        app.__qualname__ = app.__name__ = f"{cls.__name__}.asgi"
        return app

    async def http_request(self, message: Message) -> None:
        raise NotImplementedError

    async def http_disconnect(self, message: Message) -> None:
        return None

    async def send_headers(self, *, status: int = 200,
                           headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.base_send({"type": "http.response.start", "status": status,
                              "headers": headers or []})

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        await self.base_send({"type": "http.response.body", "body": body,
                              "more_body": more_body})

    async def send_response(self, status: int, body: bytes, *,
                            headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.send_headers(status=status, headers=headers)
        await self.send_body(body)
