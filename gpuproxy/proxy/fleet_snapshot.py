"""The fleet as this process last read it: the one input of the forwarding decision.

Every request-serving process (a single `serve`, or each request process of `--workers N`)
reads `activity_node` about once a second (GPUPROXY_FLEET_SECONDS) on a thread of its own,
never on the event loop, and replaces one immutable `Snapshot`. A request's decision reads
that snapshot and nothing else: no query gates it, and one decision sees one fleet. Each
process reads for itself rather than the scheduler process pushing the table through the
hub: one small SELECT a second per process is cheaper than a new message kind, and a request
process keeps deciding while the hub reconnects.

Forwarding is off, and nothing is read, without GPUPROXY_FLEET_KEY or on SQLite (one box).
A snapshot older than GPUPROXY_FLEET_DOWN_SECONDS (the database is away) shows every other
node as unknown, never as the up it last was: a request is then served here or refused, not
sent to a node that may have died meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from django.conf import settings
from django.db import connections

from activity import fleet
from scheduling.fleet_route import NodeView

logger = logging.getLogger("gpuproxy.proxy.fleet")

UNREADABLE = "unknown: the fleet view could not be read"


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[NodeView, ...]
    read_at: float  # time.monotonic() of the read


_state: dict[str, object] = {}  # "snapshot", "task", "loop", "first": this process's
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-snapshot")


def enabled() -> bool:
    """Whether this process forwards at all: a fleet key, and a database a fleet can share."""
    return bool(settings.GPUPROXY_FLEET_KEY) and connections["default"].vendor != "sqlite"


def read() -> tuple[NodeView, ...]:
    """The fleet view as the decision takes it, by the database's clock (its own thread)."""
    try:
        return tuple(NodeView(n.row.node, n.row.url, n.status, frozenset(n.row.loaded or ()),
                              n.queue_depth) for n in fleet.fleet())
    finally:
        connections.close_all()  # this thread's: back to the pool between reads


def every() -> float:
    return settings.GPUPROXY_FLEET_SECONDS or 1.0


async def _refresh() -> None:
    loop = asyncio.get_running_loop()
    first: asyncio.Event = _state["first"]  # type: ignore[assignment]
    failing = False
    while True:
        try:
            nodes = await loop.run_in_executor(_executor, read)
        except Exception as exc:  # the database away: the snapshot ages, the loop goes on
            if not failing:
                logger.warning("fleet: the fleet view could not be read (%s); no request is "
                               "forwarded until it can. Retrying every %g s", exc, every())
            failing = True
        else:
            if failing:
                logger.info("fleet: the fleet view is read again")
            failing = False
            _state["snapshot"] = Snapshot(nodes, time.monotonic())
        first.set()
        await asyncio.sleep(every())


def _ensure_started() -> None:
    loop = asyncio.get_running_loop()
    task = _state.get("task")
    if task is not None and _state.get("loop") is loop and not task.done():  # type: ignore
        return
    _state.update(loop=loop, first=asyncio.Event(), snapshot=None)
    _state["task"] = loop.create_task(_refresh(), name="fleet-snapshot")


async def current(first_within: float = 2.0) -> Snapshot | None:
    """The snapshot to decide by; None when forwarding is off. The process's first request
    waits at most `first_within` seconds for the first read (a node just started would
    otherwise refuse what another node serves)."""
    if not enabled():
        return None
    _ensure_started()
    snap = _state.get("snapshot")
    if snap is None:
        first: asyncio.Event = _state["first"]  # type: ignore[assignment]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_within):
                await first.wait()
        snap = _state.get("snapshot")
    if not isinstance(snap, Snapshot):
        return Snapshot((), time.monotonic())
    if time.monotonic() - snap.read_at > settings.GPUPROXY_FLEET_DOWN_SECONDS:
        here = settings.GPUPROXY_NODE
        return replace(snap, nodes=tuple(n if n.node == here else replace(n, status=UNREADABLE)
                                         for n in snap.nodes))
    return snap

