"""The activity API's sorting, paging and window stats on whichever database the suite runs
(SQLite without DATABASE_URL, where the percentiles are computed in Python; PostgreSQL with
it, in SQL): the same hand-worked answers either way. tests/test_activity_api.py covers the
HTTP side on PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.http import QueryDict

from activity import outcomes
from activity.models import ModelEvent, RequestLog
from gpuproxy.api.activity import BadParameter, list_query, stats_query

pytestmark = pytest.mark.django_db


def seed() -> tuple[list[int], datetime]:
    """Waits 0.5, 5, 50, 500 ms and one NULL (a 429), ttft 100..400, one model load."""
    now = datetime.now(UTC)
    rows = []
    for i, (wait, ttft, outcome) in enumerate([
            (0.5, 100, outcomes.OK), (5, 200, outcomes.OK), (50, 300, outcomes.OK),
            (500, 400, outcomes.CANCELLED_INFLIGHT), (None, None, outcomes.REJECTED_QUEUE)]):
        rows.append(RequestLog(
            request_id=uuid.uuid4(), received_at=now - timedelta(minutes=i + 1),
            model="alpha", outcome=outcome, band="normal", queue_wait_ms=wait, ttft_ms=ttft,
            generation_tps=10.0 * (i + 1) if ttft else None))
    RequestLog.objects.bulk_create(rows)
    ModelEvent.objects.create(at=now - timedelta(minutes=3), model="alpha", kind="load")
    ids = list(RequestLog.objects.order_by("-received_at").values_list("id", flat=True))
    return ids, now


def q(text: str) -> QueryDict:
    return QueryDict(text)


def test_sort_nulls_last_and_pages():
    ids, _ = seed()  # ids newest first: waits 0.5, 5, 50, 500, NULL
    page = list_query(q("sort=-queue_wait_ms&limit=2"))()
    assert [r["id"] for r in page["data"]] == [ids[3], ids[2]] and page["has_more"] is True
    page = list_query(q("sort=-queue_wait_ms&limit=2&offset=4"))()
    assert [r["id"] for r in page["data"]] == [ids[4]] and page["has_more"] is False
    page = list_query(q("sort=queue_wait_ms"))()
    assert [r["id"] for r in page["data"]] == ids  # ascending, the NULL still last
    with pytest.raises(BadParameter) as e:
        list_query(q("sort=client_ip"))
    assert e.value.param == "sort"


def test_window_stats():
    seed()
    s = stats_query(q("since=1h"))()
    assert s["total"] == 5
    assert s["error_rate"] == pytest.approx(1 / 5)  # the 429; the cancel is not an error
    # ttft 100..400: p50 250, p95 300 + 0.85 * 100, p99 300 + 0.97 * 100
    assert s["latency_ms"]["ttft_ms"] == pytest.approx({"p50": 250, "p95": 385, "p99": 397})
    # waits 0.5, 5, 50, 500: p50 5 + 0.5 * 45
    assert s["latency_ms"]["queue_wait_ms"]["p50"] == pytest.approx(27.5)
    assert s["queue_wait_histogram"]["bands"] == {"normal": [1, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0]}
    assert [h["count"] for h in s["swaps_per_hour"]] == [1]
    assert s["models"]["alpha"]["generation_tps"]["p50"] == pytest.approx(25.0)  # 10..40
