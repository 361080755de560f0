"""A peer's model (`peers.<id>`): the request forwarded to another server, never scheduled,
never swapped, with no concurrency limit here (llama-swap's `internal/router/peer.go`).

What goes: the path and query appended to the peer's `proxy`, the body with `model` as the
peer names it (the bare model, not `<peer>/<model>`, as llama-swap sends) and the peer's
filters, the client's headers less hop-by-hop ones, our own key, cookies and the priority
headers, and the peer's `apiKey` as `Authorization: Bearer` and `x-api-key` when it has one.
The priority this node applied travels as the peer reads it (`priority_forward`). What comes
back is relayed as it arrives, an SSE stream included; a peer that cannot be reached, closes
the connection or sends no head within `timeouts.responseHeader` is a 502/504 naming the peer
and its host, never its key. The rules are docs/scheduling.md's "Priority across peers".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from activity import outcomes
from activity.usage import UsageParser
from gpuproxy.observe import inflight
from gpuproxy.proxy import auth
from gpuproxy.proxy.errors import error_body
from gpuproxy.proxy.exchange import UpstreamExchange
from gpuproxy.proxy.inference import Parsed, apply_filters
from gpuproxy.proxy.urgency import ARRIVED_HEADER, PRIORITY_HEADER, from_trusted_peer
from gpuproxy.upstream import relay
from scheduling.catalog import Catalog, CatalogPeer, Route, url_host
from scheduling.core.errors import ModelNotFound
from scheduling.core.priority import band

logger = logging.getLogger("gpuproxy.proxy")

# llama-swap's defaults for a peer (`internal/config/peer.go`), in seconds; 0 disables one.
CONNECT = 30.0
RESPONSE_HEADER = 60.0
# OpenAI's `service_tier` for each band of the applied priority.
TIERS = {"interactive": "priority", "normal": "default", "batch": "flex"}
# Never sent to a peer, whatever it is: its own credentials replace the client's, and only
# the applied priority travels (a client's raw header could ask for more than it was given).
# A cookie is for this host (the dashboard's session), not another one.
_ALWAYS_DROP = frozenset({b"cookie", PRIORITY_HEADER, ARRIVED_HEADER})
# Sent with every forwarded request, trusted or not: a gpuproxy that receives it forwards
# to no peer again, so two nodes listing each other's models cannot pass a request back and
# forth (llama-swap ignores it). A client sending it only loses the peers' models.
HOP_HEADER = b"x-gpuproxy-forwarded"
_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
# The activity row's `scheduler` for a request that no scheduler saw.
SCHEDULER = "peer"


def host_of(peer: CatalogPeer) -> str:
    """The peer's host and port for messages: never a password written in its URL."""
    return url_host(peer.proxy)


def seconds(peer: CatalogPeer, name: str, default: float) -> float:
    """One of the peer's `timeouts` (llama-swap's default when unset); 0 means none, as in
    llama-swap's Go transport, which reads a zero duration as no limit."""
    value = peer.timeouts.get(name, default)
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def url(peer: CatalogPeer, path: str, query: bytes) -> str:
    """The path joined to the peer's base (Go's `SetURL`: `https://host/api` + `/v1/…`),
    without a user or password (the config refuses them; the client library would refuse
    one beside the peer's Authorization with a ValueError, a 500)."""
    parts = urlsplit(peer.proxy)
    netloc = parts.netloc.rpartition("@")[2]
    base = urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")
    return base + path + ("?" + query.decode("latin-1") if query else "")


def headers_for(peer: CatalogPeer, client: list[tuple[bytes, bytes]], drop: frozenset[bytes],
                body_len: int, priority: int, arrived: float) -> list[tuple[bytes, bytes]]:
    """The client's headers for `peer`. `drop` already holds hop-by-hop ones and the key
    this proxy let the request in with (`auth.credential_drop`); with an `apiKey`, any other
    credential the client sent goes too, replaced by the peer's."""
    drop = (drop | _ALWAYS_DROP | auth.NEVER_FORWARDED | {HOP_HEADER}
            | (_KEY_HEADERS if peer.api_key else frozenset()))
    out = [*relay.request_headers(client, body_len, drop, auth.own_cookies()),
           (HOP_HEADER, b"1")]
    if peer.api_key:
        key = peer.api_key.encode("latin-1", "replace")
        out += [(b"authorization", b"Bearer " + key), (b"x-api-key", key)]
    if peer.priority_forward == "header":
        out += [(PRIORITY_HEADER, str(priority).encode()),
                (ARRIVED_HEADER, f"{arrived:.3f}".encode())]
    return out


def body_for(peer: CatalogPeer, route: Route, parsed: Parsed, priority: int) -> bytes:
    """The body for `peer`: its model name, its filters (never `model`), and the priority
    in the body field the peer reads, unless the client set that field itself."""
    set_params: dict[str, Any] = dict(peer.set_params)
    if (peer.priority_forward == "service_tier" and parsed.json_body is not None
            and "service_tier" not in parsed.json_body):
        set_params = {"service_tier": TIERS[band(priority)], **set_params}
    return apply_filters(
        parsed, requested=route.requested,
        use_model_name=route.peer_model if parsed.model != route.peer_model else "",
        strip_params=peer.strip_params, set_params=set_params, set_params_by_id={},
        vllm_priority=priority if peer.priority_forward == "vllm" else None)


def target(catalog: Catalog, model: str) -> Route | None:
    """The peer route of a granted `model` that is a peer's, not ours (a selector's target
    the scheduler picked); None for a local model."""
    found = catalog.peer_model(model) if model not in catalog.models else None
    if found is None:
        return None
    return Route("peer", model, model, peer_id=found[0], peer_model=found[1])


def body_of(catalog: Catalog, model: str, parsed: Parsed, priority: int) -> bytes | None:
    """The body for a granted peer target (`target`), None for a local model."""
    route = target(catalog, model)
    if route is None:
        return None
    return body_for(catalog.peers[route.peer_id], route, parsed, priority)


async def _hop_refused(ex: UpstreamExchange, route: Route) -> bool:
    """At most one hop: what a peer forwarded here (a trusted peer's key, or another
    gpuproxy's HOP_HEADER) goes to no other peer (a 404, not a 5xx a client would retry)."""
    headers = dict(ex.scope["headers"])
    if HOP_HEADER not in headers and not from_trusted_peer(headers, ex.rt.catalog):
        return False
    message = ModelNotFound(route.requested, (
        f"it is peer {route.peer_id!r}'s model here, and this request was forwarded by a "
        "peer: a request is forwarded at most one hop")).message
    await ex.send_json(404, error_body(message, "invalid_request_error", "model_not_found"),
                       outcome=outcomes.UNKNOWN_MODEL)
    return True


async def forward(ex: UpstreamExchange, route: Route, parsed: Parsed, upstream_path: str,
                  priority: int, cancel: Callable[[], None]) -> None:
    """A peer's model asked for by name: sent to the peer, no scheduler involved; `cancel`
    is the dashboard's cancel button."""
    if await _hop_refused(ex, route):
        return
    rec = ex.rec
    rec.scheduler = SCHEDULER
    rec.dispatched = time.monotonic()
    body = body_for(ex.rt.catalog.peers[route.peer_id], route, parsed, priority)
    inflight.add(inflight.InFlight.of(rec, route.target, cancel, ex.scope))
    try:
        await send(ex, route, body, upstream_path, priority)
    finally:
        inflight.remove(rec)


async def forward_granted(ex: UpstreamExchange, route: Route, body: bytes,
                          upstream_path: str, priority: int) -> bool:
    """A selector's request the scheduler granted to a peer's model (`body_of` made its
    body); the grant and the in-flight entry are the caller's. False: never waits again."""
    if not await _hop_refused(ex, route):
        await send(ex, route, body, upstream_path, priority)
    return False


async def send(ex: UpstreamExchange, route: Route, body: bytes, upstream_path: str,
               priority: int) -> None:
    """Send `body` to the route's peer and relay the answer."""
    peer = ex.rt.catalog.peers[route.peer_id]
    rec = ex.rec
    rec.model = route.target
    rec.priority = priority
    # the arrival here in unix seconds, for the peer's aging (X-LlamaSwap-Arrived)
    arrived = time.time() - (time.monotonic() - rec.received)
    headers = headers_for(peer, ex.scope["headers"], ex._drop, len(body), priority, arrived)
    where = f"peer {peer.peer_id!r} at {host_of(peer)}"
    head_within = seconds(peer, "responseHeader", RESPONSE_HEADER)
    target = url(peer, upstream_path, ex.scope.get("query_string", b""))
    timeouts = relay.peer_timeout(seconds(peer, "connect", CONNECT))
    try:
        async with asyncio.timeout(head_within or None):
            for fresh in (False, True):
                relay.begin_attempt(route.target, ex._streams)
                try:
                    response = await relay.send(ex.scope["method"], target, headers, body, 0.0,
                                                fresh=fresh, timeouts=timeouts)
                    break
                except (httpx.TransportError, aiohttp.ClientError) as exc:
                    # once more, fresh, only when a reused connection was closed before the
                    # peer could have read the request (relay.may_retry)
                    if fresh or not relay.may_retry(relay.failure(exc)):
                        raise
    except TimeoutError:
        await _failed(ex, 504, f"{where} sent no response head within {head_within:g} s "
                      f"(peers.{peer.peer_id}.timeouts.responseHeader)", "peer_timeout")
        return
    except (httpx.TransportError, aiohttp.ClientError) as exc:
        await _failed(ex, *_words(where, peer, relay.failure(exc)))
        return
    await relay_answer(ex, response, where)


def _words(where: str, peer: CatalogPeer, fail: relay.Failure) -> tuple[int, str, str]:
    """(status, message, code) for a peer that gave no answer."""
    if fail.kind == relay.CONNECT_TIMEOUT_KIND:
        return (504, f"{where} did not accept the connection within "
                f"{seconds(peer, 'connect', CONNECT):g} s (peers.{peer.peer_id}.timeouts."
                f"connect) ({fail.type_name})", "peer_timeout")
    code = "peer_unreachable" if fail.kind == relay.REFUSED else "peer_error"
    return 502, f"{where} {fail.words} before answering ({fail.type_name})", code


async def _failed(ex: UpstreamExchange, status: int, message: str, code: str) -> None:
    logger.warning("%s", message)
    await ex.send_json(status, error_body(message, "upstream_error", code),
                       outcome=outcomes.UPSTREAM_ERROR)


async def relay_answer(ex: UpstreamExchange, response: httpx.Response, where: str) -> None:
    """The peer's answer as it arrives; a body that breaks off is never passed off as whole:
    an SSE stream ends with an `error` event, anything else with the connection aborted."""
    rec = ex.rec
    content_type = response.headers.get("content-type", "")
    parser = UsageParser(content_type)
    status = response.status_code
    try:
        ex._responded = True
        await ex.send_headers(status=status, headers=relay.response_headers(
            response.headers.raw, content_type))
        async for chunk in response.stream:  # type: ignore[union-attr]
            if rec.first_byte is None:
                rec.first_byte = time.monotonic()
            parser.feed(chunk)
            rec.bytes_out += len(chunk)
            await ex.send_body(chunk, more_body=True)
        await ex.send_body(b"")
        rec.status_code = status
        if status >= 400:
            rec.outcome = outcomes.UPSTREAM_ERROR
            rec.error = f"{where} answered HTTP {status}"
    except (httpx.TransportError, aiohttp.ClientError) as exc:
        message = (f"{where} {relay.failure(exc).words} mid-response; the response was cut")
        logger.warning("%s", message)
        rec.fail(status, outcomes.UPSTREAM_DIED, message)
        if content_type.startswith("text/event-stream"):
            await ex.send_body(b"\n\n" + ex.sse_error(message, "upstream_error", "peer_error",
                                                       502), more_body=True)
            await ex.send_body(b"")
        elif not ex.abort_client():
            await ex.send_body(b"")
    finally:
        rec.usage = parser.finish()
        await response.aclose()
