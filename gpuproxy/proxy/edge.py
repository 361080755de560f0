"""The HTTP edge: what `gpuproxy serve` decides about a request before the application sees it.

Daphne hands a request to the application only once Twisted has read the whole body (spooled,
then pushed into the application's queue in one loop: a 512 MB body took the process from 103
to 629 MB before the consumer's own limit could answer 413), and Twisted answers
`Expect: 100-continue` by itself. So the checks that protect the process run here, in
Twisted's HTTP channel, on the request head:

- a draining proxy (SIGTERM) answers 503 `shutting_down` to every new request;
- a request that announces a body on a path that needs an API key, without a valid key, gets
  401 before a byte of the body is read, and with a key that is not an admin key on a path
  for admin keys, 403 (bodiless requests are left to the application, whose own check
  answers them the same way and keeps the connection). Which paths: the proxy's own, and the
  Django views that `decorators.api_view` marks (`requires_api_key`, `requires_admin_key`);
- a Content-Length over GPUPROXY_MAX_BODY_BYTES gets 413 at once; a chunked body is counted
  as it arrives and cut at the limit;
- only then is `100 Continue` sent, so a client that asked gets the final status instead;
- the request line and headers must arrive within GPUPROXY_HEADER_TIMEOUT_SECONDS of their
  first byte (408 otherwise): Twisted's idle timeout restarts with every byte, so a client
  sending one byte a second held a connection forever. Bodies and responses are not timed;
- a request line or a header line over Twisted's 16 KB line limit got the connection closed
  with no status: 414 / 431 now, and the other malformed-head cases get their 400 in the
  OpenAI envelope too.

These refusals carry the CORS headers the exposure policy gives the path
(gpuproxy/proxy/exposure.py,
which the application applies to everything else: the Host allow-list, the Origin check), so
a page on another origin can read why. A refused request is answered with `Connection:
close`, the write side is shut, and what the client still sends is read and dropped for a
while (a lingering close, as nginx does), so a client busy uploading reads the answer instead
of a connection reset. Refusals on the proxy's own paths write the same activity row the
consumer would (`unauthorized`, `bad_request`, `shutting_down`).

The requests in flight are counted here too (`in_flight()`), for the drain at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any
from urllib.parse import unquote

from twisted.web import http

from activity import outcomes
from gpuproxy.proxy.errors import error_body_for

logger = logging.getLogger("gpuproxy.proxy.edge")

LINGER_IDLE = 2.0  # seconds without a byte from the client before a refused connection closes
LINGER_MAX = 30.0  # and at the longest, however much it still sends

_REASONS = {400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
            408: b"Request Timeout", 413: b"Content Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class Limits:
    body_bytes = 32 * 1024 * 1024
    header_timeout = 30.0
    # The key hashes and the admin ones read at start, for the moments before the runtime
    # (and its catalog, which follows later changes) exists: connections are accepted, and
    # /health answers, before it is built.
    keys_at_start: dict[str, str] = {}  # replaced by install(), never mutated
    admin_keys_at_start: frozenset[str] = frozenset()


limits = Limits()

# ---- draining, and what is in flight ---------------------------------------------------------

_draining = False
OPEN_ENDED = (b"/logs/stream", b"/api/events")  # streams a drain does not wait for
_in_flight: dict[Any, tuple[float, str]] = {}  # WebRequest -> (monotonic start, "METHOD /path")
_idle_waiters: list[asyncio.Future[None]] = []


def start_draining() -> None:
    """From now on every new request gets 503 `shutting_down`."""
    global _draining
    _draining = True


def draining() -> bool:
    return _draining


def in_flight() -> list[tuple[float, str]]:
    """(seconds running, "METHOD /path") of every request being answered, longest first.
    Open-ended log tails (`/logs/stream`), event streams (`/api/events`) and WebSocket
    upgrades are not counted: they never finish on their own."""
    now = time.monotonic()
    return sorted(((now - t, what) for t, what in _in_flight.values()), reverse=True)


async def wait_idle() -> None:
    """Return once no request is in flight."""
    if not _in_flight:
        return
    future = asyncio.get_running_loop().create_future()
    _idle_waiters.append(future)
    await future


def _track(request: Any) -> None:
    path = request.path or b""
    upgrade = request.requestHeaders.getRawHeaders(b"upgrade") or []
    if path.startswith(OPEN_ENDED) or any(v.lower() == b"websocket" for v in upgrade):
        return
    what = f"{request.method.decode('ascii', 'replace')} {path.decode('ascii', 'replace')}"
    _in_flight[request] = (time.monotonic(), what[:200])


def _untrack(request: Any) -> None:
    if _in_flight.pop(request, None) is not None and not _in_flight:
        waiters = list(_idle_waiters)
        _idle_waiters.clear()
        for future in waiters:
            if not future.done():
                future.set_result(None)


# ---- which paths need a key, and whether the head carries one ---------------------------------

_proxy_pattern: re.Pattern[str] | None = None
KEY, ADMIN = "key", "admin"


def _is_proxy_path(path: str) -> bool:
    global _proxy_pattern
    if _proxy_pattern is None:
        from gpuproxy.proxy.inference import PROXY_PATTERN

        _proxy_pattern = re.compile(PROXY_PATTERN)
    return bool(_proxy_pattern.match(path.lstrip("/")))


def _required(path: str) -> str | None:
    """What the application will ask of this path once keys exist: KEY, ADMIN or nothing.
    The proxy's own paths (inference.PROXY_PATTERN, `/upstream/` for admins), and the views
    made with `decorators.api_view`, which mark themselves (`requires_api_key`,
    `requires_admin_key`)."""
    if _is_proxy_path(path):
        from gpuproxy.proxy.exposure import proxy_path_needs_admin

        return ADMIN if proxy_path_needs_admin(path) else KEY
    from django.urls import Resolver404, resolve

    try:
        view: Any = resolve(path).func
    except Resolver404:
        return None
    except Exception:  # a path Django cannot even route: the application answers it
        return None
    while view is not None:
        if getattr(view, "requires_api_key", False):
            return ADMIN if getattr(view, "requires_admin_key", False) else KEY
        view = getattr(view, "__wrapped__", None)
    return None


def _keys() -> tuple[dict[str, str], frozenset[str]]:
    """The key hashes and the admin ones: the running catalog's, or those read at start
    before the runtime exists."""
    from gpuproxy.shell import runtime

    rt = runtime.current()
    if rt is None:
        return limits.keys_at_start, limits.admin_keys_at_start
    return rt.catalog.api_keys, rt.catalog.admin_keys


def _key_refusal(request: Any, path: str, keys: dict[str, str],
                 admin_keys: frozenset[str]) -> Refusal | None:
    from gpuproxy.proxy import fleet_forward, staff_session
    from gpuproxy.proxy.auth import KeyRefusal, authorize

    if not keys:
        return None  # no keys: the application decides
    need = _required(path)
    if need is None:
        return None
    headers = request.requestHeaders
    authorization = (headers.getRawHeaders(b"authorization") or [b""])[0]
    x_api_key = (headers.getRawHeaders(b"x-api-key") or [b""])[0]
    verdict = authorize(authorization.decode("latin-1"), x_api_key.decode("latin-1"), keys,
                        admin_keys, admin=need == ADMIN, path=path)
    if (isinstance(verdict, KeyRefusal) and not staff_session.at_edge(request, path, need == ADMIN)
            and not fleet_forward.at_edge(headers)):  # a node's forward: the entry node's word
        return Refusal(verdict.status, verdict.code, verdict.message, verdict.type,
                       verdict.headers, outcome=outcomes.UNAUTHORIZED)
    return None


def _cors_headers(request: Any, path: str, keys: dict[str, str]) -> dict[str, str]:
    """The CORS headers the application would give this request's answer, so that a page
    can read a refusal the edge answers (gpuproxy/proxy/exposure.py decides them)."""
    from gpuproxy.proxy import exposure

    raw = list(request.requestHeaders.getAllRawHeaders())
    headers = [(name.lower(), values[0]) for name, values in raw if values]
    req = exposure.request_from_headers(request.method.decode("latin-1"), path, "http",
                                        headers)
    if req.origin is None or exposure.host_refusal(req.host) is not None:
        return {}
    verdict = exposure.decide(req, bool(keys))
    if verdict.status or verdict.preflight:
        return {}
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in verdict.headers}


# ---- the channel ------------------------------------------------------------------------------

class Refusal:
    def __init__(self, status: int, code: str, message: str, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, outcome: str = "") -> None:
        self.status, self.code, self.message, self.type = status, code, message, type_
        self.headers = headers or {}
        self.outcome = outcome  # the activity row's outcome, on the proxy's own paths


def _too_long(request_line: bool) -> Refusal:
    line, total, count = (http.HTTPChannel.MAX_LENGTH, http.HTTPChannel.totalHeadersSize,
                          http.HTTPChannel.maxHeaders)
    if request_line:
        return Refusal(414, "uri_too_long",
                       f"the request line is over {line} bytes: send long input in the "
                       "request body, not in the URL")
    return Refusal(431, "header_fields_too_large",
                   f"the request headers are too large: at most {line} bytes a line, {total} "
                   f"bytes for the request line and all headers together, {count} headers")


class EdgeChannel(http.HTTPChannel):
    """Twisted's HTTP/1.1 channel with the checks above. Twisted's own parsing is unchanged;
    each override adds a check before (or a status instead of) what Twisted does."""

    def __init__(self) -> None:
        super().__init__()
        self._awaiting_head = True  # between requests, or reading a request's head
        self._seen_request_line = False
        self._head_timer: Any = None
        self._refused = False
        self._linger_timer: Any = None
        self._linger_until = 0.0
        self._body_seen = 0

    # -- the head deadline --

    def dataReceived(self, data: bytes) -> None:
        if self._refused:
            self._lingering()
            return
        super().dataReceived(data)
        # Timed only when these bytes left a head unfinished: nearly every request's head
        # arrives in one read, and a timer set and cancelled per request is two reactor
        # calls on the hot path. The deadline still counts from (within microseconds of)
        # the head's first byte.
        if (self._awaiting_head and self._head_timer is None and not self._handlingRequest
                and not self._refused and self.transport is not None
                and not self.transport.disconnecting):
            self._head_timer = self.callLater(limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self._refused and not self._handlingRequest:
            self.refuse(Refusal(
                408, "request_header_timeout",
                f"the request line and headers did not arrive within "
                f"{limits.header_timeout:g} s of their first byte "
                "(GPUPROXY_HEADER_TIMEOUT_SECONDS); send the whole head at once"))

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            if self._head_timer.active():
                self._head_timer.cancel()
            self._head_timer = None

    # -- lines too long, heads too big --

    def lineReceived(self, line: bytes) -> None:
        if self._refused:
            return
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self.refuse(_too_long(not self._seen_request_line))
            return
        if line:
            self._seen_request_line = True
        super().lineReceived(line)

    def lineLengthExceeded(self, line: bytes) -> None:
        self.refuse(_too_long(not self._seen_request_line))

    def headerReceived(self, line: bytes) -> bool:
        if self._receivedHeaderCount + 1 > self.maxHeaders:
            self.refuse(_too_long(False))
            return False
        return super().headerReceived(line)

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.refuse(Refusal(400, "bad_request",
                            "malformed HTTP request: the request line, a header or the chunked "
                            "body framing does not follow HTTP/1.1 (RFC 9112)"))

    # -- the checks on a complete head --

    def allHeadersReceived(self) -> None:
        """Twisted's, with the early refusals before `100 Continue` (which Twisted sends
        unconditionally)."""
        self._cancel_head_timer()
        self._awaiting_head = False
        req = self.requests[-1]
        req.parseCookies()
        self.persistent = self.checkPersistence(req, self._version)
        refusal = self._early_refusal(req)
        if refusal is not None:
            self._record(req, refusal)
            self.refuse(refusal)
            return
        self._body_seen = 0
        req.gotLength(self.length)
        expect = req.requestHeaders.getRawHeaders(b"expect")
        if expect and expect[0].lower() == b"100-continue" and self._version == b"HTTP/1.1":
            self._send100Continue()

    def _early_refusal(self, req: Any) -> Refusal | None:
        if _draining:
            from scheduling.core.errors import ShuttingDown

            exc = ShuttingDown()
            return Refusal(exc.status, exc.code, exc.message, exc.type, exc.headers(),
                           outcome=outcomes.SHUTTING_DOWN)
        path = unquote(self._path.split(b"?", 1)[0].decode("latin-1"))
        keys, admin_keys = _keys()
        refusal = None
        announced = self.length is None or self.length > 0  # chunked, or a Content-Length
        if announced:
            refusal = _key_refusal(req, path, keys, admin_keys)
        if refusal is None and self.length is not None and self.length > limits.body_bytes:
            refusal = _body_too_large()
        if refusal is not None:
            refusal.headers.update(_cors_headers(req, path, keys))
        return refusal

    def body_chunk(self, size: int) -> bool:
        """Count a piece of the body as it arrives; False (and a 413) past the limit."""
        if self._refused:
            return False
        self._body_seen += size
        if self._body_seen > limits.body_bytes:
            refusal = _body_too_large()
            self._record(self.requests[-1], refusal)
            self.refuse(refusal)
            return False
        return True

    def allContentReceived(self) -> None:
        if self._refused:
            return
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        # Set before Twisted replays pipelined bytes (through dataReceived) for the next one.
        self._awaiting_head = True
        self._seen_request_line = False
        super().requestDone(request)

    def connectionLost(self, reason: Any = None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None and self._linger_timer.active():
            self._linger_timer.cancel()
        self._linger_timer = None
        super().connectionLost(reason)

    # -- answering and closing --

    def refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` and close: the write side now, the read side once the client has
        stopped sending (at most LINGER_MAX seconds)."""
        if self._refused or self.transport is None:
            return
        self._refused = True
        self._cancel_head_timer()
        self.persistent = False
        path = unquote((getattr(self, "_path", None) or b"").split(b"?", 1)[0]
                       .decode("latin-1"))
        body = error_body_for(path, refusal.status, refusal.message, refusal.type,
                              refusal.code)
        lines = [b"HTTP/1.1 %d %s" % (refusal.status, _REASONS.get(refusal.status, b"Error")),
                 b"Content-Type: application/json", b"Content-Length: %d" % len(body),
                 b"Connection: close", b"Server: gpuproxy", b"X-Content-Type-Options: nosniff"]
        lines += [f"{k}: {v}".encode("latin-1") for k, v in refusal.headers.items()]
        transport: Any = self.transport  # Twisted's stubs: ITransport, whose methods lack self
        transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        self.clearLineBuffer()
        self.setTimeout(None)  # the idle timeout: the linger below bounds this connection now
        self._linger_until = time.monotonic() + LINGER_MAX
        self._linger_timer = self.callLater(LINGER_IDLE, self._end_linger)
        self._networkProducer.resumeProducing()  # read (and drop) what the client still sends
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is not None:
            lose_write()
        else:
            transport.loseConnection()

    def _lingering(self) -> None:
        timer = self._linger_timer
        if timer is None or not timer.active():
            return
        if time.monotonic() > self._linger_until:
            self._end_linger()
        else:
            timer.reset(LINGER_IDLE)

    def _end_linger(self) -> None:
        if self._linger_timer is not None and self._linger_timer.active():
            self._linger_timer.cancel()
        self._linger_timer = None
        if self.transport is not None:
            self.transport.abortConnection()

    def _record(self, req: Any, refusal: Refusal) -> None:
        """The activity row the consumer writes for the same refusal (proxy paths only)."""
        if not refusal.outcome:
            return
        path = unquote(self._path.split(b"?", 1)[0].decode("latin-1"))
        if not _is_proxy_path(path):
            return
        from activity.record import RequestRecord
        from activity.writer import writer
        from gpuproxy.observe import metrics
        from gpuproxy.proxy.client_ip import from_twisted

        transport: Any = self.transport  # (see refuse: Twisted's interface stubs)
        peer = transport.getPeer() if transport is not None else None
        user_agent = (req.requestHeaders.getRawHeaders(b"user-agent") or [b""])[0]
        rec = RequestRecord(self._command.decode("latin-1"), path, from_twisted(peer, req),
                            user_agent.decode("latin-1"))
        rec.fail(refusal.status, refusal.outcome, refusal.message)
        row = rec.row()
        writer().submit(row)
        metrics.observe_request(row)


def _body_too_large() -> Refusal:
    return Refusal(413, "body_too_large",
                   f"the request body is over {limits.body_bytes} bytes; send less or raise "
                   "GPUPROXY_MAX_BODY_MB", outcome=outcomes.BAD_REQUEST)


def _channel_factory(factory: Any) -> Any:
    """`HTTPFactory.protocol`: Twisted's wrapper (it would switch to HTTP/2 after ALPN) around
    our channel."""
    global _listen_read
    if not _listen_read:
        _listen_read = True
        _allow_listen_hosts(getattr(getattr(factory, "server", None), "endpoints", ()))
    return http._GenericHTTPChannelProtocol(EdgeChannel())


_listen_read = False
_INTERFACE = re.compile(r"(?:^|:)interface=((?:\\.|[^:\\])+)")


def _allow_listen_hosts(endpoints: Any) -> None:
    """The Host allow-list takes the name `serve --listen` was given (an address is allowed
    anyway): read from Daphne's endpoint descriptions (`tcp:port=P:interface=H`, colons
    escaped), the one place the listen address reaches the server."""
    from gpuproxy.proxy.exposure import add_listen_host

    for description in endpoints or ():
        found = _INTERFACE.search(str(description))
        if found:
            add_listen_host(re.sub(r"\\(.)", r"\1", found.group(1)))


# ---- installing it into Daphne ---------------------------------------------------------------

def install(body_bytes: int, header_timeout: float, keys_at_start: dict[str, str],
            admin_keys_at_start: frozenset[str] = frozenset()) -> None:
    """Put the edge into Daphne's HTTP factory and request class (idempotent)."""
    from daphne.http_protocol import HTTPFactory, WebRequest

    limits.body_bytes = body_bytes
    limits.header_timeout = header_timeout
    limits.keys_at_start = dict(keys_at_start)
    limits.admin_keys_at_start = frozenset(admin_keys_at_start)
    if getattr(WebRequest, "_gpuproxy_edge", False):
        return
    HTTPFactory.protocol = _channel_factory

    chunk, process, finish, lost = (WebRequest.handleContentChunk, WebRequest.process,
                                    WebRequest.finish, WebRequest.connectionLost)

    def handle_content_chunk(self: Any, data: bytes) -> None:
        channel = self.channel
        if isinstance(channel, EdgeChannel) and not channel.body_chunk(len(data)):
            return
        chunk(self, data)

    def process_(self: Any) -> Any:
        _track(self)
        return process(self)

    def finish_(self: Any) -> Any:
        _untrack(self)
        return finish(self)

    def connection_lost(self: Any, reason: Any) -> Any:
        _untrack(self)
        return lost(self, reason)

    WebRequest.handleContentChunk = handle_content_chunk
    WebRequest.process = process_
    WebRequest.finish = finish_
    WebRequest.connectionLost = connection_lost
    WebRequest._gpuproxy_edge = True
