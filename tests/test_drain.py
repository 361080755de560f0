"""SIGTERM drains: requests in flight finish (up to GPUPROXY_SHUTDOWN_GRACE_SECONDS), new and
queued ones get 503 `shutting_down`, then the upstreams stop; a second signal cuts it short.

Real `gpuproxy serve`, real fake upstreams held on a gate (`X-Fake-Gate`), so "in flight" is a
state the test controls, not a timer."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.helpers import Chat, open_gate, process_gone, queue_until, running, until

pytestmark = pytest.mark.django_db(transaction=True)


def chat(model: str = "solo") -> dict:
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


def start_proxy(serve, grace: float | None = None):
    from tests.conftest import FAKE

    start = free_port()
    env = {} if grace is None else {"GPUPROXY_SHUTDOWN_GRACE_SECONDS": str(grace)}
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
    """, env)
    return proxy, start


def test_sigterm_lets_work_in_flight_finish_and_refuses_new_and_queued(serve):
    proxy, upstream_port = start_proxy(serve)
    busy = Chat(proxy.base, "solo", gate="held")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    queued = Chat(proxy.base, "solo")
    queue_until(proxy, lambda q: len(q["queued"]) == 1)
    upstream = running(proxy)["solo"]["pid"]

    proxy.proc.send_signal(signal.SIGTERM)
    r = queued.answered()
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    # (the queued request may still be finishing its 503 when the count is taken)
    waits = until("the log says what the drain waits for", lambda: re.search(
        r"waiting up to 30 s for \d request\(s\) in flight to finish: (.*)", proxy.output()))
    assert "POST /v1/chat/completions" in waits.group(1)
    fresh = httpx.post(proxy.base + "/v1/chat/completions", json=chat(), trust_env=False,
                       timeout=10)
    assert fresh.status_code == 503, fresh.text
    assert fresh.json()["error"]["code"] == "shutting_down"
    assert fresh.headers["retry-after"]
    assert busy.response is None and not process_gone(upstream)  # still being served

    open_gate(upstream_port, "held")
    assert busy.answered().status_code == 200
    assert proxy.proc.wait(30) == 0, proxy.output()
    assert process_gone(upstream)
    assert "drained" in proxy.output()


def test_the_grace_period_ends_the_drain(serve):
    grace = 2.0
    proxy, _ = start_proxy(serve, grace=grace)
    busy = Chat(proxy.base, "solo", gate="never")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    upstream = running(proxy)["solo"]["pid"]
    t0 = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    busy.join(60)
    cut_after = time.monotonic() - t0
    assert proxy.proc.wait(30) == 0, proxy.output()
    assert cut_after >= grace - 0.2, cut_after  # waited the grace period first
    assert cut_after < grace + 15, cut_after
    assert busy.response is None or busy.status != 200  # it never finished: it was cut
    assert process_gone(upstream)
    assert f"grace period of {grace:g} s is over" in proxy.output()


def test_a_second_signal_cuts_the_drain_short(serve):
    proxy, _ = start_proxy(serve, grace=120)
    busy = Chat(proxy.base, "solo", gate="never")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    proxy.proc.send_signal(signal.SIGTERM)
    until("draining", lambda: "request(s) in flight" in proxy.output())
    t0 = time.monotonic()
    proxy.proc.send_signal(signal.SIGINT)
    assert proxy.proc.wait(30) == 0, proxy.output()
    assert time.monotonic() - t0 < 15
    busy.join(30)
    assert "second signal" in proxy.output()
