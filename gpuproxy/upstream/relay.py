"""The upstream HTTP client: httpx requests over one pooled aiohttp session for all
upstreams, timeouts fit for LLMs.

Connect is short (the upstream is local and was just health-checked); the read timeout is per
socket read, so it bounds the wait for the first token and any silence mid-stream, not the
length of a generation. Bytes are relayed raw (no decompression, no re-chunking).

The transport is aiohttp's, behind httpx's transport API (`httpx-aiohttp`): httpx's own
transport cost 1.6-9x more proxy CPU per request here (`bench/upstream_transport.py`,
encode/httpx#3215). Requests go straight to the transport (`handle_async_request`), not
through `AsyncClient.send`: its auth, redirect and cookie layers do nothing a proxy wants and
cost 40 % of the client's CPU per request (the same bench).

Also here, because they are about the connection, not the request: which connections may be
reused (`closes_after_streams`, `KEEPALIVE_EXPIRY`), when a request may be sent once more
(`may_retry`), what a failure was in our own words (`failure`: never an exception's text), and
no cookie jar.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import re
import select
import time
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import aiohttp
import httpx
from aiohttp import hdrs, http_exceptions
from aiohttp.client_proto import ResponseHandler
from httpx_aiohttp import AiohttpTransport

logger = logging.getLogger("gpuproxy.proxy")

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0  # longest time-to-first-token or silence we accept from an upstream
# An idle pooled connection is dropped after this long: under the 5 s that llama.cpp's server
# and uvicorn (vLLM) wait before they close an idle keep-alive connection themselves, so a
# request is never written on a connection the server is closing at that moment.
KEEPALIVE_EXPIRY = 4.0
# A failure this soon after a reused connection was handed out, before any answer, is the
# server having closed it (the request was never read): safe to send once more, fresh.
RETRY_WINDOW = 0.1

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
# The upstream's `Server` (llama.cpp, uvicorn and their versions) is not the client's business:
# the answer comes from gpuproxy, which names itself.
RESPONSE_DROP = (HOP_BY_HOP - {b"content-length"}) | {b"server", b"x-powered-by"}
# A passthrough (`/upstream/...`) body that asks for a stream, without parsing it.
_STREAM_FLAG = re.compile(rb'"stream"\s*:\s*true')
# What aiohttp would add of its own: the upstream sees the client's headers, not ours (as
# llama-swap's Go reverse proxy does). Without it, an `Accept-Encoding` the client never sent
# would let an upstream compress an answer for a client that cannot read it.
_SKIP_AUTO_HEADERS = frozenset({hdrs.USER_AGENT, hdrs.ACCEPT_ENCODING, hdrs.ACCEPT})
_CLOSE = (b"connection", b"close")


# The connection the request this task is sending went out on, set by `_Connector.connect`
# (aiohttp awaits it in the sending task): (reused, its previous request was a stream, when it
# was handed out). And what the task sends: (the model, whether it asks for a stream).
_connection: ContextVar[tuple[bool, bool, float] | None] = ContextVar(
    "gpuproxy_upstream_connection", default=None)
_sending: ContextVar[tuple[str, bool]] = ContextVar("gpuproxy_sending", default=("", False))


class _Handler(ResponseHandler):
    """aiohttp's connection protocol, less two calls per relayed chunk.

    aiohttp's body reader asks its protocol to resume reading each time it hands out a
    buffered piece below its low-water mark, paused or not, and a resume feeds the HTTP parser
    an empty string and asks the transport to resume. A chunked answer is buffered one HTTP
    chunk a piece, and an SSE upstream (llama.cpp, vLLM) sends one event per chunk: a parser
    call per token, for nothing while the connection never paused. Once it has paused it
    resumes as aiohttp does, every time: the compiled parser keeps a pause flag of its own
    that only a later body callback clears, and an empty feed is what restarts it (a pause
    set at a chunk's end, just as a read ends, would otherwise hold the rest of the answer
    until more bytes came). tests/test_relay_flow.py holds both."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._has_paused = False

    def pause_reading(self) -> None:
        self._has_paused = True
        super().pause_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._has_paused:
            super().resume_reading(resume_parser)


class _Connector(aiohttp.TCPConnector):
    """The pooled connector, which remembers of each connection whether it carried a request
    before and whether that one was a stream: only a reused connection can be one the server
    already closed, and one that carried a stream is how a server that closes after streams
    shows itself."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._last: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()

    async def connect(self, req, traces, timeout):  # type: ignore[no-untyped-def]  # noqa: ASYNC109
        model, stream = _sending.get()
        last = self._last
        conn = await super().connect(req, traces, timeout)
        previous = last.get(conn.protocol)
        while previous and model in _closers:
            # it carried a stream of a server that closes after one (see below): never reuse
            conn.close()
            conn = await super().connect(req, traces, timeout)
            previous = last.get(conn.protocol)
        _connection.set((previous is not None, previous is True, time.monotonic()))
        last[conn.protocol] = stream
        return conn


def _session(pooled: bool) -> aiohttp.ClientSession:
    """No cookie jar: aiohttp's default one would keep a `Set-Cookie` from any upstream and
    send it on every later request, from every client, to every upstream (they are all
    `localhost`). trust_env off: a system HTTP proxy must never sit between us and localhost."""
    # aiohttp caps connections at 100 unless told: the scheduler is the real limit.
    connector = (_Connector(limit=10_000, keepalive_timeout=KEEPALIVE_EXPIRY) if pooled
                 else aiohttp.TCPConnector(limit=10_000, force_close=True))
    # every connection's protocol (aiohttp's own factory, set in BaseConnector.__init__)
    connector._factory = functools.partial(_Handler, loop=connector._loop)  # type: ignore[assignment]
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                 trust_env=False, auto_decompress=False,
                                 skip_auto_headers=_SKIP_AUTO_HEADERS)


_transports: dict[bool, AiohttpTransport] = {}
_transport_loop: asyncio.AbstractEventLoop | None = None


def transport(fresh: bool = False) -> AiohttpTransport:
    """The shared transport, created lazily for the running loop (its pool belongs to it).

    `fresh`: one whose every request has a new connection, closed after its response: for
    the streams of a model that closes after streams (`closes_after_streams`), and for the
    one retry.
    """
    global _transport_loop
    loop = asyncio.get_running_loop()
    if _transport_loop is not loop:
        _transports.clear()
        _transport_loop = loop
    made = _transports.get(fresh)
    if made is None:
        made = _transports[fresh] = AiohttpTransport(
            client=lambda: _session(pooled=not fresh), trust_env=False)
    return made


@functools.lru_cache(maxsize=64)
def timeout(idle: float) -> dict[str, float | None]:
    """A request's timeouts (httpx's `timeout` extension) with `idle` as the longest silence
    (first byte or mid-stream); no limit on the whole exchange."""
    return httpx.Timeout(CONNECT_TIMEOUT, read=idle, write=60.0, pool=None).as_dict()


@functools.lru_cache(maxsize=64)
def peer_timeout(connect: float) -> dict[str, float | None]:
    """A peer's timeouts (`peers.<id>.timeouts`, llama-swap's Go transport): `connect`
    seconds to connect (0: none), and no read or write limit: a peer's `responseHeader` is
    the caller's bound on the wait for the head, and a body, as in llama-swap, may be as
    slow as the peer likes."""
    return httpx.Timeout(connect or None, read=None, write=None, pool=None).as_dict()


async def send(method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes,
               idle: float, *, fresh: bool = False,
               timeouts: dict[str, float | None] | None = None) -> httpx.Response:
    """Send one request and return its response once the head has arrived; its body is
    `response.stream`, read by the caller as it comes. Raises httpx's `TransportError`s
    with aiohttp's error as their cause (`failure` says what they were). `timeouts`
    replaces the local upstream's (`idle`) for a peer (`peer_timeout`)."""
    if fresh:
        headers = [*headers, _CLOSE]
    return await transport(fresh).handle_async_request(httpx.Request(
        method, _url(url), headers=headers, content=body,
        extensions={"timeout": timeouts if timeouts is not None else timeout(idle)}))


@functools.lru_cache(maxsize=1024)
def _url(url: str) -> httpx.URL:
    """httpx parses a URL in pure Python, a tenth of its cost per request; a proxy sends the
    same few (an upstream's base and an inference path) over and over."""
    return httpx.URL(url)


async def close() -> None:
    global _transport_loop
    if _transport_loop is asyncio.get_running_loop():
        for made in _transports.values():
            await made.aclose()
    _transports.clear()
    _transport_loop = None


def passthrough_streams(body: bytes) -> bool:
    """Whether a passthrough request's JSON body asks for a stream (`"stream": true`)."""
    return b'"stream"' in body and _STREAM_FLAG.search(body) is not None


def begin_attempt(model: str, stream: bool) -> None:
    """Before a send from this task: forget the previous request's connection, and say for
    which model and whether it asks for a stream (its connection remembers that)."""
    _connection.set(None)
    _sending.set((model, stream))


# ---- upstreams that close after a stream ---------------------------------------------------------
#
# llama.cpp's server (cpp-httplib) answers every request with `Keep-Alive: timeout=5, max=100`
# and still closes the connection after every streamed response. Written on such a pooled
# connection before its close was seen, the next request fails: ~1 % (up to 7 %) false 502s
# under queued load, when the scheduler dispatches the next request the moment a stream ends.
# So a model known or seen to do that never has a stream's connection reused: its streams get
# a fresh connection each (`Connection: close`), and a pooled connection that carried one of
# its streams (the one it was learned from) is closed when next handed out. Everyone else keeps
# pooled streams: a connect per stream costs the proxy about a tenth of a short stream's CPU.

# `Server` header prefixes of servers known to close after every streamed response
CLOSES_AFTER_STREAMS = ("llama.cpp",)
_closers: set[str] = set()


def closes_after_streams(model: str) -> bool:
    return model in _closers


def _learn(model: str, how: str) -> None:
    if model not in _closers:
        _closers.add(model)
        logger.info('model "%s" closes the connection after a streamed response (%s): its '
                    "streams get a connection each from now on", model, how)


def note_stream_answer(model: str, headers: Mapping[str, str]) -> None:
    """A streamed request's answer arrived: learn the model's server from it."""
    if model not in _closers and headers.get("server", "").startswith(CLOSES_AFTER_STREAMS):
        _learn(model, f"its server is {headers['server']}")


def note_failure(model: str, fail: Failure) -> None:
    """A request that got no answer: a reused connection whose previous response was a
    stream, closed or reset by the server, shows a server that closes after streams."""
    conn = _connection.get()
    if fail.kind in (CLOSED, RESET) and conn is not None and conn[1]:
        _learn(model, "a connection that had carried a stream was closed when reused")


# ---- what went wrong, in our own words ---------------------------------------------------------

REFUSED = "refused"
CONNECT_TIMEOUT_KIND = "connect_timeout"
CLOSED = "closed"
RESET = "reset"
TIMEOUT = "timeout"
BAD_RESPONSE = "bad_response"
CUT = "cut"
OTHER = "other"

_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})

# aiohttp's parser errors, most specific first: what the upstream sent, said by us. Their own
# messages quote the upstream's bytes, which may echo what we sent it (headers, a key).
_BAD_HTTP: tuple[tuple[type[BaseException], str], ...] = (
    (http_exceptions.LineTooLong, "sent a header line longer than aiohttp's limit of 8190 "
                                  "bytes"),
    (http_exceptions.BadStatusLine, "did not answer with an HTTP status line"),
    (http_exceptions.InvalidHeader, "sent an invalid header"),
    (http_exceptions.ContentLengthError, "ended the body before its Content-Length"),
    (http_exceptions.TransferEncodingError, "broke off or garbled its chunked body"),
    (http_exceptions.BadHttpMessage, "sent a malformed HTTP response (a duplicate "
                                     "Content-Length, bad chunk framing, a bad header...)"),
)


@dataclass(frozen=True, slots=True)
class Failure:
    """An upstream request's failure: `kind` for decisions, `words` (what the upstream did,
    in our words) and `type_name` (the underlying exception's type) for people. Never the
    exception's text or repr: aiohttp's hold the request we sent (headers: the client's key,
    its cookies) and the upstream's raw bytes. `partial`: part of an answer had come."""

    kind: str
    words: str
    type_name: str
    partial: bool = False

    def describe(self) -> str:
        return f"{self.words} ({self.type_name})"


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(out) < 8:
        out.append(seen)
        seen = seen.__cause__
    return out


def failure(exc: BaseException) -> Failure:
    """Classify what httpx (over httpx-aiohttp) raised. The mapping to httpx types says little:
    a connection the server closed becomes `ConnectTimeout`, so the aiohttp exception under
    it (`__cause__`) decides."""
    chain = _chain(exc)
    inner = next((e for e in chain if isinstance(e, aiohttp.ClientError)), None)
    name = type(inner if inner is not None else exc).__name__
    for e in chain:
        for kind, words in _BAD_HTTP:
            if isinstance(e, kind):
                cut = isinstance(e, http_exceptions.PayloadEncodingError)
                return Failure(CUT if cut else BAD_RESPONSE, words, type(e).__name__)
    if isinstance(inner, aiohttp.ClientConnectorError):
        if inner.os_error.errno == errno.ECONNREFUSED or isinstance(
                inner.os_error, ConnectionRefusedError):
            return Failure(REFUSED, "refused the connection (nothing listens on that port)", name)
        return Failure(REFUSED, "could not be connected to", name)
    if isinstance(inner, aiohttp.ConnectionTimeoutError) or (
            inner is None and isinstance(exc, httpx.ConnectTimeout)):
        return Failure(CONNECT_TIMEOUT_KIND,
                       f"did not accept the connection within {CONNECT_TIMEOUT:g} s", name)
    if isinstance(inner, aiohttp.ServerTimeoutError) or (
            inner is None and isinstance(exc, httpx.TimeoutException)):
        return Failure(TIMEOUT, "sent nothing in time", name)
    if isinstance(inner, aiohttp.ServerDisconnectedError):
        # its `message` is the part of a response parsed before the close, if any
        return Failure(CLOSED, "closed the connection", name,
                       partial=not isinstance(inner.message, str))
    if isinstance(inner, aiohttp.ClientConnectionResetError) or (
            isinstance(inner, aiohttp.ClientOSError) and inner.errno in _RESET_ERRNOS):
        return Failure(RESET, "reset the connection", name)
    if isinstance(inner, aiohttp.ClientPayloadError):
        return Failure(CUT, "broke off the body", name)
    if isinstance(inner, aiohttp.ClientResponseError):
        return Failure(BAD_RESPONSE, "sent a response that is not valid HTTP", name)
    if isinstance(inner, aiohttp.ClientConnectionError) or (
            inner is None and isinstance(exc, httpx.NetworkError)):
        return Failure(CLOSED, "lost the connection", name)
    return Failure(OTHER, "failed", name)


def may_retry(fail: Failure) -> bool:
    """Whether the request that just failed this way may be sent once more, fresh: only when
    its connection was a reused one, the failure is the server's close or reset (never a
    timeout, never a bad answer) and it came within RETRY_WINDOW of the hand-out, so the
    server cannot have read the request. The caller adds what only it knows (no response
    byte, the same live process, a buffered body, an inference path)."""
    if fail.kind not in (CLOSED, RESET) or fail.partial:
        return False
    conn = _connection.get()
    return conn is not None and conn[0] and time.monotonic() - conn[2] <= RETRY_WINDOW


async def exited(pid: int | None, within: float = 0.0) -> bool:
    """Whether process `pid` (our child) has exited, or does within `within` seconds: the
    kernel's exit notification (a pidfd), not a poll. A reaped pid counts as exited."""
    if pid is None:
        return True
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd (an old kernel): whether it has exited now
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT  # never blocks, never reaps
            return os.waitid(os.P_PID, pid, flags) is not None  # noqa: ASYNC222
        except ChildProcessError:
            return True
    try:
        if select.select([fd], [], [], 0)[0]:  # a pidfd is readable once the process exited
            return True
        if within <= 0:
            return False
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(done, within)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
        return True
    finally:
        os.close(fd)


def request_headers(headers: list[tuple[bytes, bytes]], body_len: int,
                    drop: frozenset[bytes] = HOP_BY_HOP,
                    cookies: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The client's headers for the upstream: all but hop-by-hop ones and `drop` (which
    includes HOP_BY_HOP; `proxy.auth.credential_drop` adds the proxy's own credentials),
    and without the cookies named in `cookies` (the proxy's own: the upstream's still go)."""
    out = []
    for k, v in headers:
        name = k.lower()
        if name in drop:
            continue
        if name == b"cookie" and cookies:
            v = without_cookies(v, cookies)
            if not v:
                continue
        out.append((k, v))
    out.append((b"content-length", str(body_len).encode()))
    return out


def without_cookies(header: bytes, names: frozenset[bytes]) -> bytes:
    """A Cookie header's value without the cookies called `names`."""
    kept = [part for part in (p.strip() for p in header.split(b";"))
            if part and part.split(b"=", 1)[0].strip() not in names]
    return b"; ".join(kept)


def response_headers(raw: list[tuple[bytes, bytes]],
                     content_type: str) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw if k.lower() not in RESPONSE_DROP]
    if content_type.startswith("text/event-stream"):
        out.append((b"x-accel-buffering", b"no"))
    return out
