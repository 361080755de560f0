"""The fleet view as JSON (issue 24, item 3): every node sharing this database, as
`activity.fleet.fleet()` judges it by the database's clock.

- `GET /api/fleet`: for programs, with the rule of `/api/activity` and `/api/queue` (admin
  keys once keys exist): a node's row names its models and their queues, as `/api/queue`
  does for this node alone.
- `GET /dashboard/fleet`: the same body for the overview's Fleet panel, which never holds an
  API key: an active staff session with the admin's permission to view nodes, as the
  Activity page's data paths (`gpuproxy/api/activity.py` `page_data`).

On SQLite there is no fleet (each box has its own file, and no node publishes there): the
answer is an empty list with `note` saying what it needs, so the panel can say so in one line
rather than look broken. The read runs on the database thread (`runtime.run_db`), never on the
event loop; an outage answers 503 `database_unavailable` in the OpenAI envelope, as the
activity API does.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from activity import fleet as fleet_view
from gpuproxy.api.decorators import api_view, json_error, staff_refusal
from gpuproxy.shell import runtime

NEEDS_POSTGRESQL = ("the fleet view needs PostgreSQL: on SQLite each box has its own database, "
                    "so this is the only node; point DATABASE_URL of every node at one "
                    "PostgreSQL database (docs/fleet.md)")


def node_json(n: fleet_view.FleetNode) -> dict[str, Any]:
    """One node, the row's own words plus what a reader computes (status, age, totals)."""
    row = n.row
    return {
        "node": row.node,
        "status": n.status,
        "heartbeat_age_s": round(n.age, 3),
        "heartbeat_at": row.heartbeat_at.isoformat(),
        "started_at": row.started_at.isoformat(),
        "version": row.version,
        "listen": row.listen,
        "url": row.url,  # where the other nodes forward to (GPUPROXY_ADVERTISE)
        "pid": row.pid,
        "loaded": list(row.loaded or []),
        "queue": row.queue or {},
        "queue_depth": n.queue_depth,
        "in_flight": row.in_flight or {},
        "in_flight_total": n.in_flight,
    }


def read() -> dict[str, Any]:
    """The whole answer, on the database thread."""
    body: dict[str, Any] = {"this_node": settings.GPUPROXY_NODE,
                            "down_after_s": settings.GPUPROXY_FLEET_DOWN_SECONDS}
    if connection.vendor != "postgresql":
        return {**body, "fleet": [], "note": NEEDS_POSTGRESQL}
    return {**body, "fleet": [node_json(n) for n in fleet_view.fleet()]}


async def answer() -> HttpResponse:
    try:
        body = await runtime.run_db(read)
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        detail = (str(exc) if isinstance(exc, runtime.DatabaseUnavailable)
                  else f"database error ({type(exc).__name__})")
        return json_error(503, f"the fleet view cannot be read: {detail}; retry later",
                          type_="server_error", code="database_unavailable",
                          headers={"Retry-After": "5"})
    return JsonResponse(body)


@api_view(("GET",))
async def fleet(request: HttpRequest) -> HttpResponse:
    return await answer()


async def page_data(request: HttpRequest) -> HttpResponse:
    """The overview's Fleet panel: a staff session, not a key (the page never holds one)."""
    if refusal := await staff_refusal(request, "activity.view_node",  # as the admin's Nodes
                                      reading="fleet view", viewing="the fleet",
                                      perm_label="activity | node | Can view node"):
        return refusal
    return await answer()


urlpatterns = [
    path("api/fleet", fleet),
    path("dashboard/fleet", page_data, name="dashboard-fleet-data"),
]
