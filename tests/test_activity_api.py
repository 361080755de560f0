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
    assert set(body["data"][0]) == columns | {"has_capture"}  # captures off: all False
    assert {d["has_capture"] for d in body["data"]} == {False}
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


# ---- sorting, paging, the page's stats (issue 21) ----------------------------------------

async def test_sort_in_the_database_nulls_last_both_ways(client, mixed):
    async def order(query: str) -> list[str]:
        r = await client.get("/api/activity" + query)
        assert r.status_code == 200, r.content
        return [d["request_id"] for d in r.json()["data"]]

    rid = [str(x.request_id) for x in mixed]
    # waits: 10, 20, 30, 40, 2 (beta), NULL (rejected), 9999 (3 h old)
    assert await order("?sort=queue_wait_ms") == [rid[4], rid[0], rid[1], rid[2], rid[3],
                                                   rid[6], rid[5]]
    assert await order("?sort=-queue_wait_ms") == [rid[6], rid[3], rid[2], rid[1], rid[0],
                                                    rid[4], rid[5]]
    # the oldest first; with a filter
    assert await order("?sort=received_at&model=alpha&since=1h") == [
        rid[5], rid[3], rid[2], rid[1], rid[0]]
    # tokens/s: 50 (beta), 35, 25, 15, 5, then the two without
    assert (await order("?sort=-generation_tps"))[:5] == [rid[4], rid[3], rid[2], rid[1],
                                                         rid[0]]
    assert (await order("?sort=model"))[-1] == rid[4]  # alpha < beta


async def test_pages_do_not_overlap_and_say_whether_more_follow(client, mixed):
    rid = [str(x.request_id) for x in mixed]
    seen = []
    for offset, more in ((0, True), (3, True), (6, False)):
        r = await client.get(f"/api/activity?limit=3&offset={offset}")
        body = r.json()
        assert (body["offset"], body["limit"], body["has_more"]) == (offset, 3, more)
        assert body["sort"] == "-received_at"
        seen += [d["request_id"] for d in body["data"]]
    assert seen == rid  # the fixture's rows are newest first
    r = await client.get("/api/activity?offset=7")
    assert r.json()["data"] == [] and r.json()["has_more"] is False


@pytest.mark.parametrize(("query", "param"), [
    ("offset=-1", "offset"),
    ("offset=100001", "offset"),
    ("offset=x", "offset"),
    ("sort=error", "sort"),
    ("sort=--model", "sort"),
    ("sort=id;drop", "sort"),
    ("sort=score_parts", "sort"),
])
async def test_bad_sort_and_offset_are_400(client, query, param):
    r = await client.get(f"/api/activity?{query}")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "invalid_parameter"


@pytest.fixture
async def timed():
    """Five alpha rows in the last hour with hand-picked latencies, one cancelled, one
    upstream error; loads of alpha at two hours' marks."""
    rows = [
        row(1, queue_wait_ms=0.5, ttft_ms=100, duration_ms=1000, band="interactive"),
        row(2, queue_wait_ms=5, ttft_ms=200, duration_ms=2000),
        row(3, queue_wait_ms=50, ttft_ms=300, duration_ms=3000),
        row(4, queue_wait_ms=500, ttft_ms=400, duration_ms=4000,
            outcome=outcomes.CANCELLED_INFLIGHT),
        row(5, queue_wait_ms=200_000, outcome=outcomes.UPSTREAM_ERROR, status_code=500),
    ]
    await seed(rows)
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)

    def loads() -> None:
        from activity.models import ModelEvent
        ModelEvent.objects.bulk_create([
            ModelEvent(at=hour - timedelta(hours=2, minutes=-10), model="alpha", kind="load"),
            ModelEvent(at=hour - timedelta(hours=2, minutes=-50), model="alpha", kind="load"),
            ModelEvent(at=hour - timedelta(hours=2, minutes=-55), model="beta", kind="load"),
            ModelEvent(at=hour - timedelta(hours=2, minutes=-56), model="beta", kind="ready"),
            ModelEvent(at=hour + timedelta(minutes=1), model="alpha", kind="load"),
        ])

    await runtime.run_db(loads)
    return hour


async def test_stats_latency_percentiles_error_rate_histogram_and_swaps(client, timed):
    s = (await client.get("/api/activity/stats?since=1d")).json()
    assert s["total"] == 5
    assert s["error_rate"] == pytest.approx(1 / 5)  # the 500; a cancel is not an error
    # ttft 100..400: p50 = 250, p95 = 300 + 0.85 * 100, p99 = 300 + 0.97 * 100
    assert s["latency_ms"]["ttft_ms"] == pytest.approx({"p50": 250, "p95": 385, "p99": 397})
    assert s["latency_ms"]["duration_ms"]["p50"] == pytest.approx(2500)
    # waits 0.5, 5, 50, 500, 200000: p50 = 50, p95 = 500 + 0.8 * 199500
    assert s["latency_ms"]["queue_wait_ms"]["p50"] == pytest.approx(50)
    assert s["latency_ms"]["queue_wait_ms"]["p95"] == pytest.approx(160_100)
    hist = s["queue_wait_histogram"]
    assert hist["edges_ms"] == [1, 3, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000]
    #                               <1 <3 <10 <30 <100 <300 <1k <3k <10k <30k <100k >=100k
    assert hist["bands"]["interactive"] == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert hist["bands"]["normal"] == [0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 1]
    two = (timed - timedelta(hours=2)).isoformat().replace("+00:00", "Z")
    one = (timed + timedelta(hours=0)).isoformat().replace("+00:00", "Z")
    assert s["swaps_per_hour"] == [{"hour": two, "count": 3}, {"hour": one, "count": 1}]
    alpha = (await client.get("/api/activity/stats?since=1d&model=alpha")).json()
    assert alpha["swaps_per_hour"] == [{"hour": two, "count": 2}, {"hour": one, "count": 1}]
    empty = (await client.get("/api/activity/stats?model=nobody")).json()
    assert empty["error_rate"] is None
    assert empty["latency_ms"]["ttft_ms"] == {"p50": None, "p95": None, "p99": None}
    assert empty["queue_wait_histogram"]["bands"] == {} and empty["swaps_per_hour"] == []


async def test_latency_python_fallback_agrees_with_postgresql(timed):
    from gpuproxy.api import activity as views

    filters = {"received_at__gte": datetime.now(UTC) - timedelta(days=1)}
    sql = await runtime.run_db(lambda: views._latency_postgresql(filters))
    py = await runtime.run_db(lambda: views._latency_python(filters))
    assert py["ttft_ms"] == pytest.approx({"p50": 250, "p95": 385, "p99": 397})
    for column in views.LATENCIES:
        assert sql[column] == pytest.approx(py[column])


# ---- the dashboard's Activity page reads the same with a staff session ---------------------

@pytest.fixture
async def session_client(client):
    """The test client does not close connections after a request (Django disconnects that
    for tests): the session and user lookups leave one open on asgiref's thread, closed here
    so the test database can be dropped."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    yield client
    await sync_to_async(connections.close_all)()


async def log_in(client: AsyncClient, staff: bool) -> None:
    from django.contrib.auth.models import User

    def run() -> None:
        from django.contrib.auth.models import Permission

        user = User.objects.create_user("staff" if staff else "someone", password="pw",
                                        is_staff=staff)
        # the permission the admin's request log asks for (a staff member without it is
        # refused: tests/test_dashboard_pages.py)
        user.user_permissions.add(Permission.objects.get(codename="view_requestlog"))
        client.force_login(user)

    await runtime.run_db(run)


@pytest.mark.urls("gpuproxy.urls")
async def test_page_data_answers_staff_as_the_api_does(session_client, mixed):
    client = session_client
    await log_in(client, staff=True)
    query = "?sort=queue_wait_ms&limit=3&offset=1&model=alpha"
    page = await client.get("/dashboard/activity/rows" + query)
    api = await client.get("/api/activity" + query)
    assert page.status_code == 200 and page.json() == api.json()
    # waits of alpha: 10, 20, 30, 40, 9999, NULL; the second to the fourth
    assert [d["queue_wait_ms"] for d in page.json()["data"]] == [20, 30, 40]
    stats = await client.get("/dashboard/activity/stats?since=1d")
    assert stats.status_code == 200 and stats.json()["total"] == 7
    bad = await client.get("/dashboard/activity/rows?sort=nope")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sort"
    other = await client.get("/dashboard/activity/everything")
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    assert (await client.post("/dashboard/activity/rows")).status_code == 405


@pytest.mark.urls("gpuproxy.urls")
async def test_page_data_refuses_everyone_else(session_client, mixed):
    client = session_client
    for who in (None, False):
        if who is not None:
            await log_in(client, staff=who)
        for what in ("rows", "stats"):
            r = await client.get(f"/dashboard/activity/{what}")
            assert r.status_code == 403, who
            assert r.json()["error"]["code"] == "staff_required"
            assert "alpha" not in r.content.decode()
