"""The fleet view (issue 24, item 3): each serve's heartbeat row in `activity_node`, the reader's
up / down / stopped, and the admin's list. Expected rows, ages and statuses are written here by
hand; the end-to-end test runs two real serves on one database and kills one.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection, connections
from django.urls import reverse

from activity import fleet
from activity.models import Node
from gpuproxy.observe import published
from gpuproxy.shell import runtime
from gpuproxy.shell.fleet import FleetPublisher, books
from gpuproxy.upstream.states import State
from scheduling.core.events import Request
from tests.conftest import free_port
from tests.helpers import Chat, one_model, open_gate, until

T0 = dt.datetime(2026, 12, 5, 7, 0, 0, tzinfo=dt.UTC)


# ---- the scheduler's books, per model and band ----------------------------------------------

def test_the_books_split_the_queue_by_model_and_band():
    a1 = Request(1, "a", arrived=100.0, priority=0)
    a2 = Request(2, "a", arrived=104.0, priority=0)
    a3 = Request(3, "a", arrived=109.0, priority=-100)
    b1 = Request(4, "b", arrived=107.5, priority=60)  # waits on b's load
    fake = SimpleNamespace(
        queued=lambda: [a1, a2, a3], active_swaps=lambda: {"b": [b1]},
        in_flight=lambda m: {"a": 2, "c": 1}.get(m, 0),
        config=SimpleNamespace(models=["a", "b", "c"]))
    queue, in_flight = books(fake, 110.0)
    assert queue == {"a": {"normal": {"depth": 2, "oldest_wait_s": 10.0},
                           "batch": {"depth": 1, "oldest_wait_s": 1.0}},
                     "b": {"interactive": {"depth": 1, "oldest_wait_s": 2.5}}}
    assert in_flight == {"a": 2, "c": 1}


# ---- the publisher ---------------------------------------------------------------------------

QUEUE = {"m1": {"normal": {"depth": 3, "oldest_wait_s": 4.25}}}


def _publisher(queue: dict, in_flight: dict, **kw: Any) -> FleetPublisher:
    async def read() -> tuple[dict, dict]:
        return queue, in_flight

    return FleetPublisher("box-7", "10.0.0.7:8080", read, runtime.run_db, **kw)


@pytest.fixture
async def db_thread():
    """The runtime's database thread keeps its connection: closed after the test, so that the
    test database can be dropped."""
    yield
    await runtime.run_db(lambda: connection.close())


async def _row(node: str) -> Node:
    return await runtime.run_db(lambda: Node.objects.get(node=node))


@pytest.fixture
def loaded_m1():
    before = published.model_states()
    published.set_model_state("m1", State.READY)
    published.set_model_state("m2", State.STARTING)
    yield
    published._cell.model_states = before


@pytest.mark.django_db(transaction=True)
async def test_the_publisher_writes_and_then_rewrites_its_one_row(loaded_m1, db_thread):
    publisher = _publisher(QUEUE, {"m1": 1})
    assert await publisher.publish()
    row = await _row("box-7")
    assert (row.state, row.listen, row.loaded, row.queue, row.in_flight) == (
        "running", "10.0.0.7:8080", ["m1"], QUEUE, {"m1": 1})
    assert row.pid == publisher.pid and row.started_at == publisher.started_at
    first_beat = row.heartbeat_at

    publisher._read = _publisher({}, {})._read  # the queue drained
    assert await publisher.publish()
    assert await runtime.run_db(lambda: Node.objects.count()) == 1  # the same row, rewritten
    row = await _row("box-7")
    assert row.queue == {} and row.in_flight == {} and row.heartbeat_at > first_beat

    await publisher.stop()
    assert (await _row("box-7")).state == "stopped"


@pytest.mark.django_db(transaction=True)
async def test_a_database_error_is_logged_once_and_retried_not_raised(caplog, db_thread):
    calls: list[str] = []

    def write(report: fleet.NodeReport, at: dt.datetime | None, state: str) -> None:
        calls.append(state)
        if len(calls) <= 5:
            raise OperationalError("connection refused")
        fleet.write(report, at, state)

    publisher = _publisher(QUEUE, {}, every=0.01, write=write)
    with caplog.at_level(logging.INFO, logger="gpuproxy.shell.fleet"):
        publisher.start()  # the real loop: it must survive the failures
        deadline = time.monotonic() + 20
        while publisher.written < 2:
            assert time.monotonic() < deadline, "the heartbeat never came back"
            assert publisher._task is not None and not publisher._task.done()
            await asyncio.sleep(0.01)
        await publisher.stop()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
    assert "box-7" in warnings[0].getMessage()
    assert any("written again" in r.getMessage() for r in caplog.records)
    assert calls[:5] == ["running"] * 5 and calls[-1] == "stopped"
    assert (await _row("box-7")).state == "stopped"


# ---- when the publisher runs ---------------------------------------------------------------

def _started(monkeypatch) -> FleetPublisher | None:
    """shell.fleet.start as a serve calls it, with a run loop and database thread that do
    nothing (the publisher's first write is not what these tests look at)."""
    from gpuproxy.shell import fleet as shell_fleet

    async def run_db(fn):
        return None

    monkeypatch.setattr(shell_fleet, "_listen", "127.0.0.1:8080")
    publisher = shell_fleet.start(SimpleNamespace(inspect=lambda read: None), run_db)
    if publisher is not None:
        publisher._task.cancel()
    return publisher


async def test_the_publisher_starts_in_a_serve_on_postgresql(monkeypatch, settings):
    settings.GPUPROXY_FLEET_SECONDS = 1
    monkeypatch.setattr(connections["default"], "vendor", "postgresql")
    assert isinstance(_started(monkeypatch), FleetPublisher)


async def test_fleet_seconds_0_turns_the_publisher_off(monkeypatch, settings):
    settings.GPUPROXY_FLEET_SECONDS = 0
    monkeypatch.setattr(connections["default"], "vendor", "postgresql")
    assert _started(monkeypatch) is None


async def test_the_publisher_does_not_start_on_sqlite(monkeypatch, settings):
    settings.GPUPROXY_FLEET_SECONDS = 1
    monkeypatch.setattr(connections["default"], "vendor", "sqlite")
    assert _started(monkeypatch) is None


@pytest.mark.parametrize(("value", "ok"), [("0", True), ("0.05", True), ("0.01", False)])
def test_fleet_seconds_takes_0_for_off_and_refuses_a_busy_loop(tmp_path: Path, value, ok):
    env = {**os.environ, "GPUPROXY_DATA_DIR": str(tmp_path), "GPUPROXY_FLEET_SECONDS": value}
    env.pop("DATABASE_URL", None)
    out = subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "shell", "--no-imports", "-c",
         "from django.conf import settings; print(settings.GPUPROXY_FLEET_SECONDS)"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    if ok:
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) == float(value)
    else:
        assert out.returncode != 0
        assert "GPUPROXY_FLEET_SECONDS=0.01: give 0 (off) or at least 0.05 seconds" in out.stderr


# ---- the reader ------------------------------------------------------------------------------

def _node(name: str, beat: dt.datetime, state: str = "running", **kw: Any) -> Node:
    return Node.objects.create(node=name, state=state, heartbeat_at=beat, started_at=T0,
                               pid=1, **kw)


@pytest.mark.django_db
def test_the_reader_tells_up_down_and_stopped_by_the_heartbeat(settings):
    settings.GPUPROXY_FLEET_DOWN_SECONDS = 3
    now = T0 + dt.timedelta(minutes=5)
    _node("fresh", now - dt.timedelta(seconds=1))
    _node("edge", now - dt.timedelta(seconds=3))
    _node("silent", now - dt.timedelta(seconds=3.5))
    _node("gone", now - dt.timedelta(hours=1), state="stopped")
    _node("said-stopped", now, state="stopped")
    seen = {n.row.node: (n.status, n.age) for n in fleet.fleet(now)}
    assert seen == {"edge": ("up", 3.0), "fresh": ("up", 1.0), "gone": ("stopped", 3600.0),
                    "said-stopped": ("stopped", 0.0), "silent": ("down", 3.5)}
    assert [n.status for n in fleet.fleet(now, down_after=10)] == [
        "up", "up", "stopped", "stopped", "up"]


@pytest.mark.django_db
def test_a_draining_node_is_draining_while_it_beats_and_down_when_it_falls_silent(settings):
    settings.GPUPROXY_FLEET_DOWN_SECONDS = 3
    now = T0 + dt.timedelta(minutes=5)
    _node("finishing", now - dt.timedelta(seconds=1), state="draining")
    _node("hung", now - dt.timedelta(seconds=4), state="draining")
    assert {n.row.node: n.status for n in fleet.fleet(now)} == {
        "finishing": "draining", "hung": "down"}


@pytest.mark.django_db
def test_the_admin_lists_the_fleet_read_only(admin_client):
    now = dt.datetime.now(dt.UTC)
    _node("gpu-a", now, loaded=["llama", "qwen"], listen="10.0.0.1:8080", version="9.9",
          queue={"llama": {"normal": {"depth": 4, "oldest_wait_s": 2},
                           "batch": {"depth": 3, "oldest_wait_s": 9}}},
          in_flight={"llama": 2, "qwen": 1})
    _node("gpu-b", now - dt.timedelta(seconds=60))
    response = admin_client.get(reverse("admin:activity_node_changelist"))
    assert response.status_code == 200
    text = response.content.decode()
    cells = {row: re.findall(r'<t[dh] class="field-(\w+)[^"]*">(.*?)</t[dh]>', row)
             for row in re.findall(r"<tr>.*?</tr>", text, re.S)}
    rows = {dict(c)["node"]: dict(c) for c in cells.values() if c and "node" in dict(c)}
    assert rows["gpu-a"]["status"] == "up" and rows["gpu-b"]["status"] == "down"
    assert rows["gpu-a"]["loaded_models"] == "llama, qwen"
    assert rows["gpu-a"]["queue_depth"] == "7" and rows["gpu-a"]["in_flight_total"] == "3"
    assert rows["gpu-a"]["listen"] == "10.0.0.1:8080" and rows["gpu-a"]["version"] == "9.9"
    assert rows["gpu-b"]["heartbeat_age"].startswith("60.")
    assert admin_client.get(reverse("admin:activity_node_add")).status_code == 403


@pytest.mark.django_db
def test_the_admin_deletes_a_down_or_stopped_node_but_not_an_up_one(admin_client):
    now = dt.datetime.now(dt.UTC)
    _node("up-1", now)
    _node("down-1", now - dt.timedelta(seconds=60))
    _node("stopped-1", now, state="stopped")

    def delete(node: str) -> int:
        return admin_client.post(reverse("admin:activity_node_delete", args=[node]),
                                 {"post": "yes"}).status_code

    assert delete("up-1") == 403
    assert delete("down-1") == 302 and delete("stopped-1") == 302
    assert list(Node.objects.values_list("node", flat=True)) == ["up-1"]


# ---- one clock: the database's ----------------------------------------------------------------

def _database_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
async def test_a_node_whose_clock_runs_ahead_writes_the_databases_time(monkeypatch, db_thread):
    ahead = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    monkeypatch.setattr("gpuproxy.shell.fleet.timezone", SimpleNamespace(now=lambda: ahead))
    assert await _publisher({}, {}).publish()
    row = await _row("box-7")
    db_now = await runtime.run_db(_database_now)
    assert abs((db_now - row.heartbeat_at).total_seconds()) < 5  # not an hour ahead


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_heartbeat_in_the_readers_future_is_judged_by_the_database_clock(
        admin_client, monkeypatch, settings):
    """The reader's clock runs an hour behind: a heartbeat 60 s old by the database is in its
    future, and by its own clock would read up for the next hour."""
    settings.GPUPROXY_FLEET_DOWN_SECONDS = 3
    _node("stale", _database_now() - dt.timedelta(seconds=60))
    behind = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    monkeypatch.setattr("activity.admin.timezone", SimpleNamespace(now=lambda: behind))
    monkeypatch.setattr("activity.fleet.timezone", SimpleNamespace(now=lambda: behind),
                        raising=False)
    text = admin_client.get(reverse("admin:activity_node_changelist")).content.decode()
    assert re.search(r'class="field-status">down<', text), text
    assert re.search(r'class="field-heartbeat_age">(59|6\d)\.\d s ago<', text), text
    [seen] = fleet.fleet()
    assert seen.status == "down" and 59 < seen.age < 70


# ---- two real serves on one database ---------------------------------------------------------

def _fleet() -> dict[str, fleet.FleetNode]:
    found = {n.row.node: n for n in fleet.fleet()}
    connection.close()
    return found


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_serves_heartbeat_and_a_killed_one_is_shown_down(serve, tmp_path: Path):
    config = one_model(free_port())
    first = serve(config, {"GPUPROXY_NODE": "fleet-1"})
    second = serve(config, {"GPUPROXY_NODE": "fleet-2",
                            "GPUPROXY_DATA_DIR": str(tmp_path / "data-2")})

    def both_up() -> dict[str, fleet.FleetNode] | None:
        seen = _fleet()
        return seen if all(n in seen and seen[n].status == "up"
                           for n in ("fleet-1", "fleet-2")) else None

    both = until("both nodes are up", both_up, within=10)
    for proxy, name in ((first, "fleet-1"), (second, "fleet-2")):
        row = both[name].row
        assert f"http://{row.listen}" == proxy.base
        cmdline = Path(f"/proc/{row.pid}/cmdline").read_bytes().split(b"\0")
        # the process with the run loop: the serve itself, or --workers N's scheduler process
        assert row.pid == proxy.proc.pid or b"scheduler" in cmdline
    beats = {n: _fleet()[n].row.heartbeat_at for n in ("fleet-1", "fleet-2")}
    until("the heartbeats go on", lambda: all(
        _fleet()[n].row.heartbeat_at > beats[n] for n in beats), within=5)
    pids = {n: _fleet()[n].row.pid for n in beats}  # one writer per node: never another pid

    first.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.proc.wait(10)
    until("fleet-1 is shown down", lambda: _fleet()["fleet-1"].status == "down", within=5)
    assert time.monotonic() - killed <= 3.5  # its last heartbeat was before the kill
    assert _fleet()["fleet-2"].status == "up"

    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(30) == 0
    after = _fleet()
    assert after["fleet-2"].status == "stopped" and after["fleet-2"].row.pid == pids["fleet-2"]
    assert after["fleet-1"].status == "down"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_node_that_drains_says_so_until_it_has_stopped(serve):
    """SIGTERM: the node refuses new work but finishes what it holds; the fleet shows it
    draining meanwhile (the forwarding decision and any reader pass it over), then stopped."""
    start = free_port()
    proxy = serve(one_model(start), {"GPUPROXY_NODE": "drainer"})
    busy = Chat(proxy.base, "solo", gate="held")
    until("the request is in flight", lambda: _fleet().get("drainer") is not None
          and _fleet()["drainer"].row.in_flight.get("solo") == 1, within=10)
    proxy.proc.send_signal(signal.SIGTERM)
    until("the node is shown draining", lambda: _fleet()["drainer"].status == "draining",
          within=5)
    assert busy.response is None  # still held: the drain waits for it
    open_gate(start, "held")
    assert busy.answered().status_code == 200
    assert proxy.proc.wait(30) == 0, proxy.output()
    assert _fleet()["drainer"].status == "stopped"


# ---- the bench ---------------------------------------------------------------------------------

@pytest.mark.postgres
def test_the_write_bench_runs_and_drops_its_database():
    url = os.environ["DATABASE_URL"]  # the server's; the bench makes its own database there
    name = f"gpuproxy_bench_fleet_{os.getpid()}"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "fleet_write.py"), "--writes", "40",
         "--nodes", "4", "--batches", "2", "--fleet", "50", "--database", name],
        capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "40 UPSERTs over 4 node rows" in out and "50 nodes at 1/s: 50 writes/s" in out
    assert re.search(r"WAL per write: [1-9]\d* bytes", out), out  # a logged table makes WAL
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            [name]).fetchone() == (0,)
