"""Any node accepts any request (issue 24, item 4a): a request sent to the node the fleet's
decision names (scheduling/fleet_route.py, by this process's snapshot: fleet_snapshot.py),
and a request another node forwarded here, believed only with the fleet's key.

Going out, the request carries what the entry node decided: the priority it applied (already
clamped into the caller's key's range) and the original arrival (the peers' headers,
`X-LlamaSwap-Priority` and `X-LlamaSwap-Arrived`), the entry node's name, the caller as the
entry node knows it (the activity row's client and client address), the peers' one-hop header,
and `X-GpuProxy-Fleet: <GPUPROXY_FLEET_KEY>`. The client's own credential goes too: keys are
shared in the database, and every node's edge checks it. Coming in, a request with the fleet
header is a node's only when the value is this node's key (compared in constant time; a wrong
one is a 401 that names no secret); then, and only then, its priority, arrival, caller and
entry node are taken as they are, and it is never forwarded again, whatever this node's view
of the fleet says: at most one hop. The fleet headers never go further (an upstream, a peer,
another node) and never into a row or a log line.

The row is written once, by the node that served the request: the entry node writes none for
a request whose forward brought back a response head; one that failed before any head (the
node unreachable, or gone mid-wait) is the entry node's row, a 502 naming the node and its
address.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from django.conf import settings

from activity import outcomes
from gpuproxy.proxy import auth, fleet_snapshot, peers
from gpuproxy.proxy.errors import error_body
from gpuproxy.proxy.exchange import UpstreamExchange
from gpuproxy.proxy.urgency import ARRIVED_HEADER, PRIORITY_HEADER, carried_age
from gpuproxy.upstream import relay
from scheduling.catalog import Route, url_host
from scheduling.fleet_route import NodeView, NoneUp, choose

logger = logging.getLogger("gpuproxy.proxy.fleet")

FLEET_HEADER = b"x-gpuproxy-fleet"
ENTRY_HEADER = b"x-gpuproxy-entry-node"
CLIENT_HEADER = b"x-gpuproxy-client"
CLIENT_IP_HEADER = b"x-gpuproxy-client-ip"
ASKED_HEADER = b"x-gpuproxy-priority-asked"
# Never relayed by anyone, whoever sent them: a node sets its own when it forwards.
OWN_HEADERS = frozenset({FLEET_HEADER, ENTRY_HEADER, CLIENT_HEADER, CLIENT_IP_HEADER,
                         ASKED_HEADER})
# Seconds to connect to another node: it is on the same network, and a node that does not
# accept within this is treated as unreachable (the heartbeat may not have told yet).
CONNECT = 5.0
SCHEDULER = "fleet"  # the entry node's row's `scheduler` when its forward failed
_TEXT_MAX = 255


@dataclass(frozen=True)
class Hop:
    """What a node of this fleet said of a request it forwarded here."""

    entry_node: str
    client: str
    client_ip: str
    priority: int
    asked: int | None
    age: float  # seconds since the original arrival


@dataclass(frozen=True)
class Refused:
    """A fleet header with the wrong key: why, as the 401's body."""

    body: bytes


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("latin-1")[:_TEXT_MAX]


def _int(raw: bytes | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def hop_of(headers: Mapping[bytes, bytes]) -> Hop | Refused | None:
    """A node's forward (its key is right), a refusal (the header with anything else), or
    None (no fleet header: an ordinary client, whatever else it sends)."""
    raw = headers.get(FLEET_HEADER)
    if raw is None:
        return None
    key = settings.GPUPROXY_FLEET_KEY
    if not key or not hmac.compare_digest(raw, key.encode()):
        why = ("this node has no GPUPROXY_FLEET_KEY" if not key else
               "its value is not this node's GPUPROXY_FLEET_KEY")
        return Refused(error_body(
            f"the request carries X-GpuProxy-Fleet, which only a node of this fleet sends, and "
            f"{why}: a client must not send it; a node must have the same key as every other "
            f"node (this is node {settings.GPUPROXY_NODE!r})", "authentication_error",
            "invalid_fleet_key"))
    return Hop(entry_node=_text(headers.get(ENTRY_HEADER)),
               client=_text(headers.get(CLIENT_HEADER)),
               client_ip=_text(headers.get(CLIENT_IP_HEADER)),
               priority=_int(headers.get(PRIORITY_HEADER)) or 0,
               asked=_int(headers.get(ASKED_HEADER)),
               age=carried_age(headers.get(ARRIVED_HEADER), time.time()))


def at_edge(headers: Any) -> bool:
    """Whether the edge lets a request without a key through to the consumer: a node's
    forward with this node's key. The entry node let its caller in (a key, or a staff session
    whose cookie never travels); the consumer takes the caller from the hop (`hop_of`)."""
    raw = headers.getRawHeaders(FLEET_HEADER) or []
    key = settings.GPUPROXY_FLEET_KEY
    return bool(key and len(raw) == 1 and hmac.compare_digest(raw[0], key.encode()))


def forwarded(ex: UpstreamExchange) -> bool:
    """Whether the request came from another server: a node of the fleet (a trusted hop) or
    anything sending the peers' hop header. Neither is forwarded again."""
    return getattr(ex, "_hop", None) is not None or peers.HOP_HEADER in dict(ex.scope["headers"])


async def elsewhere(ex: UpstreamExchange, route: Route, body: bytes, priority: int) -> bool:
    """Send the request to another node when the fleet's decision says so; True when it was
    answered (forwarded, or refused: no node that serves the model is up). Only a model of
    the catalog or a placed one ("fleet"): a selector's target is known only at its grant."""
    if route.kind not in ("model", "fleet"):
        return False
    not_here = route.kind == "fleet"
    if forwarded(ex):
        if not_here:  # the two nodes' views disagreed: it is not passed on
            await _send_error(ex, 503, _one_hop(route), "model_not_on_this_node")
            return True
        return False
    snap = await fleet_snapshot.current()
    if snap is None:  # forwarding off: the scheduler's 404 names the nodes that serve it
        return False
    choice = choose(route.target, settings.GPUPROXY_NODE, not not_here, _placed(ex, route),
                    snap.nodes, settings.GPUPROXY_FLEET_MARGIN)
    if choice is None:
        return False
    if isinstance(choice, NoneUp):
        ex.rec.model = route.target
        await _send_error(ex, 503, choice.message, "no_node_up")
        return True
    await send(ex, choice, route.target, body, priority)
    return True


def _placed(ex: UpstreamExchange, route: Route) -> tuple[str, ...]:
    """The nodes that serve the model, () for every node: the route's for a model placed
    elsewhere, the catalog's model's (`nodes` in its definition) for a local one."""
    if route.kind == "fleet":
        return route.nodes
    meta = ex.rt.catalog.models.get(route.target)  # type: ignore[attr-defined]
    return meta.nodes if meta is not None else ()


def _one_hop(route: Route) -> str:
    nodes = ", ".join(route.nodes) or "other nodes"
    return (f"model {route.target!r} is served by {nodes}, not by node "
            f"{settings.GPUPROXY_NODE!r}, and this request was forwarded here by another "
            "node: a request is forwarded at most one hop (the two nodes' views of the fleet "
            "disagreed for a moment); send it again")


async def _send_error(ex: UpstreamExchange, status: int, message: str, code: str) -> None:
    await ex.send_json(status, error_body(message, "server_error", code),  # type: ignore
                       outcome=outcomes.UPSTREAM_ERROR)


def headers_for(ex: UpstreamExchange, body_len: int, priority: int,
                arrived: float) -> list[tuple[bytes, bytes]]:
    """The client's headers (its credential included, not its cookies), and the fleet's."""
    rec = ex.rec
    drop = (relay.HOP_BY_HOP | OWN_HEADERS | auth.NEVER_FORWARDED
            | {b"cookie", PRIORITY_HEADER, ARRIVED_HEADER, peers.HOP_HEADER})
    asked = rec.priority_asked
    return [*relay.request_headers(ex.scope["headers"], body_len, drop),
            (peers.HOP_HEADER, b"1"), (PRIORITY_HEADER, str(priority).encode()),
            (ARRIVED_HEADER, f"{arrived:.3f}".encode()),
            (FLEET_HEADER, settings.GPUPROXY_FLEET_KEY.encode()),
            (ENTRY_HEADER, settings.GPUPROXY_NODE.encode()),
            (CLIENT_HEADER, rec.client.encode("latin-1", "replace")),
            (CLIENT_IP_HEADER, rec.client_ip.encode("latin-1", "replace")),
            *([(ASKED_HEADER, str(asked).encode())] if asked is not None else [])]


async def send(ex: UpstreamExchange, node: NodeView, model: str, body: bytes,
               priority: int) -> None:
    """Forward the request as the client sent it (the serving node applies the model's
    filters, as for its own) and relay the answer as it arrives."""
    rec = ex.rec
    rec.model, rec.priority, rec.scheduler = model, priority, SCHEDULER
    arrived = time.time() - (time.monotonic() - rec.received)
    headers = headers_for(ex, len(body), priority, arrived)
    where = f"node {node.node!r} at {url_host(node.url)}"
    path = ex.scope["path"]
    query = ex.scope.get("query_string", b"")
    target = node.url.rstrip("/") + path + ("?" + query.decode("latin-1") if query else "")
    try:
        for fresh in (False, True):
            try:
                response = await relay.send(ex.scope["method"], target, headers, body, 0.0,
                                            fresh=fresh, timeouts=relay.peer_timeout(CONNECT))
                break
            except (httpx.TransportError, aiohttp.ClientError) as exc:
                if fresh or not relay.may_retry(relay.failure(exc)):
                    raise
    except asyncio.CancelledError:  # the client left: the node saw the request, its row
        ex._log = False  # type: ignore[attr-defined]
        raise
    except (httpx.TransportError, aiohttp.ClientError) as exc:
        fail = relay.failure(exc)
        message = (f"{where}, to which this node ({settings.GPUPROXY_NODE!r}) forwarded the "
                   f"request for model {model!r}, {fail.words} before answering "
                   f"({fail.type_name}); the fleet view will show it down within "
                   f"{settings.GPUPROXY_FLEET_DOWN_SECONDS:g} s if it is")
        logger.warning("%s", message)
        await ex.send_json(502, error_body(message, "upstream_error",  # type: ignore
                                           "node_unreachable"), outcome=outcomes.UPSTREAM_ERROR)
        return
    ex._log = False  # type: ignore[attr-defined]  # the serving node writes the row
    await peers.relay_answer(ex, response, where)
