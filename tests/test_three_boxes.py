"""Three boxes on one machine (issue 24, item 5): three real `gpuproxy serve` nodes on their
own loopback addresses (127.0.0.2, .3, .4), each with its own GPUPROXY_NODE and data dir, one
PostgreSQL database (the test's), and HAProxy in front on 127.0.0.1 with the shipped
deploy/haproxy/haproxy.cfg, unchanged (its addresses come from the environment; a second
file adds `nbthread 1`, so that no log line is dropped: see the fixture).

The clients connect from 127.0.0.9, so the rows' `client_ip` shows that HAProxy's
X-Forwarded-For reached the nodes and was believed (GPUPROXY_TRUSTED_PROXIES=127.0.0.1, the
address HAProxy connects from).

Every node serves `gpu/shared`, a peer model on one fake upstream the test starts: shared
definitions hand each scheduled model one port for the whole fleet (import writes it into the
command), so on one machine a scheduled model can run on one node only, while a peer model
runs on every node with no process of its own. The one scheduled model is `solo`, on node A
(`nodes: [node-a]`): a request for it that enters by B or C is forwarded to A with the fleet
key, and A's scheduler orders them all. Each request carries a tag, as the body's
`user` (the row's `end_user`) and as `X-Request-Id` (HAProxy's log line, next to the node it
sent the request to), so each answer is matched with its row and its node independently of the
code under test.
"""

from __future__ import annotations

import csv
import http.server
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from django.db import connection

from activity import fleet, writer
from activity.models import RequestLog
from tests.conftest import FAKE, database_url, free_port
from tests.helpers import open_gate, process_gone, stop, tool, until

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NODES = {"node-a": "127.0.0.2", "node-b": "127.0.0.3", "node-c": "127.0.0.4"}
CLIENT = "127.0.0.9"  # the clients' own address, to be read back from X-Forwarded-For
FLEET_KEY = "three-boxes-fleet-key-7f3a"
MODEL = "gpu/shared"
# activity/writer.py's DEFAULT_INTERVAL: a node writes its buffered rows every 0.25 s, so a
# SIGKILL loses at most the rows of requests finished in the last interval, plus the batch
# being written. SLACK covers that batch's COPY and the event loop's lag on a loaded 2-core box.
FLUSH_S = 0.25
SLACK = 0.25
BATCH, INTERACTIVE = -100, 100  # X-LlamaSwap-Priority: the batch and interactive bands
HELD = 6  # requests held in flight at the fake when node C is killed (leastconn: 2 a node)


def test_the_flush_interval_is_the_writers():
    """The bound below is stated for this interval; if the writer's changes, so must it."""
    assert writer.DEFAULT_INTERVAL == FLUSH_S


# ---- the shipped configuration ----------------------------------------------------------------

def test_haproxy_accepts_the_shipped_configuration():
    haproxy = tool("haproxy", "haproxy")
    env = {**os.environ, "GPUPROXY_NODE_A": "10.0.0.11:8080", "GPUPROXY_NODE_B": "10.0.0.12:8080",
           "GPUPROXY_NODE_C": "10.0.0.13:8080"}
    proc = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Configuration file is valid" in proc.stdout + proc.stderr
    assert "WARNING" not in proc.stdout + proc.stderr


def test_haproxy_names_the_missing_node_address():
    haproxy = tool("haproxy", "haproxy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPROXY_NODE_")}
    proc = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0
    assert "GPUPROXY_NODE_A is not set" in proc.stdout + proc.stderr


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A node as HAProxy sees it: /health answers 200, every other request's headers and
    peer are kept for the test to read."""

    seen: list[tuple[str, list[tuple[str, str]]]] = []

    def do_GET(self) -> None:
        if self.path != "/health":
            self.seen.append((self.client_address[0], list(self.headers.items())))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def haproxy_in_front(tmp_path: Path) -> Iterator[tuple[str, str, Path, type[_Recorder]]]:
    """The shipped file in front of one recording node: (front URL, stats URL, admin socket,
    the recorder's class)."""
    haproxy = tool("haproxy", "haproxy")
    recorder = type("Recorder", (_Recorder,), {"seen": []})
    node = http.server.ThreadingHTTPServer(("127.0.0.1", 0), recorder)
    threading.Thread(target=node.serve_forever, daemon=True).start()
    front, stats, sock = free_port(), free_port(), tmp_path / "admin.sock"
    env = {**os.environ, "GPUPROXY_FRONT": f"127.0.0.1:{front}",
           "GPUPROXY_HAPROXY_STATS": f"127.0.0.1:{stats}", "GPUPROXY_HAPROXY_SOCKET": str(sock),
           "GPUPROXY_NODE_A": f"127.0.0.1:{node.server_address[1]}"}
    log = tmp_path / "haproxy.log"
    proxy = subprocess.Popen([haproxy, "-db", "-f", str(CONFIG)], env=env,
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            if proxy.poll() is not None:
                pytest.fail(f"haproxy exited with {proxy.returncode}:\n{log.read_text()}")
            return _answers(f"http://127.0.0.1:{front}")
        until("HAProxy answers on its front port", listening, within=20)
        yield f"http://127.0.0.1:{front}", f"http://127.0.0.1:{stats}", sock, recorder
    finally:
        stop(proxy)
        node.shutdown()
        node.server_close()


def test_haproxy_forwards_only_the_client_address_it_saw(haproxy_in_front, settings):
    """A client's own `Forwarded` would be read before X-Forwarded-For (client_ip.py) and
    name whatever address it likes in the activity row: HAProxy must drop it. A client's
    own X-Forwarded-For stays, harmless: HAProxy appends the peer it saw, the rightmost entry,
    which is where the node reads."""
    from gpuproxy.proxy.client_ip import client_ip, parse_trusted

    front, _, _, recorder = haproxy_in_front
    with httpx.Client(base_url=front, trust_env=False, timeout=10,
                      transport=httpx.HTTPTransport(local_address=CLIENT)) as client:
        r = client.get("/v1/models", headers={"Forwarded": "for=6.6.6.6",
                                              "X-Forwarded-For": "6.6.6.6"})
    assert r.status_code == 200
    [(peer, headers)] = [seen for seen in recorder.seen]
    names = [name.lower() for name, _ in headers]
    assert "forwarded" not in names, headers
    xff = [value for name, value in headers if name.lower() == "x-forwarded-for"]
    assert xff and xff[-1].split(",")[-1].strip() == CLIENT, headers
    # and the node, trusting HAProxy only, records the client
    settings.GPUPROXY_TRUSTED_PROXIES = parse_trusted(peer)
    scope = {"client": (peer, 1), "headers": [(n.lower().encode(), v.encode())
                                              for n, v in headers]}
    assert client_ip(scope) == CLIENT


def test_haproxys_admin_socket_drains_a_node(haproxy_in_front):
    """docs/fleet.md's way to stop a node without a 503: drain it in HAProxy first."""
    _, stats, sock, _ = haproxy_in_front
    assert sock.exists(), "no admin socket: the shipped file has no `stats socket`"
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b"set server nodes/node-a state drain\n")
        s.shutdown(socket.SHUT_WR)
        said = s.recv(4096)
    assert said.strip() == b"", said
    text = httpx.get(f"{stats}/stats;csv", trust_env=False, timeout=5).text
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    [row] = [r for r in rows if r["pxname"] == "nodes" and r["svname"] == "node-a"]
    assert row["status"] == "DRAIN", row


# ---- the fleet on one machine -------------------------------------------------------------------

@dataclass
class Node:
    name: str
    address: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def listen(self) -> str:
        return f"{self.address}:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Answer:
    tag: str
    status: int | None  # None: no HTTP answer (the connection was cut)
    started: float  # time.monotonic() in the test
    ended: float
    error: str = ""
    sent: float = 0.0  # time.time(): the database's rows are on the same machine's clock


@dataclass
class Fleet:
    nodes: dict[str, Node]
    front: str
    stats: str
    haproxy: subprocess.Popen
    haproxy_log: Path
    fake_port: int
    solo_port: int  # node A's own model's fake upstream, started by node A
    answers: list[Answer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.front, trust_env=False, timeout=60,
                            transport=httpx.HTTPTransport(local_address=CLIENT))

    def chat(self, client: httpx.Client, tag: str, headers: dict[str, str] | None = None,
             model: str = MODEL, into: list[Answer] | None = None) -> Answer:
        started, sent = time.monotonic(), time.time()
        try:
            r = client.post("/v1/chat/completions",
                            headers={"X-Request-Id": tag, **(headers or {})},
                            json={"model": model, "max_tokens": 1, "user": tag,
                                  "messages": [{"role": "user", "content": "x"}]})
            answer = Answer(tag, r.status_code, started, time.monotonic(),
                            "" if r.status_code == 200 else r.text[:300], sent)
        except httpx.HTTPError as exc:
            answer = Answer(tag, None, started, time.monotonic(), repr(exc), sent)
        with self.lock:
            (self.answers if into is None else into).append(answer)
        return answer

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's own view of each node (its stats CSV): status, last check, sessions."""
        text = httpx.get(f"{self.stats}/stats;csv", trust_env=False, timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "nodes" and r["svname"] in NODES}

    def routed(self) -> dict[str, str]:
        """Tag -> the node HAProxy sent it to (the last try's, after a redispatch), from its
        log lines: `... nodes/node-a 0/0/0/3/3 200 ... {tag} "POST ..."`."""
        found = {}
        for line in self.haproxy_log.read_text(errors="replace").splitlines():
            # a request HAProxy answered itself names no node: `gpuproxy/<NOSRV>`
            m = re.search(r"\] \S+ (\S+)/(\S+) \S+ -?\d+ .*\{([^}|]*)\} \"", line)
            if m:
                found[m.group(3)] = m.group(2) if m.group(1) == "nodes" else m[1] + "/" + m[2]
        return found


def _bindable(address: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _port_on(address: str) -> int:
    while not _bindable(address, port := free_port()):
        pass
    return port


def _fleet() -> dict[str, fleet.FleetNode]:
    found = {n.row.node: n for n in fleet.fleet()}
    connection.close()
    return found


def _start_node(tmp_path: Path, name: str, config: Path, workers: int) -> Node:
    address = NODES[name]
    port = _port_on(address)
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "DATABASE_URL": database_url(), "GPUPROXY_NODE": name,
           "GPUPROXY_DATA_DIR": str(tmp_path / f"data-{name}"),
           "GPUPROXY_TRUSTED_PROXIES": "127.0.0.1",
           "GPUPROXY_FLEET_KEY": FLEET_KEY,
           "GPUPROXY_ADVERTISE": f"http://{address}:{port}"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(config),
         "--listen", f"{address}:{port}", "--workers", str(workers)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    return Node(name, address, port, proc, log)


def _wait_listening(node: Node) -> None:
    base = f"http://{node.listen}"
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=base, trust_env=False, timeout=1) as h:
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                pytest.fail(f"{node.name} exited with {node.proc.returncode}:\n{node.output()}")
            try:
                if (h.get("/health").status_code == 200
                        and f"listening on {base}" in node.output()):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    pytest.fail(f"{node.name} did not answer /health on {base} within 90 s:\n{node.output()}")


@pytest.fixture
def three_boxes(tmp_path: Path, serve_workers: int) -> Iterator[Fleet]:
    haproxy = tool("haproxy", "haproxy")
    fake_port = free_port()
    fake_log = (tmp_path / "fake.log").open("wb")
    fake = subprocess.Popen(
        [sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(fake_port),
         "--model", "shared"], stdout=fake_log, stderr=subprocess.STDOUT)
    started: list[subprocess.Popen] = [fake]
    try:
        until("the fake upstream answers", lambda: _answers(f"http://127.0.0.1:{fake_port}"))
        config = tmp_path / "config.yaml"
        solo_port = free_port()  # `solo` is the only model whose cmd asks for ${PORT}
        config.write_text(f"""
startPort: {solo_port}
healthCheckTimeout: 15
models:
  solo:
    cmd: {FAKE}
    parallel: 1
    nodes: [node-a]
peers:
  gpu:
    proxy: http://127.0.0.1:{fake_port}
    models: [shared]
""")
        # The first node imports the definitions (and migrates); the others then start with
        # the identical file, together.
        nodes = {"node-a": _start_node(tmp_path, "node-a", config, serve_workers)}
        started.append(nodes["node-a"].proc)
        _wait_listening(nodes["node-a"])
        for name in ("node-b", "node-c"):
            nodes[name] = _start_node(tmp_path, name, config, serve_workers)
            started.append(nodes[name].proc)
        for name in ("node-b", "node-c"):
            _wait_listening(nodes[name])

        front, stats = free_port(), free_port()
        env = {**os.environ, "GPUPROXY_FRONT": f"127.0.0.1:{front}",
               "GPUPROXY_HAPROXY_STATS": f"127.0.0.1:{stats}",
               "GPUPROXY_HAPROXY_SOCKET": str(tmp_path / "admin.sock"),
               "GPUPROXY_NODE_A": nodes["node-a"].listen,
               "GPUPROXY_NODE_B": nodes["node-b"].listen,
               "GPUPROXY_NODE_C": nodes["node-c"].listen}
        haproxy_log = tmp_path / "haproxy.log"
        # The shipped file, plus one thread: HAProxy never blocks on a log write, so two
        # threads that collide on stdout drop a line (src/fd.c, fd_write_frag_line; seen here
        # once in about 25 runs), and the test reads every line to know each request's node.
        one_thread = tmp_path / "one-thread.cfg"
        one_thread.write_text("global\n    nbthread 1\n")
        proxy = subprocess.Popen([haproxy, "-db", "-f", str(CONFIG), "-f", str(one_thread)],
                                 env=env,
                                 stdout=haproxy_log.open("wb"), stderr=subprocess.STDOUT)
        started.append(proxy)
        box = Fleet(nodes, f"http://127.0.0.1:{front}", f"http://127.0.0.1:{stats}", proxy,
                    haproxy_log, fake_port, solo_port)

        def checked_up() -> bool:
            if proxy.poll() is not None:
                pytest.fail(f"haproxy exited with {proxy.returncode}:\n"
                            f"{haproxy_log.read_text(errors='replace')}")
            try:
                seen = box.servers()
            except httpx.TransportError:
                return False
            # L7OK: a real GET /health answered 200 (a server starts UP before any check)
            return len(seen) == 3 and all(s["status"] == "UP" and s["check_status"] == "L7OK"
                                          for s in seen.values())

        until("HAProxy's checks pass on all three nodes", checked_up, within=20)
        yield box
    finally:
        for proc in reversed(started):
            stop(proc)
        fake_log.close()


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", trust_env=False, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _rows(tags: set[str]) -> list[RequestLog]:
    found = list(RequestLog.objects.filter(end_user__in=tags))
    connection.close()
    return found


def _by_tag(rows: list[RequestLog]) -> dict[str, list[RequestLog]]:
    found: dict[str, list[RequestLog]] = {}
    for row in rows:
        found.setdefault(row.end_user, []).append(row)
    return found


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_three_boxes_behind_haproxy(three_boxes: Fleet):
    box = three_boxes
    nodes = box.nodes

    # (a) every node up in the fleet view, at the address it listens on
    def all_up() -> dict[str, fleet.FleetNode] | None:
        seen = _fleet()
        return seen if all(n in seen and seen[n].status == "up" for n in NODES) else None

    up = until("all three nodes are up in the fleet view", all_up, within=10)
    assert {n: up[n].row.listen for n in NODES} == {n: nodes[n].listen for n in NODES}

    # (b) node A's model, flooded with batch requests through the front door, then
    # interactive ones; node A serves them in its priority order, whichever node they entered by
    flood: list[Answer] = []

    def send(tag: str, priority: int, gate: str | None = None) -> threading.Thread:
        headers = {"X-LlamaSwap-Priority": str(priority), **({"X-Fake-Gate": gate} if gate else {})}

        def run() -> None:
            with box.client() as client:
                box.chat(client, tag, headers, model="solo", into=flood)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def on_a(band: str | None = None) -> dict:
        row = _fleet()["node-a"].row
        return (row.queue.get("solo", {}).get(band, {}) if band else row.in_flight) or {}

    blocker = send(f"b-blocker-{uuid.uuid4().hex[:8]}", 0, gate="blocker")
    until("node A serves the blocker (its one slot taken)",
          lambda: on_a().get("solo") == 1, within=30)
    batch = [f"b-batch-{i}-{uuid.uuid4().hex[:8]}" for i in range(8)]
    threads = [send(t, BATCH) for t in batch]
    until("the batch flood waits on node A", lambda: on_a("batch").get("depth") == len(batch))
    interactive = [f"b-interactive-{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    threads += [send(t, INTERACTIVE) for t in interactive]
    until("the interactive requests wait on node A",
          lambda: on_a("interactive").get("depth") == len(interactive))
    open_gate(box.solo_port, "blocker")
    for t in [blocker, *threads]:
        t.join(60)
    assert all(a.status == 200 for a in flood), [a for a in flood if a.status != 200]
    tags = {a.tag for a in flood}
    entered = until("HAProxy logged the flood", lambda: (
        lambda r: r if tags <= set(r) else None)(box.routed()))
    served = until("node A's rows are written", lambda: (
        lambda found: found if set(found) == tags else None)(_by_tag(_rows(tags))))
    assert {t: len(r) for t, r in served.items()} == {a.tag: 1 for a in flood}
    row = {t: r[0] for t, r in served.items()}
    assert {r.node for r in row.values()} == {"node-a"}
    # every interactive request was dispatched before every batch request that waited with it
    assert max(row[t].dispatched_at for t in interactive) < min(
        row[t].dispatched_at for t in batch)
    # forwarded or not, each keeps the priority it entered with, and its age from its arrival
    # at the node it entered by; the row names that node when it is not node A
    sent = {a.tag: a.sent for a in flood}
    for group, priority, band in ((batch, BATCH, "batch"),
                                  (interactive, INTERACTIVE, "interactive")):
        for t in group:
            r = row[t]
            assert (r.priority, r.band, r.client_ip) == (priority, band, CLIENT), t
            assert r.entry_node == ("" if entered[t] == "node-a" else entered[t]), (
                t, r.entry_node, entered[t])
            assert abs(r.received_at.timestamp() - sent[t]) < 0.5, t
            waited = r.dispatched_at.timestamp() - sent[t]
            assert r.queue_wait_ms >= (waited - 0.25) * 1000, (t, r.queue_wait_ms, waited)
    forwarded = {t for t in [*batch, *interactive] if entered[t] != "node-a"}
    assert forwarded & set(batch) and forwarded & set(interactive), entered

    # (c) node C SIGKILLed mid-run: requests held in flight on every node, and a stream of
    # short ones through the front door around the kill
    def hold(tag: str) -> None:
        with box.client() as client:
            box.chat(client, tag, {"X-Fake-Gate": "held"})

    held = [threading.Thread(target=hold, args=(f"held-{i}-{uuid.uuid4().hex[:8]}",),
                             daemon=True) for i in range(HELD)]
    for t in held:
        t.start()
    until(f"HAProxy has the {HELD} held requests open on the nodes",
          lambda: sum(int(s["scur"] or 0) for s in box.servers().values()) == HELD)

    stop = threading.Event()

    def stream(k: int) -> None:
        with box.client() as client:
            i = 0
            while not stop.is_set():
                box.chat(client, f"s{k}-{i}-{uuid.uuid4().hex[:8]}")
                i += 1

    streams = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(4)]
    for t in streams:
        t.start()
    # long enough that node C has answered far more than its last flush interval's worth
    until("node C has answered 300 of the stream", lambda: sum(
        1 for t, n in box.routed().items() if n == "node-c" and t.startswith("s")) >= 300,
        within=60)

    victim = nodes["node-c"]
    family = [victim.proc.pid, *_descendants(victim.proc.pid)]
    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.proc.wait(10)
    until("node C's processes are all gone", lambda: all(process_gone(p) for p in family),
          within=10)
    gone = time.monotonic()

    # both watched in one loop, so neither time includes the wait for the other
    out: dict[str, float] = {}

    def out_everywhere() -> bool:
        if "fleet" not in out and _fleet()["node-c"].status == "down":
            out["fleet"] = time.monotonic() - killed
        if "haproxy" not in out and box.servers()["node-c"]["status"].startswith("DOWN"):
            out["haproxy"] = time.monotonic() - killed
        return len(out) == 2

    until("node C is down in the fleet view and out of HAProxy's rotation", out_everywhere,
          within=6)
    shown_down, out_of_rotation = out["fleet"], out["haproxy"]
    after = len(box.answers)
    until("the stream goes on on the other nodes", lambda: len(box.answers) >= after + 20)
    stop.set()
    for t in streams:
        t.join(30)
    assert not any(t.is_alive() for t in streams)

    with box.client() as client:
        fresh = [box.chat(client, f"new-{i}-{uuid.uuid4().hex[:8]}") for i in range(9)]
    open_gate(box.fake_port, "held")
    for t in held:
        t.join(30)
    assert not any(t.is_alive() for t in held)

    # ---- what happened, by HAProxy's log and the shared activity table
    answers = {a.tag: a for a in box.answers}
    answered = {t for t, a in answers.items() if a.status is not None}
    deadline = time.monotonic() + 20
    while not answered <= set(routed := box.routed()):
        if time.monotonic() > deadline:
            pytest.fail("HAProxy logged no line for these answers: " + repr(
                [answers[t] for t in answered - set(routed)]))
        time.sleep(0.05)
    assert len(answers) == len(box.answers)  # tags are unique
    failed = [a for a in answers.values() if a.status != 200]
    # Only requests in flight on node C fail: each ended after the kill and started before
    # node C was gone. HAProxy answers 502 (and logs node C) on a client's first request on its
    # connection; on a reused one it closes the connection with no answer and no log line, so
    # that the client may retry as after an idle keep-alive close (HAProxy's abort_keep_alive)
    assert failed, "no request was in flight on node C when it was killed"
    assert all(killed <= a.ended and a.started < gone for a in failed), failed
    assert all(routed[a.tag] == "node-c" if a.tag in routed else
               a.status is None and "without sending a response" in a.error
               for a in failed), [(a, routed.get(a.tag)) for a in failed]
    # the held requests were spread over the three nodes; node C's failed, the others' were
    # answered once the fake let them go
    held_on = {t: routed[t] for t in answers if t.startswith("held-")}
    assert set(held_on.values()) == set(NODES), held_on
    assert all((answers[t].status == 200) == (n != "node-c") for t, n in held_on.items())
    # every request sent after node C died succeeded on the others (a connection refused by
    # node C before HAProxy's checks caught up was retried on another node)
    late = [a for a in answers.values() if a.started > gone]
    assert late and all(a.status == 200 and routed[a.tag] != "node-c" for a in late), [
        (a, routed.get(a.tag)) for a in late if a.status != 200 or routed[a.tag] == "node-c"]
    assert all(a.status == 200 for a in fresh)

    # (d) every request answered by node A or B has exactly one row, naming its node
    survivors = {t for t, a in answers.items() if a.status == 200 and routed[t] != "node-c"}
    rows: list[RequestLog] = until("the survivors' rows are written", lambda: (
        lambda r: r if survivors <= {x.end_user for x in r} else None)(_rows(set(answers))))
    by_tag = _by_tag(rows)
    twice = {t: len(r) for t, r in by_tag.items() if len(r) != 1}
    assert not twice, twice
    wrong = {t: (r[0].node, routed.get(t)) for t, r in by_tag.items()
             if r[0].node != routed.get(t)}
    assert not wrong, wrong
    assert {r.client_ip for r in rows} == {CLIENT}
    assert all(r.status_code == 200 and r.model == MODEL for r in rows)

    # node C's rows: those it had flushed are there; the rest are lost
    served_c = [a for a in answers.values() if a.status == 200 and routed[a.tag] == "node-c"]
    in_flight_c = failed
    on_c = served_c + in_flight_c
    lost = [a for a in on_c if a.tag not in by_tag]
    lost_served = [a for a in served_c if a.tag not in by_tag]
    recent = [a for a in served_c if a.ended >= killed - FLUSH_S - SLACK]
    print(f"\nthree-box report (--workers {nodes['node-a'].proc.args[-1]}): node C SIGKILLed; "
          f"shown down in the fleet view after {shown_down:.2f} s, out of HAProxy's rotation "
          f"after {out_of_rotation:.2f} s; {len(answers)} requests through the front door, "
          f"{len(on_c)} sent to node C: {len(served_c)} answered, {len(in_flight_c)} in flight "
          f"at the kill (failed); rows lost: {len(lost)} ({len(lost_served)} answered but not "
          f"flushed, {len(in_flight_c)} in flight); node C answered {len(recent)} in its last "
          f"{FLUSH_S} s flush interval (+{SLACK} s)")
    assert shown_down <= 3.5  # GPUPROXY_FLEET_DOWN_SECONDS=3 after its last heartbeat
    assert out_of_rotation <= 3.5  # inter 1s fall 2
    assert not any(a.tag in by_tag for a in in_flight_c)  # a request cut short has no row
    assert len(lost) <= len(recent) + len(in_flight_c)
    assert all(a.ended >= killed - FLUSH_S - SLACK for a in lost_served)
