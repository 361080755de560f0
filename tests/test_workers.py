"""`serve --workers N`: what crosses between the scheduler process and the request processes
(docs/scheduler-design.md §8), on a real `gpuproxy serve --workers 2` and real fake upstreams
held on gates. Every other serve-based test also runs with `--workers 2` (tests/conftest.py's
`serve_workers`); these are the ones about the processes themselves: one dying, the metrics
of all of them, the choice of N.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from gpuproxy.management.workers import Supervisor, default_workers
from gpuproxy.observe.exposition import merge
from gpuproxy.shell import wire
from scheduling.core.errors import ConcurrencyLimit, ModelNotFound
from tests.conftest import free_port
from tests.helpers import Chat, one_model, open_gate, process_gone, queue_until, running, until

pytestmark = pytest.mark.django_db(transaction=True)

ONE_SLOT = "    parallel: 1"


def chat(proxy, **headers: str) -> httpx.Response:
    return httpx.post(proxy.base + "/v1/chat/completions", headers=headers, trust_env=False,
                      timeout=30, json={"model": "solo", "max_tokens": 1,
                                        "messages": [{"role": "user", "content": "x"}]})


def roles(proxy) -> dict[str, list[int]]:
    """The supervisor's children by role: "scheduler" and "worker"."""
    found: dict[str, list[int]] = {"scheduler": [], "worker": []}
    for child in psutil.Process(proxy.proc.pid).children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--role" in cmd:
            found[cmd[cmd.index("--role") + 1]].append(child.pid)
    return found


def holder_of(proxy, upstream_port: int) -> int:
    """The request process with a connection open to the upstream (relaying a request)."""
    def find() -> int | None:
        for pid in roles(proxy)["worker"]:
            for conn in psutil.Process(pid).net_connections("tcp"):
                if conn.raddr and conn.raddr.port == upstream_port:
                    return pid
        return None

    return until("a request process relays the held request", find)


def started(proxy, upstream_port: int, gate: str) -> Chat:
    held = Chat(proxy.base, "solo", gate=gate)
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    return held


def held_until_cut(proxy, gate: str) -> threading.Thread:
    """A request held on `gate` whose connection the test is about to kill."""
    def go() -> None:
        with contextlib.suppress(httpx.TransportError):
            chat(proxy, **{"X-Fake-Gate": gate})

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    return thread


@pytest.mark.parametrize("serve_workers", [2])
def test_a_request_process_that_dies_gives_its_grant_back(serve):
    port = free_port()
    proxy = serve(one_model(port, ONE_SLOT))
    client = held_until_cut(proxy, "held")
    victim = holder_of(proxy, port)
    [other] = [p for p in roles(proxy)["worker"] if p != victim]
    os.kill(victim, signal.SIGKILL)
    proxy.http.close()  # its keep-alive connection may have been the dead process's
    proxy.http = httpx.Client(base_url=proxy.base, timeout=60, trust_env=False)
    # The one slot is free again: the scheduler heard the link close, as a client leaving.
    queue_until(proxy, lambda q: q["in_flight"].get("solo", 0) == 0)
    assert chat(proxy).status_code == 200
    until("the supervisor starts another request process",
          lambda: len(roles(proxy)["worker"]) == 2 and victim not in roles(proxy)["worker"])
    assert re.search(rf"request process \d \(pid {victim}\) exited with status -9; starting "
                     "it again", proxy.output()), proxy.output()
    client.join(30)
    assert not client.is_alive()
    # The one started again accepts on the same socket: with the other gone, it serves.
    os.kill(other, signal.SIGKILL)

    def served() -> bool:
        try:
            return chat(proxy).status_code == 200
        except httpx.TransportError:  # the dead one's connections, until the kernel drops them
            return False

    until("the request process started again serves", served)
    open_gate(port, "held")


@pytest.mark.parametrize("serve_workers", [2])
def test_when_the_scheduler_process_dies_waiters_get_503_and_it_comes_back(serve):
    port = free_port()
    proxy = serve(one_model(port, ONE_SLOT))
    held = started(proxy, port, "held")
    queued = Chat(proxy.base, "solo")
    queue_until(proxy, lambda q: len(q["queued"]) == 1)
    upstream = running(proxy)["solo"]["pid"]
    [scheduler] = roles(proxy)["scheduler"]

    os.kill(scheduler, signal.SIGKILL)
    r = queued.answered()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "scheduler_unavailable"
    assert r.headers["retry-after"]
    until("the upstream went with its scheduler process", lambda: process_gone(upstream))
    assert held.answered().status_code == 502  # cut by its upstream's death, said so
    # The supervisor starts a new scheduler process; the request processes reconnect.
    until("requests are served again", lambda: chat(proxy).status_code == 200, within=60)
    assert scheduler not in roles(proxy)["scheduler"]


@pytest.mark.parametrize("serve_workers", [2])
def test_every_request_process_answers_metrics_for_the_whole_proxy(serve):
    port = free_port()
    proxy = serve(one_model(port))
    for _ in range(6):  # a fresh connection each: the kernel spreads them over the processes
        assert chat(proxy).status_code == 200
    pids = {str(p) for p in roles(proxy)["worker"]} | {"scheduler"}
    for _ in range(6):
        r = httpx.get(proxy.base + "/metrics", trust_env=False, timeout=30)
        assert r.status_code == 200, r.text
        text = r.text
        served = re.findall(r'^gpuproxy_requests_total\{band="normal",endpoint="chat",'
                            r'model="solo",outcome="ok",status_class="2xx"\} (\S+)$', text,
                            re.M)
        assert served == ["6.0"], text
        assert re.search(r'^gpuproxy_model_state\{model="solo",state="ready"\} 1\.0$', text,
                         re.M), text
        workers = set(re.findall(r'^process_cpu_seconds_total\{worker="([^"]+)"\}', text,
                                 re.M))
        assert workers == pids, text


def test_sqlite_keeps_one_process(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["GPUPROXY_DATA_DIR"] = str(tmp_path)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--workers", "2",
         "--listen", f"127.0.0.1:{free_port()}"], env=env, capture_output=True, text=True,
        timeout=60, cwd=tmp_path)
    assert result.returncode != 0
    assert "--workers 2 needs PostgreSQL (DATABASE_URL)" in result.stderr, result.stderr


def test_the_default_is_one_process_on_two_cores_or_sqlite_else_a_core_each_up_to_8():
    assert [default_workers(n, sqlite=False) for n in (None, 1, 2, 3, 8, 16)] == \
        [1, 1, 1, 3, 8, 8]
    assert default_workers(16, sqlite=True) == 1


SCHEDULER = """\
# HELP gpuproxy_queue_oldest_wait_seconds oldest
# TYPE gpuproxy_queue_oldest_wait_seconds gauge
gpuproxy_queue_oldest_wait_seconds{band="normal"} 2.0
# HELP gpuproxy_requests_total requests
# TYPE gpuproxy_requests_total counter
gpuproxy_requests_total{model="a"} 0.0
# HELP process_cpu_seconds_total cpu
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 1.5
"""
CHILD = """\
# HELP gpuproxy_queue_oldest_wait_seconds oldest
# TYPE gpuproxy_queue_oldest_wait_seconds gauge
gpuproxy_queue_oldest_wait_seconds{band="normal"} 0.0
# HELP gpuproxy_requests_total requests
# TYPE gpuproxy_requests_total counter
gpuproxy_requests_total{model="a"} 3.0
gpuproxy_requests_total{model="b"} 1.0
# HELP process_cpu_seconds_total cpu
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 0.25
"""


def test_the_merge_sums_series_keeps_process_series_apart_and_takes_the_oldest_wait():
    body, content_type = merge(SCHEDULER, [("11", CHILD), ("12", CHILD)], "")
    lines = set(body.decode().splitlines())
    assert {'gpuproxy_requests_total{model="a"} 6.0', 'gpuproxy_requests_total{model="b"} 2.0',
            'gpuproxy_queue_oldest_wait_seconds{band="normal"} 2.0',
            'process_cpu_seconds_total{worker="scheduler"} 1.5',
            'process_cpu_seconds_total{worker="11"} 0.25',
            'process_cpu_seconds_total{worker="12"} 0.25'} <= lines, lines
    assert content_type.startswith("text/plain")


def test_a_refusal_crosses_the_socket_as_itself():
    for exc in (ModelNotFound("m1"), ConcurrencyLimit("m2", 4)):
        again = wire.error_from(wire.error_state(exc))
        assert type(again) is type(exc)
        assert (again.message, again.status, again.code, again.headers()) == (
            exc.message, exc.status, exc.code, exc.headers())
    assert wire.error_from(wire.error_state(ModelNotFound("m1"))).model == "m1"


def test_sighup_rereads_the_definitions_in_every_process(serve):
    """With the periodic check an hour apart and the change made behind Django's back (no
    save signal, no NOTIFY), only SIGHUP can apply it; with `--workers 2` it is the
    supervisor's SIGHUP, passed to the scheduler process, whose new catalog reaches both
    request processes (each scrape below may land on either). Serve was given a config
    file, unchanged: SIGHUP re-imports nothing, and re-reads the database all the same."""
    from django.db import connection

    port = free_port()
    proxy = serve(one_model(port), {"GPUPROXY_RELOAD_SECONDS": "3600"})

    def described() -> set[str]:
        return {httpx.get(proxy.base + "/v1/models", trust_env=False, timeout=30)
                .json()["data"][0].get("description") for _ in range(6)}

    for text in ("first words", "second words"):  # the second, long after start-up's reload
        with connection.cursor() as cursor:
            cursor.execute("UPDATE scheduling_modeldefinition SET description = %s "
                           "WHERE model_id = 'solo'", [text])
        proxy.proc.send_signal(signal.SIGHUP)
        until(f"every process lists {text!r}", lambda text=text: described() == {text})
    assert proxy.proc.poll() is None


def test_a_sighup_while_the_scheduler_process_starts_waits_until_it_is_ready():
    """Passed on at once, it would end a scheduler process that has not yet put its handler
    in place (SIGHUP's default), or be ignored and lost: the supervisor holds one SIGHUP for
    it and passes it on once the process says it is ready."""
    sent: list[int] = []
    with socket.socket() as sock:
        supervisor = Supervisor("127.0.0.1", 1, sock, 1, Path("unused.sock"), grace=1.0)
    process = supervisor.scheduler
    process.signal = sent.append  # type: ignore[method-assign]

    async def start() -> bool:
        assert sent == []  # nothing reached it while it started
        process.ready = True
        return True

    process.start = start  # type: ignore[method-assign]
    supervisor._on_hangup()
    supervisor._on_hangup()  # two while it starts: one reload
    assert sent == []
    assert asyncio.run(supervisor._start_scheduler())
    assert sent == [signal.SIGHUP]
    supervisor._on_hangup()  # once it runs: at once
    assert sent == [signal.SIGHUP, signal.SIGHUP]


@pytest.mark.parametrize("serve_workers", [2])
def test_a_stop_signal_sent_to_every_process_is_one_drain(serve):
    """A service manager's SIGTERM to the whole group (systemd's default), or a Ctrl-C on a
    terminal, reaches every process directly as well as through the supervisor: that is one
    stop, and the request in flight still finishes."""
    port = free_port()
    proxy = serve(one_model(port, ONE_SLOT))
    held = started(proxy, port, "held")
    children = roles(proxy)
    for pid in (*children["worker"], *children["scheduler"]):
        os.kill(pid, signal.SIGTERM)
    until("every process drains", lambda: proxy.output().count(
        "SIGTERM: draining") == 2 and "scheduler process: draining" in proxy.output())
    proxy.proc.send_signal(signal.SIGTERM)  # the same stop, now through the supervisor
    until("the supervisor passed it on", lambda: "SIGTERM: stopping the request processes"
          in proxy.output())
    until("the drain waits for the request in flight",
          lambda: "waiting up to 30 s for 1 request(s) in flight" in proxy.output())
    open_gate(port, "held")
    assert held.answered().status_code == 200
    assert proxy.proc.wait(30) == 0, proxy.output()
    assert "cut" not in proxy.output(), proxy.output()


def test_a_gone_request_processs_counts_stay_in_the_sums():
    """Its counters and histograms are added still, so no merged counter goes down; its
    gauges and its own process series are not."""
    gone = CHILD.replace("3.0", "5.0")
    body, _ = merge(SCHEDULER, [("11", CHILD)], "", departed=[gone])
    lines = set(body.decode().splitlines())
    assert 'gpuproxy_requests_total{model="a"} 8.0' in lines, lines  # 0 + 3 + 5
    assert 'process_cpu_seconds_total{worker=""} 0.25' not in lines
    assert not any(line.startswith("process_cpu_seconds_total") and 'worker=""' in line
                   for line in lines)
