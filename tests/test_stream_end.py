"""Honest stream termination: an upstream that dies or goes silent mid-stream is never passed
off as a clean end. The client gets an OpenAI-style `error` event and no `data: [DONE]`, the
activity record says `upstream_died`, and the slot is freed."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      dies:
        cmd: {FAKE} --crash-after 1 --tps 200
      silent:
        cmd: {FAKE} --tps 200
        streamIdleTimeout: 1
    """


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def record(model: str) -> RequestLog:
    return until(f"the activity row of {model}", lambda: RequestLog.objects.filter(
        model=model).first())


def test_an_upstream_that_dies_mid_stream_ends_with_an_error_event(serve):
    proxy = serve(config(free_port()))
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "dies", "stream": True, "max_tokens": 40, "messages": []})
    assert r.status_code == 200  # the headers were out before it died
    data = events(r.text)
    assert data and "[DONE]" not in data
    error = json.loads(data[-1])["error"]
    assert error["code"] == "upstream_died" and "dies" in error["message"]
    assert any("choices" in json.loads(d) for d in data[:-1])  # the tokens before it died
    row = record("dies")
    assert row.outcome == "upstream_died" and "died" in row.error
    assert proxy.http.get("/api/queue").json()["in_flight"] == {}


def test_a_stream_that_goes_silent_is_cut_after_its_idle_timeout(serve):
    proxy = serve(config(free_port()))
    silent = {"model": "silent", "stream": True, "max_tokens": 5, "messages": []}
    # The first request waits for the model's load, so its 200 is out before the upstream
    # goes silent: the cut is an error event, and no [DONE].
    started = time.monotonic()
    r = proxy.http.post("/v1/chat/completions", headers={"X-Fake-Hold": "30"}, json=silent)
    assert time.monotonic() - started < 20, "the idle timeout did not cut the silent upstream"
    assert r.status_code == 200
    data = events(r.text)
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["code"] == "upstream_timeout"
    # The model loaded, a request is granted at once: the cut comes before any 200, as JSON.
    started = time.monotonic()
    r = proxy.http.post("/v1/chat/completions", headers={"X-Fake-Hold": "30"}, json=silent)
    assert time.monotonic() - started < 20, "the idle timeout did not cut the silent upstream"
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_timeout"
    rows = until("both activity rows", lambda: list(RequestLog.objects.filter(
        model="silent")) if RequestLog.objects.filter(model="silent").count() == 2 else None)
    assert all(row.outcome == "upstream_died" and "1 s" in row.error for row in rows)
    assert proxy.http.get("/api/queue").json()["in_flight"] == {}


def test_a_clean_stream_still_ends_with_done(serve):
    proxy = serve(config(free_port()))
    with httpx.Client(base_url=proxy.base, trust_env=False, timeout=30) as h:
        r = h.post("/v1/chat/completions", json={
            "model": "silent", "stream": True, "max_tokens": 3, "messages": []})
    assert events(r.text)[-1] == "[DONE]"
