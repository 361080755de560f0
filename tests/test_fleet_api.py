"""`GET /api/fleet` and the overview's `/dashboard/fleet` (gpuproxy/api/fleet.py): every node's
row as JSON with the status the database's clock gives it, for admin keys (or anyone while no
key exists, as `/api/activity`) and for staff who may view nodes; on SQLite an empty fleet
that says what it needs. Rows are written here by hand with heartbeats set against the
database's `now()`; the expected statuses, totals and ages are worked out here."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import Permission, User
from django.db import connection, connections
from django.test import AsyncClient

from activity.models import Node
from gpuproxy.api import fleet as fleet_api
from gpuproxy.shell import runtime
from scheduling.models import ApiKey, hash_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

ADMIN_KEY = "sk-fleet-admin-7d21"
USER_KEY = "sk-fleet-user-93b0"
STARTED = dt.datetime(2026, 12, 5, 6, 0, tzinfo=dt.UTC)


@pytest.fixture
async def client():
    """Session and user lookups leave a connection open on asgiref's thread: closed here so
    that the test database can be dropped."""
    yield AsyncClient()
    await runtime.shutdown()
    await sync_to_async(connections.close_all)()


def seed() -> None:
    """gpu-a up (1 s), gpu-b down (an hour), gpu-c stopped, by the database's clock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0]

    def node(name: str, ago: float, **kw: Any) -> None:
        Node.objects.create(node=name, heartbeat_at=now - dt.timedelta(seconds=ago),
                            started_at=STARTED, pid=4242, **kw)

    node("gpu-a", 1, loaded=["llama", "qwen"], listen="0.0.0.0:8080", version="9.9",
         url="http://10.0.0.1:8080",
         queue={"llama": {"interactive": {"depth": 1, "oldest_wait_s": 0.5},
                          "batch": {"depth": 6, "oldest_wait_s": 41.0}},
                "qwen": {"normal": {"depth": 2, "oldest_wait_s": 3.0}}},
         in_flight={"llama": 2, "qwen": 1})
    node("gpu-b", 3600, loaded=["mistral"], listen="10.0.0.2:8080")
    node("gpu-c", 30, state="stopped")


def without_ages(body: dict) -> dict:
    return {**body, "fleet": [{k: v for k, v in n.items() if k != "heartbeat_age_s"}
                              for n in body["fleet"]]}


async def test_every_node_with_its_status_queue_and_in_flight(client, settings):
    settings.GPUPROXY_FLEET_DOWN_SECONDS = 60  # gpu-a stays up on a slow box
    await runtime.run_db(seed)
    r = await client.get("/api/fleet")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["down_after_s"] == 60 and body["this_node"] == settings.GPUPROXY_NODE
    assert "note" not in body
    nodes = {n["node"]: n for n in body["fleet"]}
    assert list(nodes) == ["gpu-a", "gpu-b", "gpu-c"]
    a, b, c = nodes["gpu-a"], nodes["gpu-b"], nodes["gpu-c"]
    assert (a["status"], b["status"], c["status"]) == ("up", "down", "stopped")
    # ages by the database's clock: the rows were written a moment ago (slack for a busy box)
    assert 1 <= a["heartbeat_age_s"] < 20
    assert 3600 <= b["heartbeat_age_s"] < 3620
    assert 30 <= c["heartbeat_age_s"] < 50
    assert a["loaded"] == ["llama", "qwen"] and b["loaded"] == ["mistral"] and c["loaded"] == []
    assert a["queue"]["llama"]["batch"] == {"depth": 6, "oldest_wait_s": 41.0}
    assert a["queue_depth"] == 9 and b["queue_depth"] == 0  # 1 + 6 + 2
    assert a["in_flight"] == {"llama": 2, "qwen": 1} and a["in_flight_total"] == 3
    assert b["in_flight_total"] == 0
    assert a["listen"] == "0.0.0.0:8080" and a["url"] == "http://10.0.0.1:8080"
    assert b["url"] == "" and a["version"] == "9.9" and a["pid"] == 4242
    assert dt.datetime.fromisoformat(a["started_at"]) == STARTED
    assert dt.datetime.fromisoformat(b["heartbeat_at"]) < dt.datetime.fromisoformat(
        a["heartbeat_at"])


async def test_on_sqlite_an_empty_fleet_says_it_needs_postgresql(client, monkeypatch):
    await runtime.run_db(seed)  # rows that a SQLite answer must not list
    monkeypatch.setattr(fleet_api, "connection", SimpleNamespace(vendor="sqlite"))
    r = await client.get("/api/fleet")
    assert r.status_code == 200
    body = r.json()
    assert body["fleet"] == []
    assert body["note"].startswith("the fleet view needs PostgreSQL")
    assert "DATABASE_URL" in body["note"]


async def test_keys_decide_as_for_api_activity(client):
    """Without keys anyone may read it (the first test); once keys exist, admin keys only."""
    def keys() -> None:
        seed()
        ApiKey.objects.create(name="ops", key_hash=hash_key(ADMIN_KEY), admin=True)
        ApiKey.objects.create(name="app", key_hash=hash_key(USER_KEY), admin=False)

    await runtime.run_db(keys)
    r = await client.get("/api/fleet")
    assert r.status_code == 401 and "gpu-a" not in r.content.decode()
    r = await client.get("/api/fleet", headers={"Authorization": f"Bearer {USER_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert "gpu-a" not in r.content.decode()
    r = await client.get("/api/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and len(r.json()["fleet"]) == 3
    r = await client.post("/api/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 405 and r["Allow"] == "GET"


def person(name: str, staff: bool, may_view: bool) -> User:
    u = User.objects.create_user(name, password="pw", is_staff=staff)
    if may_view:
        u.user_permissions.add(Permission.objects.get(codename="view_node"))
    return u


async def as_user(u: User) -> AsyncClient:
    c = AsyncClient()
    await c.aforce_login(u)
    return c


async def test_the_panels_path_takes_staff_who_may_view_nodes(client, settings):
    settings.GPUPROXY_FLEET_DOWN_SECONDS = 60  # gpu-a stays up on a slow box
    await runtime.run_db(seed)
    outsider, staff, viewer = await runtime.run_db(lambda: (
        person("outsider", False, True), person("staff", True, False),
        person("viewer", True, True)))
    r = await client.get("/dashboard/fleet")
    assert r.status_code == 403 and r.json()["error"]["code"] == "staff_required"
    r = await (await as_user(outsider)).get("/dashboard/fleet")
    assert r.status_code == 403 and r.json()["error"]["code"] == "staff_required"
    r = await (await as_user(staff)).get("/dashboard/fleet")
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_required"
    assert "Can view node" in r.json()["error"]["message"]
    assert "gpu-a" not in r.content.decode()
    seen = await as_user(viewer)
    page = await seen.get("/dashboard/fleet")
    api = await client.get("/api/fleet")
    assert page.status_code == 200 and without_ages(page.json()) == without_ages(api.json())
    assert [n["status"] for n in page.json()["fleet"]] == ["up", "down", "stopped"]
    assert (await seen.post("/dashboard/fleet")).status_code == 405


async def test_a_database_outage_is_a_503_that_says_so(client, monkeypatch):
    async def unreachable(fn):
        raise runtime.DatabaseUnavailable("the database is unreachable (connection refused)")

    assert (await client.get("/api/fleet")).status_code == 200  # the proxy is up
    monkeypatch.setattr(runtime, "run_db", unreachable)
    r = await client.get("/api/fleet")
    assert r.status_code == 503 and r["Retry-After"] == "5"
    error = r.json()["error"]
    assert error["code"] == "database_unavailable"
    assert error["message"] == ("the fleet view cannot be read: the database is unreachable "
                                "(connection refused); retry later")
