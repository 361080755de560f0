"""Waiting clients see progress: a streaming chat request the scheduler makes wait gets its
200 at once and, with sendLoadingState, chunks saying what it waits for (its queue position,
a model load); without it, an SSE comment now and then. Rejections still come first, as JSON."""

from __future__ import annotations

import json
import queue
import threading

import httpx
import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int, loading: bool) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    sendLoadingState: {str(loading).lower()}
    models:
      slow:
        cmd: {FAKE} --load-seconds 1
      solo:
        cmd: {FAKE}
        concurrencyLimit: 2
    groups:
      pair: {{swap: false, members: [slow, solo]}}
    """


class Stream(threading.Thread):
    """A streaming chat request whose lines arrive on `lines` as they come."""

    def __init__(self, base: str, model: str, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.headers = base, model, headers or {}
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, trust_env=False, timeout=60) as h, h.stream(
                "POST", "/v1/chat/completions", headers=self.headers, json={
                    "model": self.model, "stream": True, "max_tokens": 3,
                    "messages": [{"role": "user", "content": "x"}]}) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:  # the blank lines between events carry nothing
                    self.lines.put(line)
        self.lines.put(None)

    def next_line(self, matching: str = "") -> str:
        while True:
            line = self.lines.get(timeout=30)
            assert line is not None, f"the stream ended before {matching!r}"
            if matching in line:
                return line

    def rest(self) -> list[str]:
        out = []
        while (line := self.lines.get(timeout=30)) is not None:
            out.append(line)
        return out


def reasoning(line: str) -> str:
    return json.loads(line[len("data: "):])["choices"][0]["delta"]["reasoning_content"]


def test_a_queued_stream_hears_its_position_then_gets_its_answer(serve):
    start = free_port()
    proxy = serve(config(start, loading=True))
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    s = Stream(proxy.base, "solo", {"X-LlamaSwap-Priority": "batch"})
    line = s.next_line("reasoning_content")  # before the gate opens: while it waits
    assert s.status == 200
    assert reasoning(line) == "waiting in the batch band: position 1\n"
    open_gate(start + 1, "g")
    rest = s.rest()
    assert rest[-1] == "data: [DONE]" and any('"content"' in x for x in rest)
    assert held.answered().status_code == 200


def test_a_stream_behind_a_load_hears_that_the_model_loads(serve):
    proxy = serve(config(free_port(), loading=True))
    s = Stream(proxy.base, "slow")
    assert reasoning(s.next_line("reasoning_content")) == "loading model slow…\n"
    assert s.rest()[-1] == "data: [DONE]"


def test_a_rejection_still_comes_before_any_200(serve):
    start = free_port()
    proxy = serve(config(start, loading=True))
    held = [Chat(proxy.base, "solo", gate="g") for _ in range(2)]  # concurrencyLimit 2
    queue_until(proxy, lambda q: q["in_flight"].get("solo", 0) + len(q["queued"]) == 2)
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "stream": True, "max_tokens": 1, "messages": []})
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit"
    open_gate(start + 1, "g")
    assert [c.answered().status_code for c in held] == [200, 200]


def test_without_loading_state_a_comment_keeps_the_wait_alive(serve):
    start = free_port()
    proxy = serve(config(start, loading=False),
                  extra_env={"GPUPROXY_STREAM_KEEPALIVE_SECONDS": "0.2"})
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    s = Stream(proxy.base, "solo")
    assert s.next_line(": waiting") == ": waiting for the model"
    assert s.status == 200
    open_gate(start + 1, "g")
    rest = s.rest()
    assert rest[-1] == "data: [DONE]"
    assert not any("reasoning_content" in x for x in rest)
    assert held.answered().status_code == 200


def test_a_waiting_stream_gets_its_200_and_a_comment_at_once(serve):
    """Not after the first keep-alive interval (an hour here): a client whose header timeout
    is shorter than the wait would give up before it."""
    start = free_port()
    proxy = serve(config(start, loading=False),
                  extra_env={"GPUPROXY_STREAM_KEEPALIVE_SECONDS": "3600"})
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    s = Stream(proxy.base, "solo")
    assert s.lines.get(timeout=15) == ": waiting for the model"  # the gate is still shut
    assert s.status == 200
    open_gate(start + 1, "g")
    assert s.rest()[-1] == "data: [DONE]"
    assert held.answered().status_code == 200


def test_a_queue_timeout_after_the_200_ends_the_stream_with_an_error_event(serve):
    start = free_port()
    proxy = serve(config(start, loading=True))
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    s = Stream(proxy.base, "solo", {"X-LlamaSwap-Queue-Timeout": "0.5"})
    s.next_line("reasoning_content")
    rest = s.rest()
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == "queue_timeout" and "data: [DONE]" not in rest
    open_gate(start + 1, "g")
    assert held.answered().status_code == 200
