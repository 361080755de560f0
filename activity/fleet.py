"""The fleet view (issue 24, item 3): each node's row of `activity_node`, written by its own
serve and read by whoever wants to see the whole fleet.

A node writes its row with one UPSERT (INSERT ... ON CONFLICT (node) DO UPDATE) about once a
second (gpuproxy/shell/fleet.py); the row's `heartbeat_at` is that write's time by the
database's clock (`now()` in the statement). Nothing ever tells the table that a node died: a
reader calls a node down when its heartbeat is older than GPUPROXY_FLEET_DOWN_SECONDS by the
database's clock too, so neither the nodes' clocks nor the reader's need agree with anyone's: a
node whose clock runs ahead cannot look up for as long as it runs ahead. One row per node,
rewritten in place: the table stays as small as the fleet, and the writes cost what
bench/fleet_write.py measures (docs/fleet.md).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from activity.models import Node

RUNNING = "running"
STOPPED = "stopped"  # written by a node on a clean stop
# written by a node from the start of a graceful stop until `stopped`: it refuses new work
# and finishes what it holds, so nothing should be sent to it
DRAINING = "draining"

UP, DOWN = "up", "down"  # computed by a reader; `stopped` is the node's own word

_UPDATED = ["state", "heartbeat_at", "started_at", "pid", "version", "listen", "url", "loaded",
            "queue", "in_flight"]


@dataclass(frozen=True)
class NodeReport:
    """What a node says of itself in one heartbeat."""

    node: str
    pid: int
    started_at: dt.datetime
    version: str = ""
    listen: str = ""
    url: str = ""  # where the other nodes forward to (GPUPROXY_ADVERTISE or from --listen)
    loaded: list[str] = field(default_factory=list)
    # {model: {band: {"depth": n, "oldest_wait_s": s}}}
    queue: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)


def write(report: NodeReport, at: dt.datetime | None = None, state: str = RUNNING) -> None:
    """UPSERT the node's row: one statement, whether the row exists or not (a first start, a
    restart, a node that came back after someone deleted its row). `at` None (a serve's
    heartbeat): the database's `now()`, the clock every reader judges by."""
    beat: Any = Now() if at is None else at
    Node.objects.bulk_create(
        [Node(node=report.node, state=state, heartbeat_at=beat, started_at=report.started_at,
              pid=report.pid, version=report.version, listen=report.listen, url=report.url,
              loaded=report.loaded, queue=report.queue, in_flight=report.in_flight)],
        update_conflicts=True, unique_fields=["node"], update_fields=_UPDATED)


@dataclass(frozen=True)
class FleetNode:
    """One node as a reader sees it: its row and its status at `now`."""

    row: Node
    status: str  # up, draining, down or stopped
    age: float  # seconds since its heartbeat

    @property
    def queue_depth(self) -> int:
        return queue_depth(self.row.queue)

    @property
    def in_flight(self) -> int:
        return sum(int(n) for n in (self.row.in_flight or {}).values())


def status(row: Node, now: dt.datetime, down_after: float | None = None) -> str:
    """`stopped` if the node said so on a clean stop; else `up` while its heartbeat is at
    most `down_after` seconds old (GPUPROXY_FLEET_DOWN_SECONDS), `down` after: a node killed,
    crashed, cut off from the database or frozen stops writing, and only its silence says so."""
    if row.state == STOPPED:
        return STOPPED
    limit = settings.GPUPROXY_FLEET_DOWN_SECONDS if down_after is None else down_after
    if (now - row.heartbeat_at).total_seconds() > limit:
        return DOWN
    return DRAINING if row.state == DRAINING else UP


def database_now() -> dt.datetime:
    """The clock the heartbeats are written by: the database's. SQLite has no fleet (one box,
    one clock), so there it is this process's."""
    if connection.vendor != "postgresql":
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def fleet(now: dt.datetime | None = None, down_after: float | None = None) -> list[FleetNode]:
    """Every node that ever wrote a row, by name, with its status at `now` (default: the
    database's clock, read once per listing; never the reader's own, which may be skewed)."""
    at = database_now() if now is None else now
    return [FleetNode(row, status(row, at, down_after), (at - row.heartbeat_at).total_seconds())
            for row in Node.objects.order_by("node")]


def queue_depth(queue: Any) -> int:
    """The requests waiting on a node, every model and band together."""
    return sum(int(band.get("depth", 0)) for bands in (queue or {}).values()
               for band in bands.values())
