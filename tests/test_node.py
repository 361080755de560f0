"""Node identity (issue 24, item 1): GPUPROXY_NODE names this box, the one-instance lock is per
node per database, and every activity row and model event says which node wrote it.

The lock's key is written here by hand (the gpuproxy class id and a CRC-32 of the node's
name), not imported from the code under test; so are the expected names and messages.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import sqlite3
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from activity import outcomes
from activity.models import ModelEvent, RequestLog
from activity.writer import ActivityWriter
from gpuproxy.settings import env_node
from gpuproxy.shell.instance import AlreadyServing, InstanceLock, SetupTimeout
from gpuproxy.shell.runtime import own_connection_params
from tests.conftest import database_url, free_port
from tests.helpers import one_model, until

GPRX = 0x67707278
GPUPROXY = str(Path(sys.executable).with_name("gpuproxy"))


def _env_without_node() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "GPUPROXY_NODE"}


# ---- the setting ---------------------------------------------------------------------------

def test_the_node_defaults_to_the_host_name_in_a_real_process(tmp_path: Path):
    env = {**_env_without_node(), "GPUPROXY_DATA_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    out = subprocess.run(
        [GPUPROXY, "shell", "--no-imports", "-c",
         "from django.conf import settings; print(settings.GPUPROXY_NODE)"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == socket.gethostname()


@pytest.mark.parametrize("value", ["gpu-box-1", "a", "Box_7.lab", "x" * 63])
def test_a_node_name_is_taken_as_given(monkeypatch, value):
    monkeypatch.setenv("GPUPROXY_NODE", value)
    assert env_node(hostname="ignored") == value


@pytest.mark.parametrize("value", ["", "x" * 64, "gpu box", "gpu/1", "gpü", "a:b"])
def test_a_bad_node_name_is_refused_with_the_remedy(monkeypatch, value):
    monkeypatch.setenv("GPUPROXY_NODE", value)
    with pytest.raises(ImproperlyConfigured) as refused:
        env_node(hostname="fine")
    text = str(refused.value)
    assert f"GPUPROXY_NODE={value!r}" in text
    assert "63 letters, digits" in text and "unset it" in text


def test_a_host_name_too_long_for_a_node_keeps_its_first_label(monkeypatch):
    monkeypatch.delenv("GPUPROXY_NODE", raising=False)
    assert env_node(hostname="gpu1.lab.example") == "gpu1.lab.example"
    assert env_node(hostname="gpu1." + "a" * 60 + ".example") == "gpu1"
    with pytest.raises(ImproperlyConfigured, match="set GPUPROXY_NODE"):
        env_node(hostname="b" * 64 + ".example")


def test_a_bad_node_stops_the_start(tmp_path: Path):
    env = {**_env_without_node(), "GPUPROXY_DATA_DIR": str(tmp_path), "GPUPROXY_NODE": "gpu 1"}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([GPUPROXY, "serve", "--listen", f"127.0.0.1:{free_port()}"],
                         env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0
    assert "GPUPROXY_NODE='gpu 1' is not a node name" in out.stderr


# ---- the lock: one serve per node per database ----------------------------------------------

def _objid(node: str) -> int:
    return zlib.crc32(node.encode())


def _holders(node: str) -> list[int]:
    with psycopg.connect(**own_connection_params(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
            "AND objid = %s AND objsubid = 2 AND granted AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
            [GPRX, _objid(node)]).fetchall()
    return [pid for (pid,) in rows]


@pytest.fixture
def locks(tmp_path: Path):
    made: list[InstanceLock] = []

    def make(node: str, dir_name: str | None = None, pid: int | None = None) -> InstanceLock:
        data = tmp_path / (dir_name or node)
        data.mkdir(exist_ok=True)
        lock = InstanceLock(data, own_connection_params(), pid=pid, node=node)
        made.append(lock)
        return lock

    yield make
    for lock in made:
        lock.release()


@pytest.mark.postgres
@pytest.mark.django_db
def test_two_nodes_share_a_database_and_a_node_is_refused_twice(locks):
    a, b = locks("node-a", pid=4242), locks("node-b")
    a.acquire()
    b.acquire()  # another node, the same database: both serve
    assert len(_holders("node-a")) == 1 and len(_holders("node-b")) == 1

    with pytest.raises(AlreadyServing) as refused:
        locks("node-a", "node-a-again").acquire()  # its own data dir: only the database says no
    text = str(refused.value)
    assert "another gpuproxy serve for the node 'node-a'" in text
    assert "'gpuproxy serve pid 4242 node node-a" in text  # who holds it
    assert "GPUPROXY_NODE" in text

    a.release()
    until("node-a's lock is gone", lambda: _holders("node-a") == [])
    again = locks("node-a", "node-a-later")
    again.acquire()  # free again once its holder stopped
    assert len(_holders("node-a")) == 1


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_serve_from_before_node_names_and_a_new_one_refuse_each_other(locks):
    """A serve from before this change takes pg_try_advisory_lock(bigint) on the class id
    alone, for the whole database: the two must not both drive the database's GPUs."""
    with psycopg.connect(**own_connection_params(), autocommit=True,
                         application_name="old-gpuproxy") as old:
        assert old.execute("SELECT pg_try_advisory_lock(%s)", [GPRX]).fetchone()[0]
        with pytest.raises(AlreadyServing) as refused:
            locks("node-new").acquire()
        assert "'old-gpuproxy'" in str(refused.value)
        assert "before GPUPROXY_NODE" in str(refused.value)
        old.execute("SELECT pg_advisory_unlock(%s)", [GPRX])

        locks("node-new", "new-2").acquire()
        assert not old.execute("SELECT pg_try_advisory_lock(%s)", [GPRX]).fetchone()[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_serves_with_different_nodes_on_one_database_both_answer(serve, tmp_path: Path):
    config = one_model(free_port())  # the same definitions: the second import changes nothing
    first = serve(config, {"GPUPROXY_NODE": "box-1"})
    second = serve(config, {"GPUPROXY_NODE": "box-2",
                            "GPUPROXY_DATA_DIR": str(tmp_path / "data-2")})
    for proxy in (first, second):
        assert proxy.http.get("/health").status_code == 200
        response = proxy.http.post("/v1/chat/completions",
                                   json={"model": "no-such-model", "messages": []})
        assert response.status_code == 404
    assert first.proc.poll() is None and second.proc.poll() is None

    def nodes() -> list[str]:
        rows = RequestLog.objects.filter(model_requested="no-such-model")
        found = sorted(rows.values_list("node", flat=True))
        connection.close()
        return found if len(found) == 2 else []

    assert until("both rows are written", nodes) == ["box-1", "box-2"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_serve_migrates_only_while_it_holds_the_database_wide_setup_lock(tmp_path: Path):
    """Nodes started together would race the same migration: serve waits for
    pg_advisory_lock(GPRX, 0) (held here as another node would), goes on when it is let go,
    and does not keep it."""
    env = {**os.environ, "DATABASE_URL": database_url(), "GPUPROXY_NODE": "box-late",
           "GPUPROXY_DATA_DIR": str(tmp_path / "data")}
    port = free_port()
    log = tmp_path / "serve.log"
    holder = psycopg.connect(**own_connection_params(), autocommit=True)
    proc = None
    try:
        holder.execute("SELECT pg_advisory_lock(%s, 0)", [GPRX])
        proc = subprocess.Popen([GPUPROXY, "serve", "--listen", f"127.0.0.1:{port}",
                                 "--workers", "1"], stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        until("serve says what it waits for", lambda: "setup lock" in log.read_text(), 60)
        text = log.read_text()
        assert f"pg_advisory_lock({GPRX}, 0)" in text and "another node's serve" in text
        assert "listening on" not in text and proc.poll() is None
        holder.execute("SELECT pg_advisory_unlock(%s, 0)", [GPRX])
        until("serve listens once the lock is let go",
              lambda: "listening on" in log.read_text() or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        assert "got the setup lock after" in log.read_text()
        # and it let go of it: another node can migrate now
        assert holder.execute("SELECT pg_try_advisory_lock(%s, 0)", [GPRX]).fetchone()[0]
    finally:
        holder.close()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(30)


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_setup_lock_held_too_long_stops_the_wait_with_the_holder_named(locks):
    holder = psycopg.connect(**own_connection_params(), autocommit=True,
                             application_name="node-a migrating")
    try:
        holder.execute("SELECT pg_advisory_lock(%s, 0)", [GPRX])
        said: list[str] = []
        with pytest.raises(SetupTimeout) as refused, locks("node-b").setup(wait=0.2,
                                                                           say=said.append):
            pytest.fail("setup went on while another node held the lock")
        assert said and "waiting up to 0.2 s" in said[0] and "'node-a migrating'" in said[0]
        text = str(refused.value)
        assert "gave up after 0.2 s" in text and "'node-a migrating'" in text
        assert "pg_terminate_backend" in text
    finally:
        holder.close()


# ---- the rows ---------------------------------------------------------------------------------

def _row(**kw) -> dict:
    return {"request_id": uuid.uuid4(), "received_at": dt.datetime.now(dt.UTC),
            "method": "POST", "path": "/v1/chat/completions", "outcome": outcomes.OK, **kw}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
async def test_every_row_and_event_carries_the_node(settings):
    settings.GPUPROXY_NODE = "rack2-gpu3"
    requests = ActivityWriter(interval=3600)
    events = ActivityWriter(interval=3600, model="ModelEvent")
    try:
        one = _row()
        requests.submit(one)  # a batch of one: the prepared INSERT
        assert await requests.flush(10)
        batch = [_row() for _ in range(3)]
        named = _row(node="entry-node")  # a row that names its node keeps it
        for r in (*batch, named):
            requests.submit(r)  # a batch: COPY
        assert await requests.flush(10)
        events.submit({"at": dt.datetime.now(dt.UTC), "model": "m", "kind": "load",
                       "reason": "", "pid": 1, "duration_ms": None, "request_id": None,
                       "detail": ""})
        assert await events.flush(10)
    finally:
        await requests.close(10)
        await events.close(10)

    def read():
        try:
            by_id = dict(RequestLog.objects.values_list("request_id", "node"))
            return by_id, list(ModelEvent.objects.values_list("node", flat=True))
        finally:
            connection.close()  # this thread's: the test database is dropped after

    from asgiref.sync import sync_to_async

    by_id, event_nodes = await sync_to_async(read)()
    assert [by_id[r["request_id"]] for r in (one, *batch)] == ["rack2-gpu3"] * 4
    assert by_id[named["request_id"]] == "entry-node"
    assert event_nodes == ["rack2-gpu3"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_rows_from_before_the_migration_and_other_clients_get_an_empty_node():
    before, after = ("activity", "0011_score_parts_budget_override"), ("activity", "0012_node")
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    try:
        old = executor.loader.project_state([before]).apps
        rid = uuid.uuid4()
        old.get_model("activity", "RequestLog").objects.create(
            request_id=rid, received_at=dt.datetime.now(dt.UTC), outcome="ok")
        old.get_model("activity", "ModelEvent").objects.create(
            at=dt.datetime.now(dt.UTC), model="m", kind="load")
        executor = MigrationExecutor(connection)
        executor.migrate([after])
        # only 0012's column: later migrations' columns are not there yet
        assert RequestLog.objects.filter(request_id=rid).values_list("node", flat=True).get() == ""
        assert list(ModelEvent.objects.values_list("node", flat=True)) == [""]
        with connection.cursor() as cursor:  # a client that does not know the column
            cursor.execute("INSERT INTO activity_requestlog (request_id, received_at, method, "
                           "path, model_requested, model, outcome, priority, band, stream, "
                           "scheduler, client, user_agent, error) VALUES (%s, now(), '', '', "
                           "'', '', 'ok', 0, '', false, '', '', '', '') RETURNING node",
                           [uuid.uuid4()])
            assert cursor.fetchone() == ("",)
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname IN "
                           "('activity_rl_node_time', 'activity_me_node_time') ORDER BY 1")
            defs = [d for (d,) in cursor.fetchall()]
        assert len(defs) == 2
        assert "(node, at)" in defs[0] and "(node, received_at)" in defs[1]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE activity_requestlog, activity_modelevent")
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


def test_sqlite_keeps_its_time_index_through_the_rebuilds(tmp_path: Path):
    """SQLite rebuilds a table to add a NOT NULL column, dropping the received_at index that
    0001 made outside Django's state; 0012 makes it again."""
    env = {**_env_without_node(), "GPUPROXY_DATA_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([GPUPROXY, "migrate", "-v", "0"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with sqlite3.connect(tmp_path / "gpuproxy.sqlite3") as db:
        indexes = db.execute("SELECT sql FROM sqlite_master WHERE type = 'index' AND "
                             "tbl_name = 'activity_requestlog'").fetchall()
        columns = [c[1] for c in db.execute("PRAGMA table_info(activity_requestlog)")]
    assert any(sql and sql.endswith("(received_at)") for (sql,) in indexes), indexes
    assert "node" in columns and "entry_node" in columns  # after every rebuild


# ---- the admin ---------------------------------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize(("name", "make"), [
    ("requestlog", lambda node: RequestLog.objects.create(**_row(node=node))),
    ("modelevent", lambda node: ModelEvent.objects.create(
        at=dt.datetime.now(dt.UTC), model="m", kind="load", node=node)),
])
def test_the_admin_lists_filters_and_searches_by_node(admin_client, name, make):
    from django.urls import reverse

    a, b, _old = make("box-a"), make("box-b"), make("")
    url = reverse(f"admin:activity_{name}_changelist")
    page = admin_client.get(url)
    assert page.status_code == 200
    # the filter offers the nodes the rows name (not the '' of older rows) and the column shows
    filters = {spec.title: spec for spec in page.context["cl"].filter_specs}
    assert [choice for choice, _ in filters["node"].lookup_choices] == ["box-a", "box-b"]
    assert 'class="field-node">box-a</td>' in page.content.decode()
    for query in ({"node": "box-b"}, {"q": "box-b"}):
        shown = list(admin_client.get(url, query).context["cl"].result_list)
        assert [row.pk for row in shown] == [b.pk], query
    shown = list(admin_client.get(url, {"node": "box-a"}).context["cl"].result_list)
    assert [row.pk for row in shown] == [a.pk]
