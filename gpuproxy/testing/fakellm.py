"""A fake OpenAI-compatible inference server: the upstream for the example config, tests, benches.

Run as ``python -m gpuproxy.testing.fakellm --port P [--host H] [--model NAME] [--tps N]
[--load-seconds S] [--ignore-sigterm] [--crash-after N] [--exit-on-start CODE]``.

Why it is written this way:

* It is the upstream the proxy benchmarks measure against, so it must never be the bottleneck.
  It is a hand-written HTTP/1.1 server on asyncio streams (standard library only: no Django,
  no third-party import, and it starts in a few tens of milliseconds), constant bytes are
  encoded once, and a streamed token costs one small ``bytes`` formatting and one write.
* It behaves like llama-server where the proxy cares: it binds before "loading" (so the port
  is taken while ``/health`` still answers 503 with llama.cpp's exact error shape), it exits 1
  when the port is busy, it reports ``usage`` and llama.cpp ``timings``, and ``/slots`` says
  whether a generation is running.
* It can misbehave on purpose (slow load, death at start, ignoring SIGTERM, a crash in the
  middle of a response, held responses, slow tokens) so the proxy's failure handling can be
  tested against a real process instead of mocks.
* Every answer says who served it (``X-Fake-Served-By: NAME:PORT``, a top-level ``"model"``
  in every JSON object, ``system_fingerprint`` in completions) so routing can be asserted.

Lifecycle lines go to stdout (one flushed line per event: bound, loaded, a client that went
away, a simulated crash); failures to start go to stderr. Nothing is printed per request, so a
benchmark is not slowed down by logging.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import errno
import hashlib
import json
import math
import os
import signal
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "fake"
DEFAULT_MAX_TOKENS = 16
EMBEDDING_DIMS = 8
MAX_BODY = 64 * 1024 * 1024
#: Request line plus headers must fit in the stream buffer (llama-server allows about as much).
HEAD_LIMIT = 256 * 1024
#: Longest single sleep while waiting, so a client that went away is noticed this fast.
POLL_SLICE = 0.05
CRASH_EXIT_CODE = 3

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
_JSON_TYPE = b"Content-Type: application/json; charset=utf-8\r\n"
_SSE_TYPE = b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
_CHUNKED = b"Transfer-Encoding: chunked\r\n"
_CONN_CLOSE = b"Connection: close\r\n"
_CONN_KEEP = b"Connection: keep-alive\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
_DONE_EVENT = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> bytes:
    """Compact JSON: fewer bytes on the wire is less work for the proxy being measured."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


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


def _word_count(value: Any) -> int:
    """Deterministic stand-in for a tokenizer: whitespace words in any nested text."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # a pre-tokenized prompt
        return sum(_word_count(v) for v in value)
    if isinstance(value, dict):
        # chat messages ({"content": ...}) and content parts ({"type": "text", "text": ...})
        return _word_count(value.get("content")) + _word_count(value.get("text"))
    return 0


def _embedding(text: str) -> list[float]:
    """A unit vector derived from a stable hash (never Python's randomised `hash`)."""
    digest = hashlib.blake2b(text.encode(), digest_size=2 * EMBEDDING_DIMS).digest()
    raw = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{EMBEDDING_DIMS}H", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def _relevance(query: str, document: str) -> float:
    """Word overlap with the query, plus a tiny stable tie-breaker so scores are distinct."""
    q = set(query.lower().split())
    d = set(document.lower().split())
    overlap = len(q & d) / len(q) if q else 0.0
    tie = hashlib.blake2b(document.encode(), digest_size=2).digest()
    return round(overlap * 0.9 + int.from_bytes(tie, "little") / 65535 * 0.1, 6)


def _doc_text(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return doc["text"]
    raise HttpError(400, "documents must be strings or objects with a 'text' field")


def _max_tokens(body: dict[str, Any]) -> int:
    """`max_tokens`, `max_completion_tokens` or llama.cpp's `n_predict`; -1 means the default."""
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise HttpError(400, f"'{key}' must be an integer")
        if value == -1:
            return DEFAULT_MAX_TOKENS
        if value < 0:
            raise HttpError(400, f"'{key}' must be >= 0")
        return value
    return DEFAULT_MAX_TOKENS


def _hold_seconds(req: Request, body: dict[str, Any] | None) -> float:
    """`X-Fake-Hold` header or `fake_hold` body field: how long to sit before the status line."""
    raw: Any = req.headers.get("x-fake-hold")
    if raw is None and body is not None:
        raw = body.get("fake_hold")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise HttpError(400, "X-Fake-Hold / fake_hold must be a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise HttpError(400, "X-Fake-Hold / fake_hold must be a non-negative number of seconds")
    return seconds


class FakeLLM:
    """The server: configuration, load state, slots and the per-connection HTTP loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.host: str = args.host
        self.port: int = args.port
        self.model: str = args.model
        self.tps: float = args.tps
        self.load_seconds: float = args.load_seconds
        self.ignore_sigterm: bool = args.ignore_sigterm
        self.crash_after: int | None = args.crash_after
        self.exit_on_start: int | None = args.exit_on_start
        self.loaded = False
        self.completion_requests = 0
        #: One flag per slot ever used: llama.cpp reports a fixed set, we grow it on demand.
        self.slots: list[bool] = [False]
        self.active_generations = 0
        self._request_seq = 0
        self._started = time.time()
        self._stop: asyncio.Event | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._routes: dict[str, tuple[str, Callable[..., Any]]] = {}
        #: `X-Fake-Gate: NAME` holds a response until `POST /fake/gates/open {"gate": NAME}`:
        #: a test decides when a request finishes, instead of guessing a hold time.
        self._gates: dict[str, asyncio.Event] = {}
        #: The last JSON body a model endpoint received (`GET /fake/last-body`): tests check
        #: what the proxy sent upstream (filters, forwarded priority).
        self.last_body: dict[str, Any] | None = None
        self._header_tail = b""

    # ----------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        """Bind, announce, "load", serve until a signal; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._install_signals(loop)
        try:
            server = await asyncio.start_server(
                self._serve_connection, self.host, self.port, limit=HEAD_LIMIT, backlog=1024
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "address already in use"
            else:
                reason = (exc.strerror or str(exc)).lower()
            _err(f"fakellm: cannot listen on {self.host}:{self.port}: {reason}")
            return 1
        if server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        self._build_constants()
        _out(
            f"fakellm: model {self.model} listening on http://{self.host}:{self.port} "
            f"pid {os.getpid()}"
        )
        if self.exit_on_start is not None:
            _err(f"fakellm: simulated start failure for model {self.model}")
            server.close()
            return self.exit_on_start
        if self.load_seconds > 0:
            loop.call_later(self.load_seconds, self._mark_loaded)
        else:
            self._mark_loaded()
        await self._stop.wait()
        server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)
        return 0

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM/SIGINT stop cleanly (exit 0); `--ignore-sigterm` mimics a stuck server."""

        def stop(name: str) -> None:
            _out(f"fakellm: {name}, exiting")
            assert self._stop is not None
            self._stop.set()

        if self.ignore_sigterm:
            loop.add_signal_handler(
                signal.SIGTERM, _out, "fakellm: SIGTERM ignored (--ignore-sigterm)"
            )
        else:
            loop.add_signal_handler(signal.SIGTERM, stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, stop, "SIGINT")

    def _mark_loaded(self) -> None:
        self.loaded = True
        _out(f"fakellm: model {self.model} loaded in {self.load_seconds:g} s")

    def _build_constants(self) -> None:
        """Encode everything that depends only on the model and the bound port, once."""
        served_by = f"{self.model}:{self.port}"
        self.fingerprint = f"fakellm:{served_by}"
        self._header_tail = b"Server: fakellm\r\nX-Fake-Served-By: " + served_by.encode() + b"\r\n"
        self._model_json = _dumps(self.model)
        self._fingerprint_json = _dumps(self.fingerprint)
        self._routes = {
            "/health": ("GET", self._health),
            "/v1/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/models": ("GET", self._models),
            "/slots": ("GET", self._slots),
            "/v1/chat/completions": ("POST", self._chat),
            "/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/completions": ("POST", self._completions),
            "/v1/embeddings": ("POST", self._embeddings),
            "/embeddings": ("POST", self._embeddings),
            "/v1/rerank": ("POST", self._rerank),
            "/rerank": ("POST", self._rerank),
            "/v1/reranking": ("POST", self._rerank),
            "/reranking": ("POST", self._rerank),
            "/v1/audio/transcriptions": ("POST", self._transcribe),
            "/fake/gates/open": ("POST", self._open_gate),
            "/fake/last-body": ("GET", self._last_body),
        }
        # Routes whose body is not JSON (multipart uploads): the handler reads it raw.
        self._raw_body = {"/v1/audio/transcriptions"}

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
            _err(f"fakellm: internal error: {exc!r}")
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
        path = target.split("?", 1)[0]
        return Request(method.upper(), path, headers, body, keep_alive, http10)

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
                _JSON_TYPE,
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
        payload = _dumps({"error": error, "model": self.model})
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
                    self.last_body = body
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

    async def _pause(self, reader: asyncio.StreamReader, seconds: float) -> None:
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

    async def _hold(
        self, req: Request, body: dict[str, Any] | None, reader: asyncio.StreamReader
    ) -> None:
        await self._pause(reader, _hold_seconds(req, body))
        gate = req.headers.get("x-fake-gate")
        if gate:
            await self._wait_gate(reader, gate)

    def _gate(self, name: str) -> asyncio.Event:
        event = self._gates.get(name)
        if event is None:
            event = self._gates[name] = asyncio.Event()
        return event

    async def _wait_gate(self, reader: asyncio.StreamReader, name: str) -> None:
        """Wait until gate `name` is opened, noticing a client that left meanwhile."""
        event = self._gate(name)
        while not event.is_set():
            if reader.at_eof():
                raise ClientGone
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), POLL_SLICE)

    async def _last_body(
        self,
        req: Request,
        body: dict[str, Any] | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        await self._send_json(writer, 200, _dumps({"body": self.last_body}),
                              keep_alive=req.keep_alive, http10=req.http10)

    async def _open_gate(
        self,
        req: Request,
        body: dict[str, Any] | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        name = (body or {}).get("gate")
        if not isinstance(name, str) or not name:
            raise HttpError(400, "send {\"gate\": NAME}")
        self._gate(name).set()
        await self._send_json(writer, 200, _dumps({"gate": name, "open": True}),
                              keep_alive=req.keep_alive, http10=req.http10)

    def _count_completion_request(self) -> bool:
        """Count a request to a model endpoint; True if `--crash-after` says this one dies."""
        self.completion_requests += 1
        return self.crash_after is not None and self.completion_requests == self.crash_after

    async def _crash(self, writer: asyncio.StreamWriter, what: str) -> None:
        """Make sure what was written reaches the socket, then die like a segfaulting server."""
        with contextlib.suppress(Exception):
            await writer.drain()
        _out(f"fakellm: simulated crash (--crash-after {self.crash_after}) {what}")
        os._exit(CRASH_EXIT_CODE)

    def _unavailable(self) -> HttpError:
        return HttpError(503, "Loading model")

    # ----------------------------------------------------------------- endpoints

    async def _health(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self._hold(req, body, reader)
        if self.loaded:
            await self._send_json(
                writer,
                200,
                b'{"status":"ok","model":' + self._model_json + b"}",
                keep_alive=req.keep_alive,
                http10=req.http10,
            )
        else:
            await self._send_error(
                writer, 503, "Loading model", keep_alive=req.keep_alive, http10=req.http10
            )

    async def _models(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self._hold(req, body, reader)
        payload = {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": int(self._started),
                    "owned_by": "fakellm",
                }
            ],
            "model": self.model,
        }
        await self._send_json(
            writer, 200, _dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _transcribe(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        """A multipart upload: answers with the size of the file and the `model` field seen,
        so a test can tell the proxy relayed the form unchanged (or rewrote `model`)."""
        ctype = req.headers.get("content-type", "")
        if "multipart/form-data" not in ctype or "boundary=" not in ctype:
            raise HttpError(400, "expected multipart/form-data with a boundary")
        boundary = ctype.split("boundary=", 1)[1].strip().strip('"').encode()
        fields: dict[str, bytes] = {}
        for part in req.body.split(b"--" + boundary):
            head, sep, value = part.partition(b"\r\n\r\n")
            if sep and b'name="' in head:
                name = head.split(b'name="', 1)[1].split(b'"', 1)[0].decode()
                fields[name] = value.removesuffix(b"\r\n")
        if "file" not in fields:
            raise HttpError(400, "no `file` part in the upload")
        if not self.loaded:
            raise self._unavailable()
        payload = {
            "text": f"fake transcript of {len(fields['file'])} bytes",
            "model": self.model,
            "form_model": fields.get("model", b"").decode(errors="replace"),
        }
        await self._send_json(
            writer, 200, _dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _slots(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self._hold(req, body, reader)
        payload = [{"id": i, "is_processing": busy} for i, busy in enumerate(self.slots)]
        await self._send_json(
            writer, 200, _dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _chat(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise HttpError(400, "'messages' must be a list")
        await self._generate(
            req, body, reader, writer, chat=True, prompt_tokens=_word_count(messages)
        )

    async def _completions(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str | list):
            raise HttpError(400, "'prompt' must be a string or a list")
        await self._generate(
            req, body, reader, writer, chat=False, prompt_tokens=_word_count(prompt)
        )

    async def _embeddings(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        raw = body.get("input", body.get("content"))
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            inputs: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            inputs = raw
        else:
            raise HttpError(400, "'input' must be a string or a non-empty list")
        await self._hold(req, body, reader)
        if not self.loaded:
            raise self._unavailable()
        crash = self._count_completion_request()
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        tokens = 0
        for i, item in enumerate(inputs):
            text = item if isinstance(item, str) else " ".join(str(t) for t in item)
            tokens += _word_count(item)
            vector: Any = _embedding(text)
            if as_base64:
                vector = base64.b64encode(struct.pack(f"<{EMBEDDING_DIMS}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = max(tokens, 1)
        payload = _dumps(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)

    async def _rerank(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        query = body.get("query")
        documents = body.get("documents")
        if not isinstance(query, str):
            raise HttpError(400, "'query' must be a string")
        if not isinstance(documents, list):
            raise HttpError(400, "'documents' must be a list")
        texts = [_doc_text(d) for d in documents]
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)):
            raise HttpError(400, "'top_n' must be an integer")
        await self._hold(req, body, reader)
        if not self.loaded:
            raise self._unavailable()
        crash = self._count_completion_request()
        results: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            result: dict[str, Any] = {"index": i, "relevance_score": _relevance(query, text)}
            if body.get("return_documents"):
                result["document"] = {"text": text}
            results.append(result)
        if top_n is not None:
            results.sort(key=lambda r: r["relevance_score"], reverse=True)
            results = results[: max(top_n, 0)]
        tokens = max(1, sum(_word_count(query) + _word_count(t) for t in texts))
        payload = _dumps(
            {
                "model": self.model,
                "object": "list",
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)

    async def _send_complete_or_crash(
        self, req: Request, writer: asyncio.StreamWriter, payload: bytes, crash: bool
    ) -> None:
        if crash:
            writer.write(
                self._head(
                    200,
                    _JSON_TYPE,
                    length=len(payload),
                    keep_alive=req.keep_alive,
                    http10=req.http10,
                )
            )
            await self._crash(writer, "after sending the response headers")
        await self._send_json(writer, 200, payload, keep_alive=req.keep_alive, http10=req.http10)

    # ----------------------------------------------------------------- generation

    def _acquire_slot(self) -> int:
        for i, busy in enumerate(self.slots):
            if not busy:
                self.slots[i] = True
                break
        else:
            i = len(self.slots)
            self.slots.append(True)
        self.active_generations += 1
        return i

    def _release_slot(self, slot: int) -> None:
        self.slots[slot] = False
        self.active_generations -= 1

    async def _generate(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        chat: bool,
        prompt_tokens: int,
    ) -> None:
        """Chat and text completions: deterministic "tok0 tok1 ..." text, paced by --tps.

        The slot is taken before the hold, as llama-server marks a slot busy while it processes
        the prompt, so a held request already shows `is_processing: true` in /slots.
        """
        n_tokens = _max_tokens(body)
        stream = bool(body.get("stream"))
        hold = _hold_seconds(req, body)
        if not self.loaded:
            await self._pause(reader, hold)
            raise self._unavailable()
        crash = self._count_completion_request()
        prompt_tokens = max(prompt_tokens, 1)
        slot = self._acquire_slot()
        try:
            await self._pause(reader, hold)
            gate = req.headers.get("x-fake-gate")
            if gate:
                await self._wait_gate(reader, gate)
            self._request_seq += 1
            if stream:
                await self._stream(req, reader, writer, chat, n_tokens, prompt_tokens, crash)
            else:
                await self._complete(req, reader, writer, chat, n_tokens, prompt_tokens, crash)
        except ClientGone as exc:
            _out(f"fakellm: client went away after {exc.tokens} tokens")
            raise
        except ConnectionError:
            _out("fakellm: client went away after 0 tokens")
            raise ClientGone from None
        finally:
            self._release_slot(slot)

    def _timings(self, prompt_tokens: int, n_tokens: int, predicted_s: float) -> dict[str, Any]:
        """llama.cpp's `timings` block; prompt time is a fixed, deterministic 0.1 ms per token."""
        prompt_ms = prompt_tokens * 0.1
        predicted_ms = predicted_s * 1000.0
        return {
            "cache_n": 0,
            "prompt_n": prompt_tokens,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": 0.1,
            "prompt_per_second": 10000.0,
            "predicted_n": n_tokens,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / n_tokens, 3) if n_tokens else 0.0,
            "predicted_per_second": round(n_tokens / predicted_s, 3) if predicted_s > 0 else 0.0,
        }

    @staticmethod
    def _usage(prompt_tokens: int, n_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_tokens,
            "total_tokens": prompt_tokens + n_tokens,
        }

    async def _complete(
        self,
        req: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        chat: bool,
        n_tokens: int,
        prompt_tokens: int,
        crash: bool,
    ) -> None:
        """Non-streaming: sleep n/tps as if generating, then answer in one JSON document."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.tps > 0:
            await self._pause(reader, n_tokens / self.tps)
        elapsed = loop.time() - started
        text = "".join([f"tok{i} " for i in range(n_tokens)])
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            ident, obj = f"chatcmpl-fake-{self._request_seq}", "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            ident, obj = f"cmpl-fake-{self._request_seq}", "text_completion"
        payload = _dumps(
            {
                "id": ident,
                "object": obj,
                "created": created,
                "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [choice],
                "usage": self._usage(prompt_tokens, n_tokens),
                "timings": self._timings(prompt_tokens, n_tokens, elapsed),
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)

    async def _stream(
        self,
        req: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        chat: bool,
        n_tokens: int,
        prompt_tokens: int,
        crash: bool,
    ) -> int:
        """SSE over chunked encoding, one event per token; returns the number of tokens sent.

        Each event is `prefix + token + suffix` with prefix and suffix built once per request,
        so a token costs one bytes formatting and one write. `drain()` after each write is
        cheap unless the socket is backed up, and it is what raises when the client is gone.
        """
        chunked = not req.http10
        keep_alive = req.keep_alive and chunked
        created = int(time.time())
        if chat:
            ident = f"chatcmpl-fake-{self._request_seq}"
            obj = "chat.completion.chunk"
        else:
            ident = f"cmpl-fake-{self._request_seq}"
            obj = "text_completion"
        common = (
            b'{"id":"%s","object":"%s","created":%d,"model":%s,"system_fingerprint":%s,'
            b'"choices":[{"index":0,'
            % (ident.encode(), obj.encode(), created, self._model_json, self._fingerprint_json)
        )
        if chat:
            prefix = b"data: " + common + b'"delta":{"content":"'
            suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            prefix = b"data: " + common + b'"text":"'
            suffix = b'","logprobs":null,"finish_reason":null}]}\n\n'
        fixed = len(prefix) + len(suffix)

        def frame(event: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(event), event) if chunked else event

        writer.write(
            self._head(200, _SSE_TYPE, length=None, keep_alive=keep_alive, http10=req.http10)
        )
        if chat:
            writer.write(
                frame(
                    b"data: "
                    + common
                    + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                    b'"finish_reason":null}]}\n\n'
                )
            )
        await writer.drain()

        stop_at = n_tokens // 2 if crash else n_tokens
        loop = asyncio.get_running_loop()
        started = loop.time()
        interval = 1.0 / self.tps if self.tps > 0 else 0.0
        for i in range(stop_at):
            if interval:
                await self._pause_tokens(reader, started + (i + 1) * interval - loop.time(), i)
            elif reader.at_eof():
                raise ClientGone(i)
            tok = b"tok%d " % i
            if chunked:
                writer.write(b"%x\r\n%s%s%s\r\n" % (fixed + len(tok), prefix, tok, suffix))
            else:
                writer.write(prefix + tok + suffix)
            try:
                await writer.drain()
            except ConnectionError:
                raise ClientGone(i) from None
            if not interval and i & 63 == 63:
                await asyncio.sleep(0)  # let other connections run during a long fast burst
        if crash:
            await self._crash(writer, f"after streaming {stop_at} of {n_tokens} tokens")
        elapsed = loop.time() - started

        tail = b'"finish_reason":"length"}],"usage":%s,"timings":%s}\n\n' % (
            _dumps(self._usage(prompt_tokens, n_tokens)),
            _dumps(self._timings(prompt_tokens, n_tokens, elapsed)),
        )
        if chat:
            final = b"data: " + common + b'"delta":{},"logprobs":null,' + tail
        else:
            final = b"data: " + common + b'"text":"","logprobs":null,' + tail
        writer.write(frame(final) + frame(_DONE_EVENT) + (_LAST_CHUNK if chunked else b""))
        try:
            await writer.drain()
        except ConnectionError:
            raise ClientGone(n_tokens) from None
        req.keep_alive = keep_alive  # an HTTP/1.0 stream ends when the connection does
        return n_tokens

    async def _pause_tokens(self, reader: asyncio.StreamReader, seconds: float, sent: int) -> None:
        try:
            await self._pause(reader, seconds)
        except ClientGone:
            raise ClientGone(sent) from None


def _out(line: str) -> None:
    print(line, flush=True)


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number: {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpuproxy.testing.fakellm",
        description="A fake OpenAI-compatible inference server for tests and benchmarks.",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name to report")
    parser.add_argument(
        "--tps",
        type=_non_negative_float,
        default=0.0,
        help="generated tokens per second (default 0: as fast as possible)",
    )
    parser.add_argument(
        "--load-seconds",
        type=_non_negative_float,
        default=0.0,
        help="answer 503 'Loading model' for this long after binding",
    )
    parser.add_argument(
        "--ignore-sigterm", action="store_true", help="ignore SIGTERM (SIGINT/SIGKILL still work)"
    )
    parser.add_argument(
        "--crash-after",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the Nth model request sends its headers (and half its tokens), then exits 3",
    )
    parser.add_argument(
        "--exit-on-start",
        type=int,
        default=None,
        metavar="CODE",
        help="exit with CODE right after binding (a server that dies while loading)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Console entry point: parse, serve, exit with the server's code."""
    args = build_parser().parse_args(argv)
    code = asyncio.run(FakeLLM(args).run())
    sys.exit(code)


if __name__ == "__main__":
    main()
