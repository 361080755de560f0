"""The read-only RequestLog admin on real PostgreSQL: fast at 100k rows, filters, the score
breakdown, no add/change/delete, and the CSV export action."""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from activity.admin import COUNT_CAP, EstimatedCountPaginator, distinct_indexed
from activity.models import RequestLog

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:activity_requestlog_changelist"
N = 100_000

# g = 1..N, one second apart; band cycles by g % 3, outcome is rejected_queue when g % 5 = 0.
SEED = f"""
INSERT INTO activity_requestlog (request_id, received_at, method, path, model_requested, model,
    status_code, outcome, priority, band, stream, scheduler, client, user_agent, error,
    queue_wait_ms, completion_tokens)
SELECT gen_random_uuid(),
       timestamptz '2026-11-01 00:00:00+00' + g * interval '1 second',
       'POST', '/v1/chat/completions', 'm',
       (ARRAY['llama-8b', 'qwen-7b'])[1 + g % 2],
       CASE WHEN g % 5 = 0 THEN 429 ELSE 200 END,
       CASE WHEN g % 5 = 0 THEN 'rejected_queue' ELSE 'ok' END,
       (ARRAY[100, 0, -10])[1 + g % 3],
       (ARRAY['interactive', 'normal', 'batch'])[1 + g % 3],
       g % 2 = 0, 'priority', 'client-' || (g % 7), 't/1', '',
       (g % 1000)::float, g % 50
FROM generate_series(1, {N}) AS g
"""


@pytest.fixture
def big_table():
    with connection.cursor() as cursor:
        cursor.execute(SEED)
    return N


def results(response) -> list[RequestLog]:
    return list(response.context["cl"].result_list)


@pytest.mark.postgres
def test_changelist_renders_fast_with_100k_rows(admin_client, big_table):
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    rows = results(response)
    assert len(rows) == 100
    # newest first by id; g = N is the last inserted row
    assert rows[0].received_at == dt.datetime(2026, 11, 2, 3, 46, 40, tzinfo=dt.UTC)
    assert [r.id for r in rows] == sorted((r.id for r in rows), reverse=True)
    # no exact COUNT(*) over the table: every count is capped by a LIMIT subquery
    counts = [q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT" in sql.upper() for sql in counts), counts
    distinct = [q["sql"] for q in queries.captured_queries if "DISTINCT" in q["sql"].upper()]
    # only date_hierarchy's dates() query; the filters list their choices without DISTINCT
    assert len(distinct) == 1 and "DATE_TRUNC" in distinct[0], distinct
    body = response.content.decode()
    for choice in ("llama-8b", "qwen-7b", "interactive", "normal", "batch", "rejected queue"):
        assert choice in body
    assert "Export selected as CSV" in body


@pytest.mark.postgres
def test_filters_by_band_and_outcome(admin_client, big_table):
    url = reverse(CHANGELIST)
    r = admin_client.get(url, {"band": "interactive"})
    assert r.status_code == 200
    assert {row.band for row in results(r)} == {"interactive"}
    assert r.context["cl"].result_count == COUNT_CAP  # 33,333 match: the count is capped

    # interactive (g % 3 = 0) and rejected (g % 5 = 0): g % 15 = 0 -> 100000 // 15 = 6666 rows
    r = admin_client.get(url, {"band": "interactive", "outcome__exact": "rejected_queue"})
    assert r.status_code == 200
    rows = results(r)
    assert {(row.band, row.outcome, row.status_code) for row in rows} == {
        ("interactive", "rejected_queue", 429)}
    assert r.context["cl"].result_count == 6666

    r = admin_client.get(url, {"model": "qwen-7b", "stream__exact": "0", "status": "2xx"})
    assert r.status_code == 200
    # qwen-7b is odd g, stream false is odd g, 200 is g % 5 != 0: 50000 - 10000 = 40000 (capped)
    assert {(row.model, row.stream, row.status_code) for row in results(r)} == {
        ("qwen-7b", False, 200)}
    r = admin_client.get(url, {"status": "429", "q": "client-3"})
    assert r.status_code == 200
    # g % 5 = 0 and g % 7 = 3: g = 10 + 35k for k = 0..2856 -> 2857 rows
    assert r.context["cl"].result_count == 2857
    assert {(row.status_code, row.client) for row in results(r)} == {(429, "client-3")}


@pytest.mark.postgres
def test_unfiltered_count_uses_the_planner_estimate(big_table):
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE activity_requestlog")
    paginator = EstimatedCountPaginator(RequestLog.objects.order_by("-id"), 100)
    assert 0.9 * N <= paginator.count <= 1.1 * N
    filtered = EstimatedCountPaginator(RequestLog.objects.filter(band="batch"), 100)
    assert filtered.count == COUNT_CAP
    assert distinct_indexed("band", "default") == ["batch", "interactive", "normal"]


def make(**kw) -> RequestLog:
    fields = {"request_id": uuid.uuid4(), "outcome": "ok",
              "received_at": dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC), **kw}
    return RequestLog.objects.create(**fields)


def test_search_by_request_id_model_and_client(admin_client):
    a = make(model="qwen-7b", client="alice")
    b = make(model="llama-8b", client="bob")
    url = reverse(CHANGELIST)
    assert [r.id for r in results(admin_client.get(url, {"q": str(a.request_id)}))] == [a.id]
    assert [r.id for r in results(admin_client.get(url, {"q": "llama-8b"}))] == [b.id]
    assert [r.id for r in results(admin_client.get(url, {"q": "alice"}))] == [a.id]
    assert results(admin_client.get(url, {"q": "nobody"})) == []


def test_detail_page_is_read_only_with_the_score_breakdown(admin_client):
    log = make(model="qwen-7b", band="interactive", priority=100, score=101.5,
               score_parts={"priority": 100, "affinity": 1.0, "aging": 0.5, "seq": 7},
               error="boom")
    r = admin_client.get(reverse("admin:activity_requestlog_change", args=[log.id]))
    assert r.status_code == 200
    body = r.content.decode()
    assert "score breakdown" in body.lower()
    assert "priority 100 + affinity 1 + aging 0.5 = score 101.5 (arrival #7)" in body
    assert str(log.request_id) in body and "boom" in body
    assert 'name="_save"' not in body
    assert "deletelink" not in body
    # posting a change is refused
    r = admin_client.post(reverse("admin:activity_requestlog_change", args=[log.id]),
                          {"model": "other"})
    assert r.status_code == 403
    log.refresh_from_db()
    assert log.model == "qwen-7b"


def test_add_and_delete_are_forbidden(admin_client):
    log = make()
    assert admin_client.get(reverse("admin:activity_requestlog_add")).status_code == 403
    delete = reverse("admin:activity_requestlog_delete", args=[log.id])
    assert admin_client.get(delete).status_code == 403
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    body = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert reverse("admin:activity_requestlog_add") not in body
    assert "delete_selected" not in body
    r = admin_client.post(reverse(CHANGELIST),
                          {"action": "delete_selected", "_selected_action": [log.id]})
    assert RequestLog.objects.filter(id=log.id).exists()
    assert r.status_code in (200, 302)


def test_export_selected_as_csv(admin_client):
    t = dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC)
    first = make(received_at=t, model="qwen-7b", client="alice", status_code=200,
                 score_parts={"priority": 5, "affinity": 0, "aging": 1.5, "seq": 1})
    second = make(received_at=t + dt.timedelta(seconds=3), model="llama-8b",
                  outcome="rejected_capacity", status_code=429, stream=True)
    make(model="not-selected")
    r = admin_client.post(reverse(CHANGELIST), {
        "action": "export_csv", "_selected_action": [second.id, first.id]})
    assert r.status_code == 200
    assert r["Content-Type"].startswith("text/csv")
    assert "attachment" in r["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(r.streaming_content).decode())))
    assert [row["id"] for row in rows] == [str(first.id), str(second.id)]
    assert rows[0]["request_id"] == str(first.request_id)
    assert rows[0]["received_at"] == "2026-11-01T12:00:00+00:00"
    assert rows[0]["score_parts"] == '{"affinity":0,"aging":1.5,"priority":5,"seq":1}'
    assert (rows[0]["model"], rows[0]["client"], rows[0]["status_code"]) == (
        "qwen-7b", "alice", "200")
    assert (rows[1]["outcome"], rows[1]["status_code"], rows[1]["stream"]) == (
        "rejected_capacity", "429", "true")


def test_every_column_is_on_the_detail_page():
    # a column added to the model and forgotten in the fieldsets would be invisible there
    from django.contrib.admin import site

    # a time or duration is shown by its `<column>_shown` field (seconds, human durations)
    shown = {f.removesuffix("_shown")
             for _, opts in site._registry[RequestLog].fieldsets for f in opts["fields"]}
    assert {f.name for f in RequestLog._meta.concrete_fields} <= shown


def test_detail_page_shows_the_token_client_and_endpoint_columns(admin_client):
    log = make(model="qwen-7b", priority=50, priority_asked=900, input_tokens=1234,
               cached_tokens=567, output_tokens=89, output_tokens_counted=True,
               draft_tokens=41, draft_accepted_tokens=37, client_ip="203.0.113.77",
               end_user="user-4711", endpoint="embeddings", upstream_retries=1)
    r = admin_client.get(reverse("admin:activity_requestlog_change", args=[log.id]))
    assert r.status_code == 200
    body = r.content.decode()

    def shown(label: str, value: str) -> bool:
        # a read-only field renders as its label, then its value in <div class="readonly">
        return re.search(rf">{re.escape(label)}:</label>\s*<div class=\"readonly\">"
                         rf"{re.escape(value)}</div>", body) is not None

    for label, value in [("Input tokens", "1234"), ("Cached tokens", "567"),
                         ("Output tokens", "89"), ("Draft tokens", "41"),
                         ("Draft accepted tokens", "37"), ("Priority asked", "900"),
                         ("Priority", "50"), ("Client ip", "203.0.113.77"),
                         ("End user", "user-4711"), ("Endpoint", "embeddings"),
                         ("Upstream retries", "1")]:
        assert shown(label, value), (label, value)
    # a boolean renders as Django's icon, its alt text the value
    assert re.search(r">Output tokens counted:</label>\s*<div class=\"readonly\">"
                     r"<img [^>]*alt=\"True\"", body)
    # priority_asked sits next to priority
    assert body.index(">Priority asked:<") < body.index(">Priority:<")


def test_changelist_shows_the_clamp_and_filters_by_endpoint(admin_client):
    chat = make(endpoint="chat", priority=50, priority_asked=900, input_tokens=321,
                output_tokens=12)
    embeddings = make(endpoint="embeddings")
    old = make(endpoint="")  # a row from before migration 0006
    url = reverse(CHANGELIST)
    r = admin_client.get(url)
    body = r.content.decode()
    assert "50 (asked 900)" in body
    assert 'href="?endpoint=embeddings"' in body and 'href="?endpoint=none"' in body
    assert [x.id for x in results(admin_client.get(url, {"endpoint": "embeddings"}))] == [
        embeddings.id]
    assert [x.id for x in results(admin_client.get(url, {"endpoint": "chat"}))] == [chat.id]
    assert [x.id for x in results(admin_client.get(url, {"endpoint": "none"}))] == [old.id]
    # a value that is not an endpoint filters nothing out rather than failing
    assert {x.id for x in results(admin_client.get(url, {"endpoint": "bogus"}))} == {
        chat.id, embeddings.id, old.id}


def test_search_by_end_user_and_client_address(admin_client):
    a = make(end_user="user-4711", client_ip="203.0.113.77", client="alice")
    b = make(end_user="other", client_ip="2001:db8::5", client="bob")
    url = reverse(CHANGELIST)
    assert [r.id for r in results(admin_client.get(url, {"q": "user-4711"}))] == [a.id]
    assert [r.id for r in results(admin_client.get(url, {"q": "203.0.113.77"}))] == [a.id]
    assert [r.id for r in results(admin_client.get(url, {"q": "2001:db8::5"}))] == [b.id]
    # a term that is no address is not compared with the inet column (which would refuse it)
    assert [r.id for r in results(admin_client.get(url, {"q": "bob"}))] == [b.id]
