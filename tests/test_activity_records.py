"""Every request lands in activity_requestlog with the right fields: Daphne, real fake
upstreams, real PostgreSQL. Rows are read after a graceful stop, which must flush them."""

from __future__ import annotations

import hashlib
import signal
import time

import httpx
import pytest
from django.db import connection

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until, until

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int, extra: str = "") -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE} --tps 50
        concurrencyLimit: 2
      broken:
        cmd: {FAKE} --exit-on-start 1
    {extra}
    """


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "one two three"}], **kw}


def stop(proxy) -> None:
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()


def test_every_outcome_is_recorded(serve):
    start = free_port()
    proxy = serve(config(start))
    h = proxy.http
    # served, streaming: tokens parsed from the fake upstream's SSE
    sent = time.monotonic()
    with h.stream("POST", "/v1/chat/completions",
                  headers={"X-LlamaSwap-Priority": "interactive", "User-Agent": "t/1"},
                  json=chat("solo", stream=True, max_tokens=4)) as r:
        assert r.status_code == 200
        r.read()
    streamed_within_ms = (time.monotonic() - sent) * 1000
    # served, not streaming
    assert h.post("/v1/chat/completions", json=chat("solo", max_tokens=3),
                  headers={"X-LlamaSwap-Priority": "batch"}).status_code == 200
    # unknown model, bad JSON
    assert h.post("/v1/chat/completions", json=chat("nope")).status_code == 404
    assert h.post("/v1/chat/completions", content=b"{").status_code == 400
    # a failed start
    assert h.post("/v1/chat/completions", json=chat("broken")).status_code == 502

    # 429: two held requests fill solo's concurrencyLimit of 2
    held = [Chat(proxy.base, "solo", gate="held") for _ in range(2)]
    queue_until(proxy, lambda q: q["in_flight"].get("solo", 0) + len(q["queued"]) == 2)
    r = h.post("/v1/chat/completions", json=chat("solo", max_tokens=1))
    assert r.status_code == 429
    open_gate(start + 1, "held")  # broken sorts before solo: solo has the second port
    for c in held:
        assert c.answered().status_code == 200

    # a client that leaves mid-stream
    with h.stream("POST", "/v1/chat/completions",
                  json=chat("solo", stream=True, max_tokens=500)) as r:
        lines = r.iter_lines()
        next(lines)
    until("the proxy noticed the client leave and freed the slot",
          lambda: not h.get("/api/queue").json()["in_flight"])
    stop(proxy)

    # In the order the requests ended: with `--workers N` each request process writes its
    # own rows, so ids follow the writes, not the requests.
    rows = list(RequestLog.objects.order_by("finished_at", "id"))
    by = [(r.model_requested, r.status_code, r.outcome) for r in rows]
    assert by[:5] == [("solo", 200, "ok"), ("solo", 200, "ok"), ("nope", 404, "unknown_model"),
                      ("", 400, "bad_request"), ("broken", 502, "start_failed")]
    assert sorted(by[5:8]) == [("solo", 200, "ok"), ("solo", 200, "ok"),
                               ("solo", 429, "rejected_capacity")]
    assert by[8] == ("solo", 499, "cancelled_inflight")
    assert len(rows) == 9

    streamed, plain = rows[0], rows[1]
    assert streamed.stream and not plain.stream
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (3, 4)
    assert (plain.prompt_tokens, plain.completion_tokens) == (3, 3)
    assert streamed.generation_tps is not None and streamed.generation_tps > 0
    assert (streamed.priority, streamed.band) == (100, "interactive")
    assert (plain.priority, plain.band) == (-100, "batch")
    assert streamed.user_agent == "t/1"
    assert streamed.scheduler == "serial"
    # docs/scheduling.md with the defaults: interactive is 100, the bonus for the model being
    # loaded is 10, aging is seconds waited / 60; the wait is bounded by the test's own clock
    assert 0 < streamed.queue_wait_ms <= streamed_within_ms
    aging = streamed.queue_wait_ms / 1000 / 60
    assert streamed.score_parts["priority"] == 100
    assert streamed.score_parts["affinity"] == 10
    assert streamed.score_parts["aging"] == pytest.approx(aging, abs=1e-6)
    assert streamed.score == pytest.approx(100 + 10 + aging, abs=1e-6)
    assert streamed.swap_ms is not None and streamed.swap_ms > 0  # it waited for solo's load
    assert streamed.queue_wait_ms >= streamed.swap_ms
    assert streamed.ttft_ms is not None and streamed.duration_ms >= streamed.ttft_ms
    assert streamed.received_at <= streamed.dispatched_at <= streamed.first_byte_at \
        <= streamed.finished_at
    # the public start failure: what happened, never the upstream's output (the log has it)
    assert "failed to start" in rows[4].error and "the proxy's log has the details" in rows[4].error
    assert "simulated start failure" not in rows[4].error
    # it never finished: no usage, the output is what was relayed before the client left
    assert rows[8].output_tokens_counted and rows[8].output_tokens >= 1
    assert rows[8].completion_tokens == rows[8].output_tokens and rows[8].input_tokens is None


@pytest.mark.postgres  # the analysts' SQL (percentile_cont) is PostgreSQL's
def test_cancelled_while_queued_and_unauthorized(serve):
    start = free_port()
    # k1, marked admin (it loads and reads the queue) by its export listed beside it
    digest = hashlib.sha256(b"k1").hexdigest()
    proxy = serve(config(start, extra="apiKeys: [k1]\n    apiKeyHashes: [{name: config-"
                                      f"{digest[:8]}, sha256: {digest}, admin: true}}]"))
    auth = {"Authorization": "Bearer k1"}
    assert proxy.http.post("/v1/chat/completions", json=chat("solo")).status_code == 401
    assert proxy.http.post("/api/models/load/solo", headers=auth).status_code == 200
    busy = Chat(proxy.base, "solo", gate="busy", start=False)
    busy.headers.update(auth)
    busy.start()
    until("busy in flight", lambda: proxy.http.get("/api/queue", headers=auth)
          .json()["in_flight"].get("solo") == 1)
    with pytest.raises(httpx.ReadTimeout):  # parallel 1: this one queues, then its client leaves
        httpx.post(proxy.base + "/v1/chat/completions", json=chat("solo", max_tokens=1),
                   headers=auth, trust_env=False, timeout=0.5)
    open_gate(start + 1, "busy")  # broken sorts before solo: solo has the second port
    assert busy.answered().status_code == 200
    stop(proxy)
    rows = list(RequestLog.objects.order_by("id"))
    outcomes = [(r.status_code, r.outcome, r.client) for r in rows]
    assert (401, "unauthorized", "127.0.0.1") in outcomes
    cancelled = next(r for r in rows if r.outcome == "cancelled_queued")
    assert cancelled.dispatched_at is None and cancelled.queue_wait_ms >= 400
    assert cancelled.client.startswith("config-")  # the API key's name, not the address

    # the analyst's query from the issue answers
    with connection.cursor() as cur:
        cur.execute("SELECT band, percentile_cont(0.95) WITHIN GROUP (ORDER BY queue_wait_ms) "
                    "FROM activity_requestlog GROUP BY band")
        assert dict(cur.fetchall()).keys() == {"normal"}
