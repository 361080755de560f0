"""A real PostgreSQL outage under a running proxy: requests keep being served, and every
activity row arrives once the database is back (django-stack-notes §6: an inline write would
have made each request wait for the pool timeout and fail)."""

from __future__ import annotations

import signal
import time

import pytest
from django.db import OperationalError, connection

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until
from tests.test_activity_writer import _outage_end, _outage_start

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


def count_rows() -> int:
    """Count, replacing test-side connections the outage terminated (they fail once)."""
    for _ in range(5):
        try:
            return RequestLog.objects.count()
        except OperationalError:
            connection.close()
            pool = getattr(connection, "pool", None)
            if pool is not None:
                pool.check()
    return RequestLog.objects.count()


def test_outage_costs_no_request_and_loses_no_row(serve):
    proxy = serve(f"""
    startPort: {free_port()}
    models:
      solo:
        cmd: {FAKE}
    """)
    body = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for _ in range(5):
        assert proxy.http.post("/v1/chat/completions", json=body).status_code == 200
    _outage_start()
    try:
        for _ in range(20):
            r = proxy.http.post("/v1/chat/completions", json=body, timeout=5)
            assert r.status_code == 200  # the database is never on the request's path
    finally:
        _outage_end()
    for _ in range(5):
        assert proxy.http.post("/v1/chat/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30  # the writer backs off up to 10 s between retries
    while count_rows() < 30 and time.monotonic() < deadline:
        time.sleep(0.2)
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0
    assert count_rows() == 30
    assert "database unavailable" in proxy.output()


def _replace_test_connections() -> None:
    connection.close()
    pool = getattr(connection, "pool", None)
    if pool is not None:
        pool.check()


def test_health_says_degraded_and_the_activity_api_answers_503_at_once(serve):
    """During an outage `/health` stays 200 (inference is served) but says why it is degraded,
    and the activity API, which needs the database, answers 503 in the OpenAI envelope within a
    second instead of hanging on the pool timeout (10 s)."""
    proxy = serve(f"""
    startPort: {free_port()}
    models:
      solo:
        cmd: {FAKE}
    """, {"GPUPROXY_LOCK_CHECK_SECONDS": "0.2"})
    body = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    assert proxy.http.get("/health").text == "OK"
    assert proxy.http.get("/api/activity/stats").status_code == 200
    _outage_start()
    try:
        health = until("/health says degraded", lambda: (
            r := proxy.http.get("/health", timeout=5)).text.startswith("degraded") and r)
        assert health.status_code == 200
        assert "database unreachable since" in health.text, health.text
        assert "requests are served" in health.text, health.text
        for path in ("/api/activity/stats", "/api/activity"):
            t0 = time.monotonic()
            r = proxy.http.get(path, timeout=5)
            elapsed = time.monotonic() - t0
            assert r.status_code == 503, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "database_unavailable" and "since" in error["message"]
            assert r.headers["retry-after"]
            assert elapsed < 1.0, (path, elapsed)
        r = proxy.http.post("/v1/chat/completions", json=body, timeout=5)
        assert r.status_code == 200  # inference goes on
        assert "activity rows are buffered" in proxy.http.get("/health", timeout=5).text
    finally:
        _outage_end()
        _replace_test_connections()
    until("/health is OK again", lambda: proxy.http.get("/health").text == "OK", within=30)
    assert until("the activity API answers again",
                 lambda: proxy.http.get("/api/activity/stats").status_code == 200, within=30)
