"""One proxy per node per database, through database outages (gpuproxy/shell/instance.py).

The lock is a PostgreSQL session advisory lock: it lives exactly as long as the connection
that took it. The field report cut that connection for one second and a second `serve` then
started on the same database: two schedulers driving one GPU. Here the outages are real
(connections refused and terminated by PostgreSQL itself) and the proxies are real
`gpuproxy serve` processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from tests.conftest import database_url, free_port
from tests.helpers import one_model, process_gone, running, until
from tests.test_activity_writer import _outage_end, _outage_start

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

KEY = 0x67707278  # the lock class; written here by hand, not imported from the code under test
NODE = "lock-test-node"
# the node's lock is (KEY, CRC-32 of its name); pg_locks shows the second key unsigned
NODE_OBJID = zlib.crc32(NODE.encode())
NODE_KEY2 = NODE_OBJID - (1 << 32) if NODE_OBJID >= 1 << 31 else NODE_OBJID
FAST = {"GPUPROXY_LOCK_CHECK_SECONDS": "0.2", "GPUPROXY_NODE": NODE}


def _connect(application_name: str = "gpuproxy-test", dbname: str | None = None
             ) -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432,
                           user=s["USER"], password=s["PASSWORD"] or None,
                           dbname=dbname or s["NAME"], autocommit=True,
                           application_name=application_name)


def lock_holders() -> list[int]:
    """Backend pids holding the lock on the test database, read from pg_locks through the
    maintenance database (the test database refuses connections during an outage)."""
    with _connect(dbname="postgres") as conn:
        rows = conn.execute(
            "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s "
            "AND l.objsubid = 2 AND l.granted AND d.datname = %s",
            [KEY, NODE_OBJID, connection.settings_dict["NAME"]]).fetchall()
    return [pid for (pid,) in rows]


def _replace_test_connections() -> None:
    """The test's own sessions died in the outage too: drop them before the pool hands one
    to the test database's teardown."""
    connection.close()
    pool = getattr(connection, "pool", None)
    if pool is not None:
        pool.check()


def _second_serve(tmp_path: Path) -> subprocess.CompletedProcess:
    cfg = tmp_path / "second.yaml"
    cfg.write_text(one_model(free_port()))
    env = {**os.environ, "DATABASE_URL": database_url(), "GPUPROXY_NODE": NODE,
           "GPUPROXY_DATA_DIR": str(tmp_path / "other-data")}
    return subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
         "--listen", f"127.0.0.1:{free_port()}"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_the_lock_is_taken_again_after_an_outage(serve, tmp_path: Path):
    first = serve(one_model(free_port()), FAST)
    [before] = until("the first proxy holds the lock", lock_holders)
    _outage_start()  # every connection terminated, the lock's too; new ones refused
    try:
        until("the lock is gone with its connection", lambda: lock_holders() == [])
    finally:
        _outage_end()
        _replace_test_connections()
    [after] = until("the first proxy holds the lock again", lock_holders)
    assert after != before  # a new session: the lock was really re-taken
    assert "re-took" in first.output()

    second = _second_serve(tmp_path)
    assert second.returncode != 0, second.stdout + second.stderr
    assert f"another gpuproxy serve for the node {NODE!r} is using the database" in second.stderr
    assert f"gpuproxy serve pid {first.proc.pid}" in second.stderr  # who holds it
    assert first.http.get("/health").status_code == 200
    assert first.proc.poll() is None


def test_losing_the_lock_to_another_holder_stops_this_proxy_loudly(serve):
    """The lock's session is terminated and, before the proxy can take it again, another
    session holds it (`pg_advisory_lock` queued behind the terminated one, so it wins
    deterministically). The proxy must not go on as a second scheduler: it names the holder,
    stops its upstreams and exits non-zero."""
    proxy = serve(one_model(free_port()), FAST)
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    upstream = running(proxy)["solo"]["pid"]
    [holder] = until("the proxy holds the lock", lock_holders)
    with _connect("intruder-7f3a") as intruder:
        intruder.execute("SELECT pg_terminate_backend(%s)", [holder])
        intruder.execute("SELECT pg_advisory_lock(%s, %s)", [KEY, NODE_KEY2])
        assert proxy.proc.wait(30) != 0, proxy.output()
    out = proxy.output()
    assert "intruder-7f3a" in out, out  # the other holder, by its application_name
    assert "ERROR" in out
    assert process_gone(upstream)


def test_a_sigterm_still_exits_0_with_the_lock_watched(serve):
    proxy = serve(one_model(free_port()), FAST)
    until("the proxy holds the lock", lock_holders)
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()
    until("the lock is released", lambda: lock_holders() == [])
