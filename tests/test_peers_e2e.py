"""Two `gpuproxy serve`s, the entry node with the other as its peer (issue 19's end-to-end
test): an interactive request forwarded with its priority and its arrival, which the second
node believes because the entry node's key is marked trusted peer there, and an ordinary
client's `X-LlamaSwap-Arrived` ignored. Each node has its own database and data dir; the
second node's activity rows are read from its database.

Between the two sits a link that holds each request 1 s: the entry node's arrival is then a
second before the second node's, and only a carried arrival makes the second node's queue
wait start there."""

from __future__ import annotations

import datetime as dt
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection

from activity.models import RequestLog
from scheduling.llamaswap.parsed import api_key_name
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

CLIENT_KEY = "sk-entry-client-0a1b"
TRUSTED_KEY = "sk-entry-node-as-peer-2c3d"
PLAIN_KEY = "sk-second-plain-client-4e5f"
LINK_DELAY = 1.0


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class SlowLink:
    """A TCP relay to `target` that holds each connection's first bytes `delay` seconds: the
    network between two hosts, slowed so the hop's time shows (the delay is the thing
    simulated, not a wait for something)."""

    def __init__(self, target: int, delay: float) -> None:
        self.target = target
        self.delay = delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._link, args=(client,), daemon=True).start()

    def _link(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(upstream, client, 0.0), daemon=True).start()
        self._pump(client, upstream, self.delay)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                    delay = 0.0
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (dst, src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def second_db() -> Iterator[str]:
    """A database of its own for the second node (one gpuproxy per database), dropped after
    the nodes stopped: requested before `serve`, it is torn down after it."""
    s = connection.settings_dict
    name = f"{s['NAME']}_peer"
    admin = dict(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, user=s["USER"],
                 password=s["PASSWORD"] or None, dbname="postgres", autocommit=True)
    with psycopg.connect(**admin) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    yield f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{name}"
    with psycopg.connect(**admin) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def rows(url: str) -> list[dict[str, Any]]:
    """In the order the requests came: under `--workers 2` each request process has its own
    writer, so ids do not follow it."""
    with psycopg.connect(url) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute("SELECT model, priority, band, client, queue_wait_ms, score_parts, "
                    "received_at, dispatched_at, status_code, scheduler "
                    "FROM activity_requestlog ORDER BY received_at")
        return cur.fetchall()


def chat(base: str, key: str, model: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {key}", **headers},
                      json={"model": model, "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})


def test_an_interactive_request_is_forwarded_with_its_priority_and_its_age(
        second_db, serve, tmp_path):
    second = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 15
    apiKeys: ["{PLAIN_KEY}"]
    apiKeyHashes:
      - {{name: entry-node, sha256: {sha(TRUSTED_KEY)}, peer: true}}
    models:
      solo:
        cmd: {FAKE}
    """, extra_env={"DATABASE_URL": second_db, "GPUPROXY_DATA_DIR": str(tmp_path / "second")})
    link = SlowLink(int(second.base.rsplit(":", 1)[1]), LINK_DELAY)
    try:
        entry = serve(f"""
        apiKeys: ["{CLIENT_KEY}"]
        models: {{}}
        peers:
          second:
            proxy: http://127.0.0.1:{link.port}
            apiKey: {TRUSTED_KEY}
            models: [solo]
        """)
        # the model loaded first, so no load is part of a measured wait
        assert chat(second.base, PLAIN_KEY, "solo").status_code == 200

        r = chat(entry.base, CLIENT_KEY, "second/solo", **{"X-LlamaSwap-Priority": "1000"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3

        # an ordinary client's arrival five minutes ago is not believed
        old = f"{time.time() - 300:.3f}"
        plain = chat(second.base, PLAIN_KEY, "solo", **{"X-LlamaSwap-Arrived": old})
        assert plain.status_code == 200, plain.text
    finally:
        link.close()

    got = until("the second node's three rows", lambda: (lambda r: r if len(r) == 3 else None)(
        rows(second_db)))
    forwarded, ignored = got[1], got[2]
    assert (forwarded["client"], forwarded["model"], forwarded["priority"],
            forwarded["band"], forwarded["status_code"]) == (
        "entry-node", "solo", 1000, "interactive", 200)
    [entry_row] = until("the entry node's row", lambda: list(RequestLog.objects.all()))
    assert (entry_row.model, entry_row.scheduler, entry_row.priority, entry_row.status_code,
            entry_row.client) == ("second/solo", "peer", 1000, 200, api_key_name(CLIENT_KEY))
    # the hop took the link's second: the second node got it that much later...
    assert forwarded["received_at"] - entry_row.received_at >= dt.timedelta(
        seconds=LINK_DELAY)
    # ...and its wait counts from the entry node's arrival, not its own
    assert forwarded["queue_wait_ms"] >= LINK_DELAY * 1000
    start = forwarded["dispatched_at"] - dt.timedelta(milliseconds=forwarded["queue_wait_ms"])
    assert abs((start - entry_row.received_at).total_seconds()) < 0.25
    assert forwarded["score_parts"]["aging"] >= LINK_DELAY / 60  # serial, agingDivisor 60
    assert ignored["client"] == api_key_name(PLAIN_KEY)
    assert ignored["queue_wait_ms"] < 1000


def test_a_trusted_peers_arrival_is_believed_up_to_a_day(second_db, serve, tmp_path):
    second = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 15
    apiKeyHashes:
      - {{name: entry-node, sha256: {sha(TRUSTED_KEY)}, peer: true}}
    models:
      solo:
        cmd: {FAKE}
    """, extra_env={"DATABASE_URL": second_db, "GPUPROXY_DATA_DIR": str(tmp_path / "second")})
    assert chat(second.base, TRUSTED_KEY, "solo").status_code == 200  # loaded
    for arrived in (time.time() - 300, time.time() - 3 * 86400, time.time() + 600):
        r = chat(second.base, TRUSTED_KEY, "solo", **{"X-LlamaSwap-Arrived": f"{arrived:.3f}",
                                                      "X-LlamaSwap-Priority": "batch"})
        assert r.status_code == 200, r.text
    got = until("four rows", lambda: (lambda r: r if len(r) == 4 else None)(rows(second_db)))
    waits = [row["queue_wait_ms"] / 1000 for row in got[1:]]
    assert 300 <= waits[0] < 330
    assert 86400 <= waits[1] < 86400 + 30  # clamped to a day
    assert waits[2] < 5  # a clock ahead of ours: no negative age
    assert [row["priority"] for row in got[1:]] == [-100] * 3
