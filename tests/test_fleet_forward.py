"""Forwarding between nodes (issue 24, item 4a; docs/fleet.md, "Forwarding between nodes").

Real serves on one PostgreSQL database, each its own GPUPROXY_NODE and data dir: a request to
node A for a model only B serves is answered by B with one row; what a node forwards and what
it believes of a forward; the one hop; a node that is down or unreachable. Where the other
side must be watched byte for byte, it is a fake node: an HTTP server of the test's whose
row the test writes in `activity_node` (a heartbeat an hour ahead: up for the whole test).
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from activity.models import Node, RequestLog
from gpuproxy.proxy import fleet_forward
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, until

KEY = "fleet-secret-for-tests-0123456789"
FLEET = {"GPUPROXY_FLEET_KEY": KEY}

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def placed(start: int) -> str:
    """alpha on node-a only, beta on node-b only (each its own port), gamma everywhere."""
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      alpha:
        cmd: {FAKE}
        nodes: [node-a]
      beta:
        cmd: {FAKE}
        nodes: [node-b]
      gamma:
        cmd: {FAKE}
    """


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            **extra}


def rows(**where: Any) -> list[RequestLog]:
    found = list(RequestLog.objects.filter(**where).order_by("received_at"))
    connection.close()
    return found


def up(*names: str) -> bool:
    seen = {n.node: n for n in Node.objects.all()}
    connection.close()
    return all(n in seen and seen[n].url and (timezone.now() - seen[n].heartbeat_at)
               .total_seconds() < 2 for n in names)


def two_nodes(serve: Any, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[Any, Any]:
    config = placed(free_port())
    a = serve(config, {**FLEET, "GPUPROXY_NODE": "node-a", **(env or {})})
    b = serve(config, {**FLEET, "GPUPROXY_NODE": "node-b", **(env or {}),
                       "GPUPROXY_DATA_DIR": str(tmp_path / "data-b")})
    until("both nodes publish their address", lambda: up("node-a", "node-b"), within=10)
    urls = dict(Node.objects.values_list("node", "url"))
    connection.close()
    assert (urls["node-a"], urls["node-b"]) == (a.base, b.base)  # derived from --listen
    return a, b


class FakeNode:
    """A node of the fleet as the test plays it: records what it is sent, answers a chat."""

    def __init__(self, name: str = "node-f", *, queue: int = 0) -> None:
        seen: list[tuple[dict[str, str], bytes]] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                out = json.dumps({"id": "chatcmpl-node-f", "object": "chat.completion",
                                  "choices": [{"index": 0, "message": {
                                      "role": "assistant", "content": "from node-f"},
                                      "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        write_row(name, self.url, queue)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_row(name: str, url: str, queue: int = 0, loaded: tuple[str, ...] = ()) -> None:
    now = timezone.now()
    Node.objects.update_or_create(node=name, defaults={
        "state": "running", "heartbeat_at": now + dt.timedelta(hours=1), "started_at": now,
        "pid": 1, "url": url, "loaded": list(loaded),
        "queue": {"gamma": {"normal": {"depth": queue, "oldest_wait_s": 0.0}}} if queue else {},
        "in_flight": {}})
    connection.close()


# ---- two real nodes ---------------------------------------------------------------------------

def test_a_model_only_b_serves_is_answered_by_b_with_one_row_naming_both(serve, tmp_path):
    a, _ = two_nodes(serve, tmp_path)
    sent = time.time()
    r = a.http.post("/v1/chat/completions", json=chat("beta"),
                    headers={"X-LlamaSwap-Priority": "7"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta"
    served = until("B's row", lambda: rows(model="beta"), within=10)
    # the entry node writes nothing: its own later rows land, and no second beta row
    for _ in range(2 * a.workers):
        assert a.http.post("/v1/chat/completions", json=chat("alpha")).status_code == 200
    until("A's own rows", lambda: len(rows(model="alpha")) == 2 * a.workers, within=10)
    assert len(rows(model="beta")) == 1
    row = served[0]
    assert (row.node, row.entry_node, row.outcome) == ("node-b", "node-a", "ok")
    assert (row.priority, row.priority_asked) == (7, 7)
    assert abs(row.received_at.timestamp() - sent) < 1.0  # its arrival at A, not at B
    assert rows(model="alpha")[0].entry_node == ""


def test_a_forward_is_never_forwarded_again_and_b_killed_is_named_by_a(serve, tmp_path):
    a, b = two_nodes(serve, tmp_path)
    # a node's forward of alpha (node-a's only) reaching node-b: node-b does not pass it on
    r = b.http.post("/v1/chat/completions", json=chat("alpha"),
                    headers={"X-GpuProxy-Fleet": KEY, "X-GpuProxy-Entry-Node": "node-x"})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "'alpha'" in message and "node-a" in message and "one hop" in message

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    until("node-b is down", lambda: not up("node-b") and _down("node-b"), within=6)
    # node-a's snapshot catches up within a read (a 502 for a forward tried meanwhile)
    r = until("node-a says node-b is down", lambda: (lambda r: r if r.status_code == 503
                                                     else None)(
        a.http.post("/v1/chat/completions", json=chat("beta"))), within=5)
    assert "node-b (down)" in r.json()["error"]["message"]
    assert KEY not in r.text


def _down(name: str) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT now() - heartbeat_at > interval '3 seconds' FROM activity_node "
                    "WHERE node = %s", [name])
        found = cur.fetchone()
    connection.close()
    return bool(found and found[0])


def test_a_node_believes_the_fleet_key_and_nothing_else(serve, tmp_path):
    config = placed(free_port())
    b = serve(config, {**FLEET, "GPUPROXY_NODE": "node-b"})
    forged = {"X-LlamaSwap-Priority": "90", "X-LlamaSwap-Arrived": f"{time.time() - 30:.3f}",
              "X-GpuProxy-Entry-Node": "node-x", "X-GpuProxy-Client": "someone-else",
              "X-GpuProxy-Forwarded": "1"}
    # the fleet header with a wrong key: 401, naming no secret
    r = b.http.post("/v1/chat/completions", json=chat("beta"),
                    headers={**forged, "X-GpuProxy-Fleet": KEY[:-1] + "!"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_fleet_key"
    assert KEY[:8] not in r.text
    # the hop header and the fleet's other headers from a client: served, none believed
    r = b.http.post("/v1/chat/completions", json=chat("beta"), headers=forged)
    assert r.status_code == 200, r.text
    # the right key: the entry node's word is taken
    arrived = time.time() - 5
    r = b.http.post("/v1/chat/completions", json=chat("beta"), headers={
        "X-GpuProxy-Fleet": KEY, "X-GpuProxy-Entry-Node": "node-a",
        "X-GpuProxy-Client": "alice", "X-LlamaSwap-Priority": "-20",
        "X-LlamaSwap-Arrived": f"{arrived:.3f}"})
    assert r.status_code == 200, r.text
    found = until("three rows", lambda: (lambda f: f if len(f) == 3 else None)(rows()), 10)
    refused = next(row for row in found if row.outcome == "unauthorized")
    trusted = next(row for row in found if row.entry_node)
    client = next(row for row in found if row not in (refused, trusted))
    assert refused.outcome == "unauthorized" and refused.entry_node == ""
    assert KEY not in (refused.error or "")
    assert (client.entry_node, client.priority) == ("", 90)  # its own ask, no key range
    assert client.client != "someone-else" and client.queue_wait_ms < 5000
    assert (trusted.entry_node, trusted.client, trusted.priority) == ("node-a", "alice", -20)
    assert trusted.queue_wait_ms >= 5000  # counted from the arrival at node-a
    assert abs(trusted.received_at.timestamp() - arrived) < 0.5


# ---- a fake node: what goes out -----------------------------------------------------------------

def test_a_shorter_queue_elsewhere_takes_a_local_request_with_its_priority_and_age(
        serve, tmp_path):
    start = free_port()
    a = serve(placed(start), {**FLEET, "GPUPROXY_NODE": "node-a", "GPUPROXY_FLEET_MARGIN": "1"})
    node = FakeNode()
    try:
        held = Chat(a.base, "gamma", gate="g")  # gamma's one slot, held by the fake upstream
        until("gamma is busy on node-a", lambda: _in_flight("node-a", "gamma"), within=20)
        # while gamma loaded, the held request was waiting: a snapshot of then would send
        # the next one away. Every request process sees the queue empty first.
        settled("node-a", 0)
        queued = Chat(a.base, "gamma", gate="g")  # waits on node-a: its queue is 1
        settled("node-a", 1)
        assert node.seen == []  # nothing went to node-f while the queues were level
        sent = time.time()
        r = a.http.post("/v1/chat/completions", json=chat("gamma"),
                        headers={"X-LlamaSwap-Priority": "5", "Cookie": "sessionid=s"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "chatcmpl-node-f"
        headers, body = node.seen[-1]
        assert json.loads(body)["model"] == "gamma"
        assert headers["x-gpuproxy-fleet"] == KEY
        assert headers["x-gpuproxy-entry-node"] == "node-a"
        assert headers["x-gpuproxy-forwarded"] == "1"
        assert headers["x-llamaswap-priority"] == "5"
        assert abs(float(headers["x-llamaswap-arrived"]) - sent) < 1.0
        assert "cookie" not in headers
        open_gate(start + 2, "g")  # gamma is the third model: startPort + 2
        assert held.answered().status_code == 200 and queued.answered().status_code == 200
        until("node-a's two rows", lambda: len(rows(model="gamma")) == 2, within=10)
        assert all(row.node == "node-a" for row in rows(model="gamma"))  # none for node-f's
    finally:
        node.close()


def _in_flight(name: str, model: str) -> bool:
    row = Node.objects.filter(node=name).first()
    connection.close()
    return row is not None and bool(row.in_flight.get(model))


def settled(name: str, waiting: int) -> None:
    """The node publishes `waiting` requests waiting, and keeps doing so for two more
    heartbeats: by then each request process's snapshot (read once a second) has it."""
    until(f"{name} publishes {waiting} waiting", lambda: _waiting(name) == waiting, within=10)
    seen = _beat(name)
    until("two more heartbeats", lambda: (_beat(name) - seen).total_seconds() > 1.5,
          within=10)
    assert _waiting(name) == waiting


def _beat(name: str) -> dt.datetime:
    row = Node.objects.get(node=name)
    connection.close()
    return row.heartbeat_at


def _waiting(name: str) -> int:
    row = Node.objects.filter(node=name).first()
    connection.close()
    if row is None:
        return 0
    return sum(int(c.get("depth", 0)) for bands in row.queue.values() for c in bands.values())


def test_a_node_that_cannot_be_reached_is_a_502_row_at_the_entry_node(serve, tmp_path):
    a = serve(placed(free_port()), {**FLEET, "GPUPROXY_NODE": "node-a"})
    closed = free_port()
    write_row("node-b", f"http://127.0.0.1:{closed}", loaded=("beta",))
    until("node-a's own row", lambda: up("node-a"), within=10)
    r = a.http.post("/v1/chat/completions", json=chat("beta"))
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert f"node 'node-b' at 127.0.0.1:{closed}" in message and "'beta'" in message
    row = until("node-a's row", lambda: rows(model="beta"), within=10)[0]
    assert (row.node, row.entry_node, row.outcome, row.status_code) == (
        "node-a", "", "upstream_error", 502)


# ---- the parts ----------------------------------------------------------------------------------

def test_hop_of_believes_only_the_exact_key(settings):
    settings.GPUPROXY_FLEET_KEY = KEY
    assert fleet_forward.hop_of({}) is None
    assert isinstance(fleet_forward.hop_of({b"x-gpuproxy-fleet": KEY.encode() + b"x"}),
                      fleet_forward.Refused)
    hop = fleet_forward.hop_of({b"x-gpuproxy-fleet": KEY.encode(),
                                b"x-gpuproxy-entry-node": b"node-a",
                                b"x-llamaswap-priority": b"12",
                                b"x-llamaswap-arrived": f"{time.time() - 3:.3f}".encode()})
    assert isinstance(hop, fleet_forward.Hop)
    assert (hop.entry_node, hop.priority) == ("node-a", 12) and 2.5 < hop.age < 4
    settings.GPUPROXY_FLEET_KEY = ""  # no key here: every fleet header is refused
    assert isinstance(fleet_forward.hop_of({b"x-gpuproxy-fleet": b""}), fleet_forward.Refused)


def test_the_advertised_url(settings):
    from gpuproxy.shell.fleet import advertised

    settings.GPUPROXY_ADVERTISE = ""
    assert advertised("10.0.0.5", 8080) == "http://10.0.0.5:8080"
    assert advertised("0.0.0.0", 8080, "gpu1") == "http://gpu1:8080"
    assert advertised("::", 8080, "gpu1") == "http://gpu1:8080"
    assert advertised("::1", 8080) == "http://[::1]:8080"
    settings.GPUPROXY_ADVERTISE = "https://gpu1.lab:443"
    assert advertised("0.0.0.0", 8080) == "https://gpu1.lab:443"


@pytest.mark.parametrize(("env", "ok"), [
    ({"GPUPROXY_FLEET_KEY": "short"}, False), ({"GPUPROXY_FLEET_KEY": KEY}, True),
    ({"GPUPROXY_FLEET_MARGIN": "0"}, False), ({"GPUPROXY_FLEET_MARGIN": "off"}, True),
    ({"GPUPROXY_FLEET_MARGIN": "x"}, False), ({"GPUPROXY_ADVERTISE": "10.0.0.5:80"}, False),
    ({"GPUPROXY_ADVERTISE": "http://10.0.0.5:8080/"}, True),
    # deploy/kubernetes/secret.yaml's placeholders, applied unedited
    ({"GPUPROXY_FLEET_KEY": "REPLACE-WITH-32-RANDOM-CHARACTERS"}, False),
    ({"GPUPROXY_SECRET_KEY": "REPLACE-WITH-50-RANDOM-CHARACTERS"}, False)])
def test_the_settings_refuse_what_cannot_work(monkeypatch, env, ok):
    from django.core.exceptions import ImproperlyConfigured

    from gpuproxy import settings as s

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    def read() -> None:
        s.env_fleet_key()
        s.env_margin()
        s.env_advertise()
        s.env_secret_key()
    if ok:
        read()
    else:
        with pytest.raises(ImproperlyConfigured) as err:
            read()
        assert "short" not in str(err.value)  # a key is never repeated back
        assert "RANDOM" not in str(err.value)


@pytest.mark.parametrize(("key", "said"), [("", True), (KEY, False)])
async def test_a_serve_without_a_fleet_key_says_once_that_it_does_not_forward(
        monkeypatch, settings, caplog, key, said):
    from types import SimpleNamespace

    from django.db import connections

    from gpuproxy.shell import fleet as shell_fleet

    async def run_db(fn: Any) -> None:
        return None

    settings.GPUPROXY_FLEET_KEY, settings.GPUPROXY_FLEET_SECONDS = key, 1
    monkeypatch.setattr(connections["default"], "vendor", "postgresql")
    monkeypatch.setattr(shell_fleet, "_listen", "127.0.0.1:8080")
    publisher = shell_fleet.start(SimpleNamespace(inspect=lambda read: None), run_db)
    assert publisher is not None and publisher._task is not None
    publisher._task.cancel()
    lines = [r.getMessage() for r in caplog.records if "forwarding between nodes" in r.message]
    assert len(lines) == (1 if said else 0)
    assert all("GPUPROXY_FLEET_KEY is not set" in line for line in lines)


async def test_the_snapshot_is_read_off_the_loop_and_a_stale_one_trusts_no_other_node(
        monkeypatch, settings):
    from django.db import connections

    from gpuproxy.proxy import fleet_snapshot
    from scheduling.fleet_route import NodeView

    settings.GPUPROXY_FLEET_KEY, settings.GPUPROXY_NODE = KEY, "node-a"
    settings.GPUPROXY_FLEET_SECONDS, settings.GPUPROXY_FLEET_DOWN_SECONDS = 0.05, 3
    monkeypatch.setattr(connections["default"], "vendor", "postgresql")
    threads: list[str] = []
    fleet = (NodeView("node-a", "http://a:1", "up"), NodeView("node-b", "http://b:1", "up"))

    def read() -> tuple[NodeView, ...]:
        threads.append(threading.current_thread().name)
        return fleet

    monkeypatch.setattr(fleet_snapshot, "read", read)
    monkeypatch.setattr(fleet_snapshot, "_state", {})
    try:
        snap = await fleet_snapshot.current()
        assert snap is not None and snap.nodes == fleet
        assert threads and all(t.startswith("fleet-snapshot") for t in threads)
        # the database away for longer than a heartbeat may be missed: node-b is unknown
        fleet_snapshot._state["snapshot"] = fleet_snapshot.Snapshot(fleet, time.monotonic() - 4)
        monkeypatch.setattr(fleet_snapshot, "read", lambda: 1 / 0)
        stale = await fleet_snapshot.current()
        assert stale is not None
        assert [n.status for n in stale.nodes] == ["up", fleet_snapshot.UNREADABLE]
        settings.GPUPROXY_FLEET_KEY = ""
        assert await fleet_snapshot.current() is None  # off: nothing read, nothing decided
    finally:
        task = fleet_snapshot._state.get("task")
        if task is not None:
            task.cancel()


def test_a_capture_never_holds_the_fleet_key():
    from activity.captures import REDACTED, header_map

    got = header_map([(b"X-GpuProxy-Fleet", KEY.encode()), (b"X-GpuProxy-Entry-Node", b"a")])
    assert got == {"X-Gpuproxy-Fleet": REDACTED, "X-Gpuproxy-Entry-Node": "a"}
    assert fleet_forward.FLEET_HEADER == b"x-gpuproxy-fleet"  # the name captures redact


def test_with_keys_a_forward_without_a_key_is_let_in_by_the_fleet_key_alone(serve, tmp_path):
    """The entry node let the caller in (a key, or a staff session whose cookie never
    travels): with keys defined here too, the fleet key is the forward's credential, at the
    edge and in the consumer; without it, the same request is a 401."""
    config = placed(free_port()).replace("models:", "apiKeys: [sk-client-key-0001]\n    models:")
    b = serve(config, {**FLEET, "GPUPROXY_NODE": "node-b"})
    r = b.http.post("/v1/chat/completions", json=chat("beta"))
    assert r.status_code == 401, r.text  # no key, no fleet key
    r = b.http.post("/v1/chat/completions", json=chat("beta"), headers={
        "X-GpuProxy-Fleet": KEY, "X-GpuProxy-Entry-Node": "node-a",
        "X-GpuProxy-Client": "staff:admin", "X-LlamaSwap-Priority": "5"})
    assert r.status_code == 200, r.text
    found = until("the forward's row", lambda: next(
        (row for row in rows() if row.entry_node), None), 10)
    assert (found.client, found.entry_node, found.priority) == ("staff:admin", "node-a", 5)
