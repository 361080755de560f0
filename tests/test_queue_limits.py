"""Bounded queues and queue deadlines through HTTP: 429 queue_full beyond the cap, 503
queue_timeout past a request's deadline, both in the activity log, nothing left behind."""

from __future__ import annotations

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
