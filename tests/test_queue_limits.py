"""Bounded queues and queue deadlines through HTTP: 429 queue_full beyond the cap, 503
queue_timeout past a request's deadline, both in the activity log, nothing left behind."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from activity.models import RequestLog
from tests.conftest import free_port
from tests.helpers import Chat, one_model, open_gate, queue_until, until

pytestmark = pytest.mark.django_db(transaction=True)


def outcome_count(outcome: str) -> int:
    return RequestLog.objects.filter(outcome=outcome).count()


def test_beyond_the_cap_429_queue_full(serve):
    start = free_port()
    proxy = serve(one_model(start, "queue: {maxWaiting: 2}"))
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    waiting = [Chat(proxy.base, "solo") for _ in range(2)]
    queue_until(proxy, lambda q: len(q["queued"]) == 2)
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 429 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "queue_full"
    open_gate(start, "g")
    assert [c.answered().status_code for c in [held, *waiting]] == [200, 200, 200]
    until("the refusal is in the activity log", lambda: outcome_count("rejected_queue") == 1)


def test_a_request_past_its_deadline_gets_503_queue_timeout(serve):
    start = free_port()
    proxy = serve(one_model(start, "queue: {timeout: 3600}"))
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    r = proxy.http.post("/v1/chat/completions", headers={"X-LlamaSwap-Queue-Timeout": "0.3"},
                        json={"model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_timeout"
    q = proxy.http.get("/api/queue").json()
    assert q["queued"] == [] and q["in_flight"] == {"solo": 1}  # withdrawn, nothing leaked
    open_gate(start, "g")
    assert held.answered().status_code == 200
    until("the timeout is in the activity log", lambda: outcome_count("queue_timeout") == 1)
    row = RequestLog.objects.get(outcome="queue_timeout")
    assert row.status_code == 503 and row.model == "solo"


FLOOD = 500


async def _flood(proxy, upstream: int, n: int) -> tuple[dict, list[int]]:
    """`n` chat requests at once, each held by the fake's gate: wait until the proxy has
    admitted every one (one in flight, the rest queued), then open the gate. Returns the
    queue as it was before the gate opened, and every status code."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=proxy.base, trust_env=False, timeout=120,
                                 limits=limits) as h:
        body = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        calls = [asyncio.create_task(h.post("/v1/chat/completions", json=body,
                                            headers={"X-Fake-Gate": "flood"}))
                 for _ in range(n)]
        deadline = time.monotonic() + 60
        while True:
            answered = [c.result().status_code for c in calls if c.done()]
            assert not answered, (f"{len(answered)} answered before the gate opened, e.g. "
                                  f"{sorted(set(answered))}: not all {n} were admitted")
            queue = (await h.get("/api/queue")).json()
            if queue["in_flight"].get("solo") == 1 and len(queue["queued"]) == n - 1:
                break
            assert time.monotonic() < deadline, f"never all admitted: {len(queue['queued'])}"
            await asyncio.sleep(0.05)  # polling another process's state, with a deadline
        r = await h.post(f"http://127.0.0.1:{upstream}/fake/gates/open", json={"gate": "flood"})
        assert r.status_code == 200
        statuses = [r.status_code for r in await asyncio.gather(*calls)]
    return queue, statuses


def test_500_requests_queued_on_one_model_get_no_429_under_serial_defaults(serve):
    """The serial scheduler's defaults: no concurrencyLimit written, so no per-model cap
    beyond queue.maxWaiting (20,000). llama-swap would refuse all but 10."""
    start = free_port()
    proxy = serve(one_model(start))
    queue, statuses = asyncio.run(_flood(proxy, start, FLOOD))
    assert queue["scheduler"] == "serial"
    assert statuses == [200] * FLOOD
    until("every request is in the activity log",
          lambda: RequestLog.objects.filter(model="solo").count() == FLOOD)
    assert not RequestLog.objects.exclude(status_code=200).exists()


def test_an_explicit_concurrency_limit_still_refuses_under_serial(serve):
    start = free_port()
    proxy = serve(one_model(start).replace("        cmd:", "        concurrencyLimit: 2\n"
                                                          "        cmd:"))
    held = [Chat(proxy.base, "solo", gate="g") for _ in range(2)]
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1 and len(q["queued"]) == 1)
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "concurrency_limit"
    open_gate(start, "g")
    assert [c.answered().status_code for c in held] == [200, 200]


def test_fifo_refuses_the_11th_with_429_as_llama_swap_does(serve):
    """llama-swap's fifo: concurrencyLimit unset means 10, counting queued and served; fifo
    forwards all ten to the upstream (it ignores `parallel`)."""
    start = free_port()
    proxy = serve(one_model(start, "routing: {scheduler: {use: fifo}}"))
    held = [Chat(proxy.base, "solo", gate="g") for _ in range(10)]
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 10)
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "concurrency_limit"
    open_gate(start, "g")
    assert [c.answered().status_code for c in held] == [200] * 10
