"""One granted request's exchange with its upstream: send it, relay the answer, and say
what went wrong when the upstream fails (died before it was reached, died mid-answer, cut
the stream, closed a reused connection).

`ProxyConsumer` (consumers.py) decides whether a request may go; this class does the going.
It is ProxyConsumer's base so the consumer reads as the request's path (route, validate,
wait) and this as the upstream's side of it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import aiohttp
import httpx

from activity import outcomes
from activity.captures import Pending
from activity.record import RequestRecord
from activity.usage import UsageParser
from gpuproxy.observe import metrics
from gpuproxy.proxy import auth
from gpuproxy.proxy.errors import ANTHROPIC_PATHS, anthropic_error_body, error_body
from gpuproxy.proxy.http_app import HttpApp
from gpuproxy.shell.port import ProxyPort, UpstreamView
from gpuproxy.upstream import relay
from gpuproxy.upstream.processes import State
from gpuproxy.upstream.relay import Failure
from scheduling.catalog import CatalogModel

logger = logging.getLogger("gpuproxy.proxy")
JSON = [(b"content-type", b"application/json")]
CLIENT_CLOSED = 499  # nginx's code for "the client closed the request", for the activity log
# A close-delimited body (no Content-Length, not chunked) that ended with its process exiting
# within this long was cut by the death, not complete; a live upstream's costs this wait.
CLOSE_DELIMITED_GRACE = 0.25
# How long a failed request waits for its upstream's exit to show, to say "died" rather than
# "closed the connection" (the failure path only).
EXIT_GRACE = 0.05


class UpstreamExchange(HttpApp):
    """The upstream half of ProxyConsumer: attributes below are set by the consumer."""

    rec: RequestRecord
    rt: ProxyPort  # the running proxy, looked up once per request (ProxyConsumer.route)
    _responded: bool
    _drop: frozenset[bytes]
    _streams: bool
    _capture: Pending | None = None  # this request's capture, when captures are on

    async def send_json(self, status: int, body: bytes,
                        headers: list[tuple[bytes, bytes]] | None = None,
                        outcome: str = "") -> None:
        raise NotImplementedError  # the consumer's: its answers all carry its headers

    async def start_stream(self) -> None:
        self._responded = True
        await self.send_headers(status=200, headers=[
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")])

    async def stream_error(self, message: str, code: str | None, status: int,
                           outcome: str) -> None:
        """An error after the stream's 200 went out: an OpenAI-style `error` event, then
        the end (never a `[DONE]`)."""
        self.rec.fail(status, outcome, message)
        await self.send_body(self.sse_error(message, "upstream_error", code, status),
                             more_body=True)
        await self.send_body(b"")

    def sse_error(self, message: str, type_: str, code: str | None, status: int) -> bytes:
        """An error as an SSE event in the stream's own protocol: Anthropic's `error` event
        on its paths (the SDK raises it with the message), OpenAI's `data:` otherwise."""
        if self.scope["path"] in ANTHROPIC_PATHS:
            return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"
        return b"data: " + error_body(message, type_, code) + b"\n\n"

    async def relay(self, model: str, upstream_path: str,
                    body: bytes, *, retry: bool = True, requeue: bool = False) -> bool:
        """Send the request and relay the answer. True, with nothing sent to the client, when
        `requeue` and the request should wait for the model again: its process had died
        before the request could reach it (the connection was refused and the process has
        exited), so the scheduler, now told of the exit, restarts the model for it."""
        proc = self.rt.upstream_process(model)
        pid = proc.pid  # the process this request is for: a retry goes only to the same one
        query = self.scope.get("query_string", b"")
        url = proc.spec.proxy.rstrip("/") + upstream_path + (
            "?" + query.decode("latin-1") if query else "")
        meta = self.rt.catalog.models.get(model)
        idle = meta.stream_idle_timeout if meta is not None else relay.READ_TIMEOUT
        drop = self._drop
        if drop is not relay.HOP_BY_HOP and meta is not None and _forwards_api_key(meta):
            drop = relay.HOP_BY_HOP
        method = self.scope["method"]
        headers = relay.request_headers(self.scope["headers"], len(body),
                                        drop | auth.NEVER_FORWARDED, auth.own_cookies())
        streams = self._streams
        relay.begin_attempt(model, streams)
        started = time.monotonic()
        try:
            response = await relay.send(method, url, headers, body, idle,
                                        fresh=streams and relay.closes_after_streams(model))
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            fail = relay.failure(exc)
            relay.note_failure(model, fail)
            # Once more, fresh, only if the server cannot have read the request: its reused
            # connection was closed or reset within milliseconds, before any answer, and the
            # process is the same live one. The body is buffered; a passthrough (any method,
            # any path) is never repeated.
            if requeue and await self.died_unreached(proc, pid, model, fail):
                return True
            if not (retry and relay.may_retry(fail) and pid is not None and proc.pid == pid
                    and proc.state is State.READY and not await relay.exited(pid)):
                await self.upstream_failed(proc, pid, model, fail, idle)
                return False
            logger.info('model "%s": its reused connection was %s before the request was '
                        "read; sending it once more on a fresh one", model, fail.describe())
            metrics.upstream_retried(model)
            self.rec.upstream_retries += 1
            relay.begin_attempt(model, streams)
            try:
                response = await relay.send(method, url, headers, body, idle, fresh=True)
            except (httpx.TransportError, aiohttp.ClientError) as again:
                fail = relay.failure(again)
                if requeue and await self.died_unreached(proc, pid, model, fail):
                    return True  # (the close was the process dying, not yet seen)
                await self.upstream_failed(proc, pid, model, fail, idle)
                return False
        rec = self.rec
        response_headers = response.headers
        if streams:
            relay.note_stream_answer(model, response_headers)
        content_type = response_headers.get("content-type", "")
        sse = content_type.startswith("text/event-stream")
        parser = UsageParser(content_type)
        feed: Callable[[bytes], None] = parser.feed
        if self._capture is not None:
            feed = self._capture.tee(feed)
        status = response.status_code
        if self._responded and status >= 400:
            # The wait was reported on a 200 stream; the upstream's error becomes an event.
            detail = (await response.aread())[:2000].decode(errors="replace")
            await response.aclose()
            await self.stream_error(f"model {model!r} answered HTTP {status}: {detail}",
                                    "upstream_error", status, outcomes.UPSTREAM_ERROR)
            return False
        try:
            if not self._responded:
                self._responded = True
                await self.send_headers(status=status, headers=relay.response_headers(
                    response_headers.raw, content_type))
            # The body's last bytes by its Content-Length go as the response's end: one
            # message to the server fewer for nearly every JSON answer (BENCHMARKS.md).
            last = _length(response, method)
            ended = False
            # the transport's stream itself: `aiter_raw` adds only byte counting
            async for chunk in response.stream:  # type: ignore[union-attr]
                if rec.first_byte is None:
                    rec.first_byte = time.monotonic()
                feed(chunk)
                rec.bytes_out += len(chunk)
                ended = rec.bytes_out == last
                await self.send_body(chunk, more_body=not ended)
            if (_close_delimited(response, method)
                    and await relay.exited(pid, CLOSE_DELIMITED_GRACE)):
                # Nothing marks the end of such a body but the close, and the process died:
                # it ended because the upstream did, not because the answer was complete.
                await self.cut_mid_response(proc, model, Failure(
                    relay.CUT, "ended its body by exiting", "close-delimited body"),
                    status, sse, started, idle)
                return False
            if not ended:
                await self.send_body(b"")
            rec.status_code = status
            if status >= 400:
                rec.outcome = outcomes.UPSTREAM_ERROR
                rec.error = f"the upstream answered HTTP {status}"
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            await self.cut_mid_response(proc, model, relay.failure(exc), status, sse, started,
                                        idle)
        finally:
            rec.usage = parser.finish()
            await response.aclose()
        return False

    async def died_unreached(self, proc: UpstreamView, pid: int | None, model: str,
                             fail: Failure) -> bool:
        """Whether the request never reached the upstream because its process had died: the
        connection was refused and the process has exited. Then the scheduler has been told
        of the exit (`exit_reported`), so a request that waits again restarts the model."""
        if not (fail.kind == relay.REFUSED and proc.state is not State.STOPPING
                and await proc.exit_reported(pid, EXIT_GRACE)):
            return False
        logger.info('model "%s": its process (pid %s) had exited before this request could '
                    "reach it; the request waits for the restart", model, pid)
        return True

    async def upstream_failed(self, proc: UpstreamView, pid: int | None, model: str,
                              fail: Failure, idle: float) -> None:
        """No answer came: a 502 that says what happened (or, on a reported wait's 200
        stream, an `error` event)."""
        where = f"model {model!r} at {proc.spec.proxy}"
        if proc.state is State.STOPPING:
            message, code, outcome = (f"model {model!r} was stopped while answering this "
                                      "request (an unload, a restart or the proxy's shutdown)",
                                      "upstream_stopped", outcomes.UPSTREAM_STOPPED)
        elif fail.kind == relay.TIMEOUT:
            message, code, outcome = (f"model {model!r} sent nothing for {idle:g} s "
                                      "(streamIdleTimeout); the request was ended",
                                      "upstream_timeout", outcomes.UPSTREAM_DIED)
        elif fail.kind in (relay.REFUSED, relay.CONNECT_TIMEOUT):
            gone = " (its process has exited; it restarts on the next request)" if (
                await relay.exited(pid, EXIT_GRACE)) else ""
            message, code, outcome = (f"{where} {fail.describe()}{gone}",
                                      "upstream_unreachable", outcomes.UPSTREAM_ERROR)
        elif fail.kind == relay.BAD_RESPONSE:
            message, code, outcome = (f"{where} {fail.describe()}", "upstream_bad_response",
                                      outcomes.UPSTREAM_ERROR)
        else:
            died = await relay.exited(pid, EXIT_GRACE)
            message = (f"model {model!r} died before answering: {fail.describe()}" if died else
                       f"{where} {fail.words} before answering ({fail.type_name})")
            code, outcome = "upstream_died", outcomes.UPSTREAM_DIED
        message += f"; its log: GET /logs/stream/{model}"
        if self._responded:  # a reported wait: the client already has its 200
            await self.stream_error(message, code, 502, outcome)
            return
        await self.send_json(502, error_body(message, "upstream_error", code), outcome=outcome)

    async def cut_mid_response(self, proc: UpstreamView, model: str, fail: Failure,
                               status: int, sse: bool, started: float, idle: float) -> None:
        """The headers are out and the body broke off. Never a clean end, never a [DONE] the
        upstream did not send: an SSE stream gets an `error` event, then its end; any other
        body has its client connection aborted (no terminal chunk, no keep-alive waiting for
        the rest of a Content-Length), so no client can take half an answer for a whole."""
        outcome = outcomes.UPSTREAM_DIED
        if proc.state is State.STOPPING:
            message = (f"model {model!r} was stopped mid-response (an unload, a restart or the "
                       "proxy's shutdown); the response was cut")
            code, outcome = "upstream_stopped", outcomes.UPSTREAM_STOPPED
        elif fail.kind == relay.TIMEOUT:
            message = (f"model {model!r} sent nothing for {idle:g} s mid-response "
                       "(streamIdleTimeout); the response was cut")
            code = "upstream_timeout"
        else:
            message = (f"model {model!r} died or dropped the connection mid-response after "
                       f"{time.monotonic() - started:.1f} s: it {fail.describe()}; the response "
                       f"was cut; its log: GET /logs/stream/{model}")
            code = "upstream_died"
        logger.warning("%s", message)
        self.rec.fail(status, outcome, message)
        if sse:
            await self.send_body(b"\n\n" + self.sse_error(message, "upstream_error", code, 502),
                                 more_body=True)
            await self.send_body(b"")
        elif not self.abort_client():
            await self.send_body(b"")

    def abort_client(self) -> bool:
        """Drop the client's connection without ending the response, as HTTP says to signal
        an incomplete one. ASGI has no message for it and Daphne closes nothing when the
        application returns, so this goes to the Twisted request that Daphne bound into our
        `send` (`Server.create_application`: `partial(self.handle_reply, protocol)`); False
        when there is none (another ASGI server, a test communicator)."""
        send = self.base_send
        request = send.args[0] if isinstance(send, functools.partial) and send.args else None
        lose = getattr(request, "loseConnection", None)
        if lose is None:
            logger.warning("cannot abort the client connection of %s %s (no Daphne request); "
                           "ending the response instead", self.scope["method"],
                           self.scope["path"])
            return False
        lose()
        return True


def _forwards_api_key(meta: CatalogModel) -> bool:
    """A model asks for the client's gpuproxy key to reach it (an upstream started with the
    same `--api-key`) with `metadata: {gpuproxy: {forwardApiKey: true}}`."""
    ours = meta.metadata.get("gpuproxy")
    return isinstance(ours, dict) and ours.get("forwardApiKey") is True


def _length(response: httpx.Response, method: str) -> int | None:
    """The body's length by its Content-Length, when it has a body and a valid one (the
    transport checked it: aiohttp refuses a body that ends short of it, and reads no further
    than it); None otherwise."""
    headers = response.headers
    if (method == "HEAD" or response.status_code in (204, 304)
            or "transfer-encoding" in headers):  # chunked wins over a length (RFC 9112 6.3)
        return None
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _close_delimited(response: httpx.Response, method: str) -> bool:
    """The body has no length of its own: it ends when the connection closes (RFC 9112 6.3)."""
    headers = response.headers
    return (method != "HEAD" and response.status_code not in (204, 304)
            and "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower())
