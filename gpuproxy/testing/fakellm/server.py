"""The fake upstream's HTTP/1.1 server: sockets, request parsing, response framing, routing.

Hand-written on asyncio streams because the fake is the upstream the proxy benchmarks measure
against, so it must never be the bottleneck: standard library only (no Django, no third-party
import, so it starts in a few tens of milliseconds), keep-alive, chunked request bodies,
`Expect: 100-continue`, and constant bytes (status lines, headers) encoded once. It knows
nothing of models beyond the name every answer carries: what each path answers is the
subclass's route table (`endpoints`, `generation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_BODY = 64 * 1024 * 1024
#: Request line plus headers must fit in the stream buffer (llama-server allows about as much).
HEAD_LIMIT = 256 * 1024
#: Longest single sleep while waiting, so a client that went away is noticed this fast.
POLL_SLICE = 0.05

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_STATUS_LINES = {
    code: b"HTTP/1.1 %d %s\r\n" % (code, reason.encode()) for code, reason in _REASONS.items()
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
JSON_TYPE = b"Content-Type: application/json; charset=utf-8\r\n"
SSE_TYPE = b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
_CHUNKED = b"Transfer-Encoding: chunked\r\n"
_CONN_CLOSE = b"Connection: close\r\n"
_CONN_KEEP = b"Connection: keep-alive\r\n"
LAST_CHUNK = b"0\r\n\r\n"
DONE_EVENT = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """Compact JSON: fewer bytes on the wire is less work for the proxy being measured."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def out(line: str) -> None:
    """A lifecycle line on stdout, flushed at once: tests and the proxy's log read it live."""
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ClientGone(Exception):
    """The client closed its connection while we were holding or generating.

    `tokens` is how many tokens it had been sent, for the "client went away" line.
    """

    def __init__(self, tokens: int = 0) -> None:
        super().__init__(tokens)
        self.tokens = tokens


class HttpError(Exception):
    """Answer with an OpenAI-style JSON error and carry on (or close, for framing errors)."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


@dataclass(slots=True)
class Request:
    """One parsed HTTP request; the body is fully read (requests are small JSON documents)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    http10: bool
    query: str = ""


#: A route's handler: the request, its parsed JSON body (a dict for JSON POST routes, None for
#: GET and raw-body routes, hence Any), the connection's reader and writer.
Handler = Callable[[Request, Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def pause(reader: asyncio.StreamReader, seconds: float) -> None:
    """Sleep, waking every POLL_SLICE to notice a client that closed its connection."""
    if seconds <= 0:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        if reader.at_eof():
            raise ClientGone
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        await asyncio.sleep(min(remaining, POLL_SLICE))


class HttpServer:
    """Listening, the per-connection keep-alive loop, framing, and dispatch to `_routes`."""

    def __init__(self, host: str, port: int, model: str) -> None:
        self.host = host
        self.port = port
        self.model = model
        self._connections: set[asyncio.Task[None]] = set()
        #: path -> (method, handler); filled in once the port is known.
        self._routes: dict[str, tuple[str, Handler]] = {}
        #: Routes whose body is not JSON (multipart uploads): the handler reads it raw.
        self._raw_body: set[str] = set()
        #: `Server` and `X-Fake-Served-By` lines, added to every response.
        self._header_tail = b""
        #: The last JSON body a model endpoint received (`GET /fake/last-body`): tests check
        #: what the proxy sent upstream (filters, forwarded priority).
        self.last_body: dict[str, Any] | None = None
        self.last_headers: dict[str, str] = {}  # the last POST's, as /fake/last-body's "headers"

    # ----------------------------------------------------------------- lifecycle

    async def listen(self) -> asyncio.Server | None:
        """Bind and accept; None, after saying why on stderr, when the port cannot be had.
        With port 0, `port` becomes the one the system chose."""
        try:
            server = await asyncio.start_server(
                self._serve_connection, self.host, self.port, limit=HEAD_LIMIT, backlog=1024
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "address already in use"
            else:
                reason = (exc.strerror or str(exc)).lower()
            err(f"fakellm: cannot listen on {self.host}:{self.port}: {reason}")
            return None
        if server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        return server

    async def close(self, server: asyncio.Server) -> None:
        """Stop accepting and end the open connections (waiting at most a second)."""
        server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)

    # ----------------------------------------------------------------- HTTP framing

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Keep-alive loop: one request at a time until the client or a response closes it."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    req = await self._read_request(reader, writer)
                except HttpError as exc:
                    await self._send_error(writer, exc.status, exc.message, keep_alive=False)
                    return
                if req is None:
                    return
                if not await self._dispatch(req, reader, writer):
                    return
        except (ConnectionError, ClientGone, asyncio.IncompleteReadError):
            pass
        except Exception as exc:  # a bug here must not go unnoticed, nor kill the server
            err(f"fakellm: internal error: {exc!r}")
        finally:
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Request | None:
        """Parse a request line, headers and a Content-Length or chunked body; None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise HttpError(400, "incomplete request head", close=True) from None
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(431, "request head too large", close=True) from None
        lines = head.lstrip(b"\r\n").decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise HttpError(400, "malformed request line", close=True) from None
        if not version.startswith("HTTP/1."):
            raise HttpError(400, "unsupported HTTP version", close=True)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpError(400, "malformed header line", close=True)
            headers[name.strip().lower()] = value.strip()
        http10 = version == "HTTP/1.0"
        connection = headers.get("connection", "").lower()
        keep_alive = "keep-alive" in connection if http10 else "close" not in connection

        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length_header = headers.get("content-length")
        length = 0
        if length_header is not None and not chunked:
            try:
                length = int(length_header)
            except ValueError:
                raise HttpError(400, "bad Content-Length", close=True) from None
            if length < 0:
                raise HttpError(400, "bad Content-Length", close=True)
            if length > MAX_BODY:
                raise HttpError(413, f"body larger than {MAX_BODY} bytes", close=True)
        if (
            (chunked or length)
            and not http10
            and headers.get("expect", "").lower() == "100-continue"
        ):
            writer.write(_CONTINUE)
        if chunked:
            body = await self._read_chunked(reader)
        elif length:
            body = await reader.readexactly(length)
        else:
            body = b""
        path, _, query = target.partition("?")
        return Request(method.upper(), path, headers, body, keep_alive, http10, query)

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        """A chunked request body (httpx sends one for streamed uploads); trailers ignored."""
        parts: list[bytes] = []
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError(400, "bad chunk size", close=True) from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return b"".join(parts)
            total += size
            if total > MAX_BODY:
                raise HttpError(413, f"body larger than {MAX_BODY} bytes", close=True)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)

    def _head(
        self,
        status: int,
        content_type: bytes,
        *,
        length: int | None,
        keep_alive: bool,
        http10: bool = False,
        extra: bytes = b"",
    ) -> bytes:
        """The status line and headers; `length=None` means a streamed (chunked) body."""
        framing = (
            b"Content-Length: %d\r\n" % length
            if length is not None
            else (b"" if http10 else _CHUNKED)
        )
        if not keep_alive:
            conn = _CONN_CLOSE
        elif http10:
            conn = _CONN_KEEP
        else:
            conn = b""
        return b"".join(
            (_STATUS_LINES[status], self._header_tail, content_type, framing, conn, extra, b"\r\n")
        )

    async def _send_json(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        payload: bytes,
        *,
        keep_alive: bool,
        http10: bool = False,
        extra: bytes = b"",
    ) -> None:
        writer.write(
            self._head(
                status,
                JSON_TYPE,
                length=len(payload),
                keep_alive=keep_alive,
                http10=http10,
                extra=extra,
            )
            + payload
        )
        await writer.drain()

    async def _send_error(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        message: str,
        *,
        keep_alive: bool,
        http10: bool = False,
        extra: bytes = b"",
    ) -> None:
        # llama.cpp's key order, so the loading 503 matches llama-server byte for byte
        # (plus the top-level "model" every answer carries).
        error = {"code": status, "message": message, "type": _ERROR_TYPES.get(status, "error")}
        payload = dumps({"error": error, "model": self.model})
        await self._send_json(
            writer, status, payload, keep_alive=keep_alive, http10=http10, extra=extra
        )

    async def _dispatch(
        self, req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Route one request; returns whether the connection may serve another one."""
        keep = req.keep_alive
        route = self._routes.get(req.path)
        try:
            if route is None:
                raise HttpError(404, f"no such endpoint: {req.method} {req.path}")
            method, handler = route
            if req.method != method:
                await self._send_error(
                    writer,
                    405,
                    f"method {req.method} not allowed on {req.path}; use {method}",
                    keep_alive=keep,
                    http10=req.http10,
                    extra=b"Allow: %s\r\n" % method.encode(),
                )
                return keep
            body: dict[str, Any] | None = None
            if method == "POST" and req.path not in self._raw_body:
                try:
                    body = json.loads(req.body)
                except (ValueError, UnicodeDecodeError) as exc:
                    raise HttpError(400, f"request body is not valid JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise HttpError(400, "request body must be a JSON object")
                if not req.path.startswith("/fake/"):
                    self.last_body, self.last_headers = body, dict(req.headers)
            await handler(req, body, reader, writer)
        except HttpError as exc:
            await self._send_error(
                writer,
                exc.status,
                exc.message,
                keep_alive=keep and not exc.close,
                http10=req.http10,
            )
            return keep and not exc.close
        return req.keep_alive
