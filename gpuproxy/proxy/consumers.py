"""The OpenAI-compatible proxy: a thin ASGI app that waits for a grant and relays bytes.

It decides nothing: it reads the request, asks the run loop for the model, and streams the
upstream's answer back as it arrives. A handler that awaited the whole exchange before reading
the next ASGI message would never see a client leave (Channels' `AsyncHttpConsumer` does that:
channels#1249, `django-stack-notes.md` §2). Here the work runs in a task that `http_disconnect`
cancels: the cancel reaches whichever await the request is in (queued, loading, waiting for
the first byte, streaming), which withdraws it from the scheduler or closes the upstream
connection, and the `finally` releases the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from functools import cached_property
from typing import Any

from django.conf import settings

from activity import captures, outcomes
from activity.record import RequestRecord
from activity.writer import writer as activity_writer
from gpuproxy.observe import inflight, metrics
from gpuproxy.proxy import fleet_forward, peers, staff_session, urgency
from gpuproxy.proxy.auth import KeyRefusal
from gpuproxy.proxy.client_ip import client_ip
from gpuproxy.proxy.errors import error_body, for_path
from gpuproxy.proxy.exchange import CLIENT_CLOSED, JSON, UpstreamExchange
from gpuproxy.proxy.exposure import SCOPE_KEY, proxy_path_needs_admin
from gpuproxy.proxy.inference import (
    FORM_PATHS,
    GET_ONLY_PATHS,
    INFERENCE_PATHS,
    VERSIONLESS,
    BadRequest,
    apply_filters,
    parse,
)
from gpuproxy.proxy.malformed import malformed_request
from gpuproxy.proxy.model_list import models_list, resolve_prefix
from gpuproxy.shell import runtime
from gpuproxy.shell.run_loop import Waiting
from gpuproxy.upstream import relay
from gpuproxy.upstream.processes import State
from scheduling.core.errors import (
    ConcurrencyLimit,
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    SchedulingError,
    ShuttingDown,
    SwapFailed,
)
from scheduling.core.priority import band

# Seconds between "still waiting" signs on a waiting stream.
KEEPALIVE: float = settings.GPUPROXY_STREAM_KEEPALIVE
# How many times a request may wait for its model: again each time the process it was
# granted had died before the request could reach it (it reached no server, so waiting again
# is safe). Bounded for a model whose every fresh process dies at once.
WAITS = 4

logger = logging.getLogger("gpuproxy.proxy")

# llama-swap's default `upstream.ignorePaths`: static files never trigger a model load.
IGNORE_PATHS = [re.compile(r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$")]
GET_PATHS = frozenset({"/v1/audio/voices"})
_OUTCOME_OF = {
    ModelNotFound: outcomes.UNKNOWN_MODEL,
    ConcurrencyLimit: outcomes.REJECTED_CAPACITY,
    QueueFull: outcomes.REJECTED_QUEUE,
    QueueTimeout: outcomes.QUEUE_TIMEOUT,
    SwapFailed: outcomes.START_FAILED,
    ShuttingDown: outcomes.SHUTTING_DOWN,
}


def _reasoning_chunk(model: str, text: str) -> dict[str, Any]:
    """An OpenAI chat chunk carrying `text` as reasoning, llama-swap's loading-state shape:
    clients show it as the model "thinking" and ignore it otherwise."""
    return {"id": "chatcmpl-gpuproxy-wait", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": {"reasoning_content": text},
                         "finish_reason": None}]}


class ProxyConsumer(UpstreamExchange):
    """One HTTP request to an inference path, `/v1/models`, or `/upstream/...`."""

    def __init__(self) -> None:
        super().__init__()
        self._size = 0
        self._task: asyncio.Task | None = None
        self._responded = False
        self.max_body = getattr(settings, "GPUPROXY_MAX_BODY_BYTES", 32 * 1024 * 1024)
        # The request's activity row. A placeholder until the body is read (a client that
        # leaves before has no row); `_log` says whether it is still to be written: it is
        # written once, and never for what is not an inference request (a listing, a redirect).
        self.rec = RequestRecord("", "", "", "")
        self._log = False
        self._cancelled_by_admin = False
        # headers never sent upstream: hop-by-hop ones, and the proxy's own credential once
        # a gpuproxy API key let the request in (`auth.credential_drop`)
        self._drop = relay.HOP_BY_HOP
        self._streams = False  # the request asks for a streamed answer
        self._hop: fleet_forward.Hop | None = None  # forwarded by a node of this fleet

    @cached_property
    def headers(self) -> dict[bytes, bytes]:
        """The request headers by lower-case name, built once per request."""
        return dict(self.scope["headers"])

    async def http_request(self, message: dict) -> None:
        if self._task is not None or self._responded:
            return  # body after a 413: drop it
        chunk = message.get("body", b"")
        self._size += len(chunk)
        if self._size > self.max_body:
            self.body = []
            self._responded = True
            text = (f"the request body is over {self.max_body} bytes; send less or raise "
                    "GPUPROXY_MAX_BODY_MB")
            self.start_record()
            await self.send_json(413, error_body(text, "invalid_request_error",
                                                 "body_too_large"), outcome=outcomes.BAD_REQUEST)
            self.submit_record()
            return
        self.body.append(chunk)
        if not message.get("more_body"):
            body = b"".join(self.body)
            self.body = []
            # The record exists from here, not from the task's first step: a disconnect
            # that cancels the task before it runs would otherwise leave no row at all.
            self.start_record()
            self._task = asyncio.get_running_loop().create_task(self._run(body))

    async def http_disconnect(self, message: dict) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        rec = self.rec
        if self._log and not rec.outcome:  # cancelled before its first step: `_run` never ran
            rec.fail(CLIENT_CLOSED, outcomes.CANCELLED_QUEUED,
                     "the client closed the connection")
        self.submit_record()

    async def _run(self, body: bytes) -> None:
        try:
            await self.route(body)
        except asyncio.CancelledError:
            if self._cancelled_by_admin:
                await self._end_cancelled_by_admin()
                return
            rec = self.rec
            if not rec.outcome:
                queued = rec.dispatched is None
                rec.fail(CLIENT_CLOSED,
                         outcomes.CANCELLED_QUEUED if queued else outcomes.CANCELLED_INFLIGHT,
                         "the client closed the connection")
            raise
        except Exception as exc:
            logger.exception("proxy error on %s %s", self.scope["method"], self.scope["path"])
            # the type only: an exception's text can hold what was sent upstream
            self.rec.fail(500, outcomes.UPSTREAM_ERROR,
                          f"internal error in gpuproxy ({type(exc).__name__}); the proxy "
                          "log has the details")
            if not self._responded:
                await self.send_json(500, error_body(
                    "internal error in gpuproxy; the proxy log has the details",
                    "server_error", "internal_error"))
        finally:
            self.submit_record()

    def cancel_by_admin(self) -> None:
        """The dashboard's cancel button: end this request as if the client had left, but
        tell the client why."""
        task = self._task
        if task is not None and not task.done():
            self._cancelled_by_admin = True
            task.cancel()

    async def _end_cancelled_by_admin(self) -> None:
        message = "cancelled by an administrator of this gpuproxy"
        rec = self.rec
        rec.fail(503 if not self._responded else rec.status_code or 200,
                 outcomes.CANCELLED_BY_ADMIN, message)
        if not self._responded:
            self._responded = True
            await self.send_response(503, for_path(self.scope["path"], 503, error_body(
                message, "server_error", "cancelled_by_admin")), headers=JSON)
            return
        if rec.stream:  # an SSE stream: say why before it ends
            await self.send_body(self.sse_error(message, "server_error", "cancelled_by_admin",
                                                503), more_body=True)
        await self.send_body(b"")

    def start_record(self) -> None:
        self.rec = RequestRecord(self.scope["method"], self.scope["path"], client_ip(self.scope),
                                 self.headers.get(b"user-agent", b"").decode("latin-1"))
        self._log = True

    def submit_record(self) -> None:
        """Hand the finished record to the activity writer, once: O(1), never the database."""
        if self._log:
            self._log = False
            row = self.rec.row()
            if self._hop is not None:  # served here, entered by another node
                row["entry_node"] = self._hop.entry_node
            capture = self._capture
            activity_writer().submit(row if capture is None else {**row,
                                                                  captures.ROW_KEY: capture})
            metrics.observe_request(row)

    # ---- responses --------------------------------------------------------------------------

    async def send_headers(self, *, status: int = 200,
                           headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Every answer's head: the upstream's own CORS headers out (llama.cpp echoes any
        Origin, and allows credentials on its preflights), the exposure policy's in
        (gpuproxy/proxy/exposure.py), so a page sees one set, ours."""
        kept = [(k, v) for k, v in headers or () if not k.lower().startswith(b"access-control-")]
        kept += self.scope.get(SCOPE_KEY, ())
        capture = self._capture
        if capture is not None:
            capture.resp_headers = kept
        await super().send_headers(status=status, headers=kept)

    async def send_json(self, status: int, body: bytes,
                        headers: list[tuple[bytes, bytes]] | None = None,
                        outcome: str = "") -> None:
        if outcome:
            self.rec.fail(status, outcome, json.loads(body)["error"]["message"])
        if status >= 400:
            body = for_path(self.scope["path"], status, body)
        self._responded = True
        await self.send_headers(status=status, headers=JSON + (headers or []))
        await self.send_body(body)

    async def send_error(self, exc: SchedulingError | BadRequest) -> None:
        if isinstance(exc, SchedulingError):
            headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
            await self.send_json(exc.status, error_body(exc.message, exc.type, exc.code),
                                 headers, outcome=_OUTCOME_OF.get(type(exc),
                                                                  outcomes.UPSTREAM_ERROR))
        else:
            await self.send_json(exc.status, error_body(exc.message, "invalid_request_error",
                                                        exc.code), outcome=outcomes.BAD_REQUEST)

    # ---- routing ----------------------------------------------------------------------------

    async def route(self, body: bytes) -> None:
        self.rt = await runtime.port()
        catalog = self.rt.catalog
        headers = self.headers
        path: str = self.scope["path"]
        method: str = self.scope["method"]
        hop = fleet_forward.hop_of(headers)  # a node's forward: believed only with the key
        if isinstance(hop, fleet_forward.Refused):
            return await self.send_json(401, hop.body, outcome=outcomes.UNAUTHORIZED)
        who = await staff_session.authorize_proxy(  # a key, or a staff session's
            self.scope, headers, catalog.api_keys, catalog.admin_keys,
            admin=proxy_path_needs_admin(path))
        if isinstance(who, KeyRefusal) and not isinstance(hop, fleet_forward.Hop):
            if who.caller is not None:
                self.rec.client = who.caller.name
            await self.send_json(who.status, error_body(who.message, who.type, who.code),
                                 [(k.lower().encode(), v.encode())
                                  for k, v in who.headers.items()],
                                 outcome=outcomes.UNAUTHORIZED)
            return
        if isinstance(who, tuple):  # None: no keys, no staff session; a refusal: a node's hop
            self.rec.client, self._drop = who
        self._drop |= fleet_forward.OWN_HEADERS  # never relayed further
        if hop is not None:  # the caller and the arrival as the entry node knew them
            self._hop, self.rec.client, self.rec.client_ip = hop, hop.client, hop.client_ip
            self.rec.received -= hop.age
        malformed = malformed_request(self.scope)
        if malformed is not None:
            await self.send_json(400, error_body(*malformed), outcome=outcomes.BAD_REQUEST)
            return
        if path in ("/v1/models", "/models"):
            self._log = False  # a listing is not an inference request: not logged
            if method != "GET":
                await self.method_not_allowed("GET")
                return
            await self.send_json(200, json.dumps(models_list(self.rt, catalog)).encode())
        elif path.startswith("/upstream/"):
            await self.upstream_passthrough(path[len("/upstream/"):], body)
        elif path in INFERENCE_PATHS:
            allowed = (("GET",) if path in GET_ONLY_PATHS
                       else ("GET", "POST") if path in GET_PATHS else ("POST",))
            if method not in allowed:
                await self.method_not_allowed(*allowed)
                return
            self._log = path not in GET_ONLY_PATHS
            await self.inference(VERSIONLESS.get(path, path), body)
        else:
            await self.send_json(404, error_body(f"no such endpoint: {method} {path}",
                                                 "invalid_request_error", "not_found"),
                                 outcome=outcomes.BAD_REQUEST)

    async def method_not_allowed(self, *allowed: str) -> None:
        await self.send_json(405, error_body(
            f"{self.scope['method']} is not allowed on {self.scope['path']}; use "
            f"{' or '.join(allowed)}", "invalid_request_error", "method_not_allowed"),
            [(b"allow", ", ".join(allowed).encode())], outcome=outcomes.BAD_REQUEST)

    async def inference(self, upstream_path: str, body: bytes) -> None:
        try:
            parsed = parse(self.scope["method"], upstream_path,
                           self.scope.get("query_string", b"").decode("latin-1"),
                           self.headers, body)
        except BadRequest as exc:
            await self.send_error(exc)
            return
        if upstream_path in FORM_PATHS and parsed.form_kind != "multipart":
            await self.send_error(BadRequest(400, f"{upstream_path} takes multipart/form-data",
                                             "invalid_content_type"))
            return
        self._streams = parsed.stream
        self.rec.note_request(parsed.model, parsed.stream, parsed.json_body, self.headers)
        catalog = self.rt.catalog
        route = catalog.route(parsed.model)
        priority = self.priority(parsed.json_body)
        if route.kind == "disabled":
            await self.send_error(ModelNotFound(
                parsed.model, f"the active profile {route.pinned_by!r} disables it"))
            return
        if route.kind == "peer":
            await peers.forward(self, route, parsed, upstream_path, priority,
                                self.cancel_by_admin)
            return
        if await fleet_forward.elsewhere(self, route, body, priority):
            return  # another node served it, or none that serves it is up
        known = route.kind in ("model", "selector")
        if known and catalog.capture_buffer_mb:  # the one check captures cost when off
            self.begin_capture(catalog.capture_buffer_mb, upstream_path, body)

        def prepare(model_id: str) -> bytes:
            """The body for `model_id` (a selector's target is known only at the grant, by
            the catalog in force then): its filters applied."""
            now = self.rt.catalog
            meta = now.models.get(model_id)
            if meta is None:  # a peer's model, a selector's target, or gone
                return peers.body_of(now, model_id, parsed, priority) or body
            return apply_filters(parsed, requested=route.requested,
                                 use_model_name=meta.use_model_name,
                                 strip_params=meta.strip_params, set_params=meta.set_params,
                                 set_params_by_id=meta.set_params_by_id,
                                 vllm_priority=priority if meta.vllm_priority else None)

        meta = catalog.models.get(route.target) if route.kind == "model" else None
        waits_visibly = parsed.stream and upstream_path == "/v1/chat/completions"
        await self.forward(route.target, upstream_path, body, priority,
                           progress=waits_visibly, prepare=prepare if known else None,
                           loading_state=bool(meta and meta.send_loading_state))

    def priority(self, json_body: dict[str, Any] | None) -> int:
        """The priority applied here, the scheduler's and a peer's (urgency.py); the entry
        node's for a request another node forwarded (clamped there)."""
        if self._hop is not None:
            self.rec.priority_asked = self._hop.asked
            return self._hop.priority
        return urgency.applied_priority(self.headers, json_body, self.rt.catalog, self.rec)

    async def upstream_passthrough(self, rest: str, body: bytes) -> None:
        """`/upstream/<model>/<path>`: any method, straight to the model's server."""
        self.rec.model_requested = rest.split("/", 1)[0]
        if (pinned := self.rt.catalog.upstream_pin(rest)) is not None:  # llama-swap's too
            pin, rest, profile = pinned
            if not rest:  # pinned to nothing
                why = f"the active profile {profile!r} disables it"
                return await self.send_error(ModelNotFound(pin, why))
        model_id, sub = resolve_prefix(self.rt.catalog, rest)
        if model_id is None:
            await self.send_error(ModelNotFound(rest.split("/", 1)[0]))
            return
        if sub is None:  # bare /upstream/<model>: redirect so relative links work
            status = 301 if self.scope["method"] in ("GET", "HEAD") else 308
            self._log = False  # a redirect reaches no model: not logged
            self._responded = True
            await self.send_headers(status=status, headers=[
                (b"location", f"/upstream/{rest}/".encode())])
            await self.send_body(b"")
            return
        proc = self.rt.upstream(model_id)
        loaded = proc is not None and proc.state is State.READY
        if not loaded and any(p.match("/" + sub) for p in IGNORE_PATHS):
            await self.send_json(409, error_body(
                f"model {model_id!r} is not loaded and /{sub} matches upstream.ignorePaths, "
                "which never trigger a load", "invalid_request_error", "model_not_loaded"),
                outcome=outcomes.BAD_REQUEST)
            return
        self._streams = relay.passthrough_streams(body)
        budget = self.rt.catalog.capture_buffer_mb
        if budget and self.scope["method"] == "POST":
            route = VERSIONLESS.get("/" + sub, "/" + sub)
            if route in INFERENCE_PATHS:  # a model-dispatched path, as llama-swap meters
                self.begin_capture(budget, route, body)
        await self.forward(model_id, "/" + sub, body, retry=False)

    def begin_capture(self, budget_mb: int, route: str, body: bytes) -> None:
        """Keep this request and its answer for `/api/captures` (activity/captures.py), with
        the body as the client sent it, before any filter."""
        self._capture = captures.Pending(budget_mb, self.scope["path"], route,
                                         self.scope["headers"], body)

    async def forward(self, model: str, upstream_path: str,
                      body: bytes, priority: int | None = None, *, progress: bool = False,
                      loading_state: bool = False, retry: bool = True,
                      prepare: Callable[[str], bytes] | None = None) -> None:
        """Wait for the grant, then relay the upstream's answer as it arrives.

        With `progress` (a streaming chat request), a request the scheduler makes wait gets
        its 200 and an SSE stream at once: with `loading_state`, chunks whose
        `delta.reasoning_content` says what it waits for (a model load, its place in the
        queue); otherwise a comment at once and then every KEEPALIVE seconds, so that no
        header or idle timeout cuts a long wait. Rejections come before it, as JSON.

        `retry`: whether a request written on a reused connection that the upstream closed
        unread may be sent once more (`relay.may_retry`): inference paths only, since a
        passthrough request may be anything.

        `prepare(granted model)` gives the body to send (filters), once the grant says which
        model serves it: a selector's target is chosen by the scheduler."""
        if priority is None:
            priority = self.priority(None)
        rec = self.rec
        rec.priority = priority
        rec.model = model if model in self.rt.catalog.models else ""  # a selector's: at grant
        rec.scheduler = self.rt.catalog.scheduler
        reporter: asyncio.Task | None = None

        def watch(waiting: Waiting) -> None:
            nonlocal reporter
            if progress:
                reporter = asyncio.get_running_loop().create_task(
                    self.report_wait(waiting, model, priority, loading_state))

        patience = urgency.queue_deadline(self.headers, self.rt.catalog.queue_timeout)
        age = (self._hop.age if self._hop is not None  # a fleet node's or trusted peer's
               else urgency.age(self.headers, self.rt.catalog))
        give_up = time.monotonic() + patience if patience is not None else None
        for attempt in range(1, WAITS + 1):
            if give_up is not None:  # a later wait gets what is left of the first's
                patience = max(give_up - time.monotonic(), 0.001)
            try:
                try:
                    grant = await self.rt.acquire(model, priority, patience, watch=watch,
                                                  age=age, request_id=str(rec.request_id))
                finally:
                    if reporter is not None:
                        reporter.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reporter
                        reporter = None
            except SchedulingError as exc:
                if self._responded:  # the wait was already streaming: end it with the error
                    await self.stream_error(exc.message, exc.code, exc.status,
                                            _OUTCOME_OF.get(type(exc), outcomes.UPSTREAM_ERROR))
                else:
                    await self.send_error(exc)
                return
            rec.dispatched = time.monotonic()
            rec.dispatch = grant.dispatch
            rec.model, rec.swap_s = grant.model, grant.swap_wait
            inflight.add(inflight.InFlight.of(rec, grant.model, self.cancel_by_admin, self.scope))
            try:  # from the grant on, whatever fails releases it
                sent = prepare(grant.model) if prepare is not None else body
                to_peer = peers.target(self.rt.catalog, grant.model)  # a selector's peer pick
                again = await (peers.forward_granted(self, to_peer, sent, upstream_path, priority)
                               if to_peer is not None else
                               self.relay(grant.model, upstream_path, sent, retry=retry,
                                          requeue=retry and attempt < WAITS))
            finally:
                grant.release()
                inflight.remove(rec)
            if not again:
                return
            # queued again: not dispatched until the next grant
            rec.dispatched = None
            rec.dispatch = None

    async def report_wait(self, waiting: Waiting, model: str, priority: int,
                          loading_state: bool) -> None:
        """Tell a waiting streaming client that it waits (see `forward`)."""
        await waiting.waits.wait()
        # The 200 and a first sign at once, not after the first KEEPALIVE: a client whose
        # header timeout is shorter than the wait would give up on a silent connection.
        if not self._responded:  # (a request waiting again after its model died has one)
            await self.start_stream()
        told = ""
        while True:
            if not loading_state:
                await self.send_body(b": waiting for the model\n\n", more_body=True)
                await asyncio.sleep(KEEPALIVE)
                continue
            text = (f"waiting in the {band(priority)} band: position {waiting.position}\n"
                    if waiting.position else f"loading model {model}…\n")
            if text != told:
                told = text
                await self.send_body(b"data: " + json.dumps(_reasoning_chunk(
                    model, text)).encode() + b"\n\n", more_body=True)
            waiting.position_changed.clear()
            # Not wait_for: on Python 3.11 it can swallow the cancel `forward` sends as
            # the position changes, and `forward` would then wait for this task forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KEEPALIVE):
                    await waiting.position_changed.wait()
