"""The activity JSON API against real PostgreSQL: filters, limits, bad parameters, and stats
whose percentiles are checked against numbers computed by hand (percentile_cont)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.test import AsyncClient

from activity import outcomes
from activity.models import RequestLog
from gpuproxy.api.activity import percentile_cont
from gpuproxy.shell import runtime

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("gpuproxy.api.activity_urls"),
    pytest.mark.postgres,
]


@pytest.fixture
async def client():
    yield AsyncClient()
    await runtime.shutdown()


def row(minutes_ago: float, **kw) -> RequestLog:
    at = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    base = {
        "request_id": uuid.uuid4(), "received_at": at, "finished_at": at, "method": "POST",
        "path": "/v1/chat/completions", "model_requested": "alpha", "model": "alpha",
        "status_code": 200, "outcome": outcomes.OK, "priority": 0, "band": "normal",
        "scheduler": "serial", "client": "127.0.0.1",
    }
    base.update(kw)
    return RequestLog(**base)


async def seed(rows: list[RequestLog]) -> None:
    await runtime.run_db(lambda: RequestLog.objects.bulk_create(rows))


@pytest.fixture
async def mixed():
    """Four served `alpha` rows (normal band, waits 10..40 ms), one interactive `beta`, one
    rejected `alpha`, and one `alpha` row three hours old."""
    rows = [
        row(1, queue_wait_ms=10, generation_tps=5, prompt_tokens=100, completion_tokens=10),
        row(2, queue_wait_ms=20, generation_tps=15, prompt_tokens=200, completion_tokens=20),
        row(3, queue_wait_ms=30, generation_tps=25, prompt_tokens=300, completion_tokens=30),
        row(4, queue_wait_ms=40, generation_tps=35, prompt_tokens=400, completion_tokens=40),
        row(5, model="beta", model_requested="beta", band="interactive", priority=100,
            queue_wait_ms=2, generation_tps=50, prompt_tokens=7, completion_tokens=3,
            score_parts={"priority": 100, "affinity": 0, "aging": 0, "seq": 4}, score=100.0),
        row(6, outcome=outcomes.REJECTED_QUEUE, status_code=429),
        row(180, queue_wait_ms=9999, prompt_tokens=1, completion_tokens=1),
    ]
    await seed(rows)
    return rows


async def test_list_newest_first_with_every_column(client, mixed):
    r = await client.get("/api/activity")
    assert r.status_code == 200
    body = r.json()
    assert body["limit"] == 100
    assert len(body["data"]) == 7
    times = [d["received_at"] for d in body["data"]]
    assert times == sorted(times, reverse=True)
    columns = {f.attname for f in RequestLog._meta.concrete_fields}
    assert set(body["data"][0]) == columns
    beta = next(d for d in body["data"] if d["model"] == "beta")
    assert beta["score_parts"] == {"priority": 100, "affinity": 0, "aging": 0, "seq": 4}
    assert beta["request_id"] == str(mixed[4].request_id)


async def test_filters(client, mixed):
    async def ids(query: str) -> list[str]:
        r = await client.get("/api/activity" + query)
        assert r.status_code == 200, r.content
        return [d["request_id"] for d in r.json()["data"]]

    rid = [str(x.request_id) for x in mixed]
    assert await ids("?model=beta") == [rid[4]]
    assert await ids("?band=interactive") == [rid[4]]
    assert await ids("?outcome=rejected_queue") == [rid[5]]
    assert await ids("?model=alpha&since=1h") == [rid[0], rid[1], rid[2], rid[3], rid[5]]
    assert await ids("?since=2.5m") == [rid[0], rid[1]]
    assert await ids("?until=2h") == [rid[6]]
    until = (datetime.now(UTC) - timedelta(minutes=3.5)).isoformat()
    assert await ids(f"?since=1h&until={until.replace('+', '%2B')}") == [rid[3], rid[4], rid[5]]
    # an unencoded "+00:00" arrives as a space and is still understood
    assert await ids(f"?since=1h&until={until}") == [rid[3], rid[4], rid[5]]
    assert await ids("?since=2000-01-01&model=alpha&band=normal&outcome=ok") == [
        rid[0], rid[1], rid[2], rid[3], rid[6]]
    assert await ids("?model=nobody") == []


async def test_limit_bounds(client, mixed):
    r = await client.get("/api/activity?limit=2")
    assert r.json()["limit"] == 2 and len(r.json()["data"]) == 2
    assert (await client.get("/api/activity?limit=1")).status_code == 200
    assert (await client.get("/api/activity?limit=1000")).json()["limit"] == 1000
    for bad in ("0", "1001", "-5", "ten", "1.5"):
        r = await client.get(f"/api/activity?limit={bad}")
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "limit"


@pytest.mark.parametrize(("query", "param"), [
    ("since=yesterday", "since"),
    ("since=5y", "since"),
    ("until=2026-13-01", "until"),
    ("since=1h&until=2h", "since"),
    ("outcome=bogus", "outcome"),
])
async def test_bad_parameters_are_400_naming_the_parameter(client, query, param):
    r = await client.get(f"/api/activity?{query}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]
    if param in ("since", "until"):
        r = await client.get(f"/api/activity/stats?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param


async def test_post_is_405(client):
    r = await client.post("/api/activity")
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"


async def test_stats_default_window_is_the_last_hour(client, mixed):
    r = await client.get("/api/activity/stats")
    assert r.status_code == 200
    s = r.json()
    assert s["total"] == 6  # the three-hour-old row is outside the window
    assert s["outcomes"]["ok"] == 5
    assert s["outcomes"]["rejected_queue"] == 1
    assert s["outcomes"]["start_failed"] == 0
    assert s["tokens"] == {"prompt": 1007, "completion": 103, "cached": 0, "input": 0,
                           "output": 0, "draft": 0, "draft_accepted": 0}

    normal = s["bands"]["normal"]
    assert normal["count"] == 5  # the rejected row counts, its NULL wait does not
    assert normal["queue_wait_ms"]["p50"] == pytest.approx(25.0)
    assert normal["queue_wait_ms"]["p95"] == pytest.approx(38.5)  # 30 + 0.85 * 10
    assert normal["queue_wait_ms"]["p99"] == pytest.approx(39.7)  # 30 + 0.97 * 10
    assert normal["generation_tps"]["p50"] == pytest.approx(20.0)
    inter = s["bands"]["interactive"]
    assert inter["count"] == 1
    assert inter["queue_wait_ms"] == {"p50": 2.0, "p95": 2.0, "p99": 2.0}
    assert s["models"]["alpha"]["count"] == 5
    assert s["models"]["alpha"]["queue_wait_ms"]["p50"] == pytest.approx(25.0)
    assert s["models"]["beta"]["generation_tps"]["p50"] == pytest.approx(50.0)


async def test_stats_window_and_model(client, mixed):
    s = (await client.get("/api/activity/stats?since=1d&model=alpha")).json()
    assert s["model"] == "alpha"
    assert s["total"] == 6
    assert set(s["models"]) == {"alpha"}
    assert s["bands"]["normal"]["queue_wait_ms"]["p50"] == pytest.approx(30.0)  # 10..40, 9999
    assert s["tokens"]["prompt"] == 1001
    empty = (await client.get("/api/activity/stats?model=nobody")).json()
    assert empty["total"] == 0 and empty["bands"] == {} and empty["tokens"]["prompt"] == 0


def test_python_fallback_matches_percentile_cont():
    assert percentile_cont([40, 10, 30, 20], 0.5) == 25
    assert percentile_cont([10, 20, 30, 40], 0.95) == pytest.approx(38.5)
    assert percentile_cont([10, 20, 30, 40], 0.99) == pytest.approx(39.7)
    assert percentile_cont([7], 0.99) == 7
    assert percentile_cont([], 0.5) is None


async def test_python_fallback_agrees_with_postgresql(mixed):
    from gpuproxy.api import activity as views

    since = datetime.now(UTC) - timedelta(days=1)
    filters = {"received_at__gte": since}
    for column in ("band", "model"):
        sql = await runtime.run_db(lambda c=column: views._groups_postgresql(c, filters))
        py = await runtime.run_db(lambda c=column: views._groups_python(c, filters))
        assert set(sql) == set(py)
        for key in sql:
            assert sql[key]["count"] == py[key]["count"]
            for name in ("p50", "p95", "p99"):
                assert sql[key]["queue_wait_ms"][name] == pytest.approx(
                    py[key]["queue_wait_ms"][name])
            assert sql[key]["generation_tps"]["p50"] == pytest.approx(
                py[key]["generation_tps"]["p50"])
