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
