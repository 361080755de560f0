"""The admin as an operator reads it (issue 21): gpuproxy's branding and icon, the request log
newest arrival first with seconds and human durations, and the defaults said in words.

Every expected value is worked out by hand in the test (times, orders, texts)."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from activity.admin import RequestLogPaginator
from activity.admin_time import at_millis, at_seconds, exact_ms, human_ms
from activity.models import ModelEvent, RequestLog
from scheduling.models import ModelDefinition, ProxySettings

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:activity_requestlog_changelist"
NOON = dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC)


def make(seconds: float, **kw) -> RequestLog:
    """A row received `seconds` after noon; rows are created (and get their ids) in call
    order, as the writer adds them when requests finish."""
    fields = {"request_id": uuid.uuid4(), "outcome": "ok", "model": "m",
              "received_at": NOON + dt.timedelta(seconds=seconds), **kw}
    return RequestLog.objects.create(**fields)


def listed(response) -> list[int]:
    return [r.id for r in response.context["cl"].result_list]


# ---- branding and the icon -----------------------------------------------------------------

def test_admin_pages_say_gpuproxy_and_carry_the_icon(admin_client, client):
    body = admin_client.get(reverse("admin:index")).content.decode()
    assert "<title>Site administration | gpuproxy administration</title>" in body
    assert re.search(r'id="site-name"[^>]*><a href="/admin/">gpuproxy administration</a>',
                     body)
    assert "Django administration" not in body and "Django site admin" not in body
    assert '<link rel="icon" href="/static/dashboard/favicon.svg" type="image/svg+xml">' in body
    assert '<a href="/">Dashboard</a>' in body
    # the login page, before anyone is logged in, too
    login = client.get(reverse("admin:login")).content.decode()
    assert "gpuproxy administration" in login and "Django administration" not in login
    assert "/static/dashboard/favicon.svg" in login


def test_favicon_ico_leads_to_the_icon(client):
    r = client.get("/favicon.ico")
    assert r.status_code == 301
    assert r["Location"] == "/static/dashboard/favicon.svg"
    # anything else: the API's envelope (a JSON client never gets the CSRF page's HTML)
    r = client.post("/favicon.ico")
    assert (r.status_code, r["Content-Type"], r["Allow"]) == (405, "application/json", "GET, HEAD")
    assert r.json()["error"]["code"] == "method_not_allowed"


# ---- the request log: order, seconds, durations ------------------------------------------

def test_human_durations():
    assert human_ms(None) is None
    assert human_ms(3.4) == "3.4 ms"
    assert human_ms(840) == "840 ms"
    assert human_ms(999.4) == "999 ms"
    assert human_ms(4_200) == "4.2 s"
    assert human_ms(42_740) == "42.7 s"
    assert human_ms(59_970) == "1 min 0 s"  # not "60.0 s"
    assert human_ms(162_270.823) == "2 min 42 s"
    assert human_ms(3_900_000) == "1 h 5 min"
    assert exact_ms(162_270.823) == "2 min 42 s (162,270.823 ms)"
    assert exact_ms(840.0) == "840 ms (840 ms)"
    assert exact_ms(None) is None


def test_times_keep_their_seconds():
    t = dt.datetime(2026, 11, 1, 12, 0, 7, 250_400, tzinfo=dt.UTC)
    assert at_seconds(t) == "2026-11-01 12:00:07"  # TIME_ZONE is UTC
    assert at_millis(t) == "2026-11-01 12:00:07.250"
    assert at_seconds(None) is None


def test_the_log_lists_the_newest_arrival_first_not_the_last_written():
    # written in this order (ids 1..6), received at these seconds after noon: the third and
    # the first were long requests, written after later arrivals
    seconds = [0, 10, 5, 30, 20, 25]
    rows = [make(s) for s in seconds]
    by_arrival = [rows[i].id for i in (3, 5, 4, 1, 2, 0)]  # 30, 25, 20, 10, 5, 0
    qs = RequestLog.objects.order_by("-received_at", "-id")
    paginator = RequestLogPaginator(qs, 2)
    pages = [[r.id for r in paginator.page(n).object_list] for n in (1, 2, 3)]
    assert pages == [by_arrival[0:2], by_arrival[2:4], by_arrival[4:6]]


@pytest.mark.postgres
def test_a_page_is_bounded_by_time_through_the_primary_key(admin_client):
    """The page's query has a lower bound on received_at (which the BRIN index narrows to the
    last blocks) found through the primary key: no sort of the whole table."""
    # more than a page (100): row k received at k s; the last one written arrived first
    rows = [make(k) for k in range(150)] + [make(-1)]
    with CaptureQueriesContext(connection) as queries:
        r = admin_client.get(reverse(CHANGELIST))
    assert listed(r) == [rows[k].id for k in range(149, 49, -1)]  # 149 s down to 50 s
    page = [q["sql"] for q in queries.captured_queries
            if 'ORDER BY "activity_requestlog"."received_at" DESC' in q["sql"]]
    assert page and all('"activity_requestlog"."received_at" >= ' in sql for sql in page), page
    bound = [q["sql"] for q in queries.captured_queries
             if "MIN(" in q["sql"].upper() and 'ORDER BY "activity_requestlog"."id" DESC'
             in q["sql"]]
    assert bound, [q["sql"] for q in queries.captured_queries]
    r = admin_client.get(reverse(CHANGELIST), {"p": "2"})  # resets the query log: last
    assert listed(r) == [rows[k].id for k in range(49, -1, -1)] + [rows[150].id]


def test_the_list_shows_seconds_and_human_durations(admin_client):
    make(7.25, queue_wait_ms=840.0, swap_ms=4_200.0, duration_ms=162_270.823,
         generation_tps=31.4159)
    body = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert "2026-11-01 12:00:07<" in body.replace("</a>", "<")
    for text in (">840 ms<", ">4.2 s<", ">2 min 42 s<", ">31.4<"):
        assert text in body, text
    assert "162270" not in body and "162.270" not in body and "162,270" not in body


def test_a_row_page_shows_milliseconds_and_the_exact_durations(admin_client):
    row = make(7.25, dispatched_at=NOON + dt.timedelta(seconds=9.5), duration_ms=162_270.823,
               ttft_ms=840.0)
    body = admin_client.get(reverse("admin:activity_requestlog_change", args=[row.id])
                            ).content.decode()

    def shown(label: str, value: str) -> bool:
        return re.search(rf">{re.escape(label)}:</label>\s*<div class=\"readonly\">"
                         rf"{re.escape(value)}</div>", body) is not None

    assert shown("Received at", "2026-11-01 12:00:07.250")
    assert shown("Dispatched at", "2026-11-01 12:00:09.500")
    assert shown("Duration", "2 min 42 s (162,270.823 ms)")
    assert shown("Time to first token", "840 ms (840 ms)")


def test_model_events_show_seconds_and_human_durations_newest_first(admin_client):
    later = ModelEvent.objects.create(at=NOON + dt.timedelta(seconds=65), model="m",
                                      kind="ready", duration_ms=95_000.0)
    earlier = ModelEvent.objects.create(at=NOON + dt.timedelta(seconds=3), model="m",
                                        kind="load")  # written last, happened first
    r = admin_client.get(reverse("admin:activity_modelevent_changelist"))
    assert listed(r) == [later.id, earlier.id]
    body = r.content.decode().replace("</a>", "<")
    assert "2026-11-01 12:01:05<" in body and "2026-11-01 12:00:03<" in body
    assert ">1 min 35 s<" in body
    detail = admin_client.get(reverse("admin:activity_modelevent_change", args=[later.id])
                              ).content.decode()
    assert "2026-11-01 12:01:05.000" in detail
    assert "1 min 35 s (95,000 ms)" in detail


# ---- the defaults in words ------------------------------------------------------------------

def model(model_id: str, **kw) -> ModelDefinition:
    return ModelDefinition.objects.create(model_id=model_id, cmd="x",
                                          proxy="http://127.0.0.1:5801", **kw)


def test_the_model_list_says_what_0_and_minus_1_mean(admin_client):
    model("a-default", concurrency_limit=0, ttl=-1, name="Alpha 7B")
    model("b-limited", concurrency_limit=3, ttl=0)
    model("c-ttl", ttl=300)
    url = reverse("admin:scheduling_modeldefinition_changelist")
    body = admin_client.get(url).content.decode()
    assert "0 (default: 10 under fifo, no limit under serial)" in body
    assert ">3<" in body
    assert "-1 (global: never)" in body  # globalTTL 0
    assert "0 (never)" in body and ">5 min<" in body
    assert 'title="http://127.0.0.1:5801">127.0.0.1:5801<' in body
    assert 'a-default<br><span class="quiet">Alpha 7B</span></a>' in body
    s = ProxySettings.load()
    s.global_ttl = 600
    s.save()
    assert "-1 (global: 10 min)" in admin_client.get(url).content.decode()


def test_the_settings_page_says_what_its_zeros_and_blanks_do(admin_client):
    s = ProxySettings.load()
    s.max_waiting, s.max_waiting_batch, s.queue_timeout, s.global_ttl = 0, 500, 90, 0
    s.scheduler = "fifo"
    s.save()
    body = admin_client.get(reverse("admin:scheduling_proxysettings_change", args=[s.pk])
                            ).content.decode()
    panel = re.search(r'<ul class="defaults-in-force"[^>]*>(.*?)</ul>', body, re.S)
    assert panel is not None
    items = re.findall(r"<li>(.*?)</li>", panel.group(1))
    assert "max waiting: 0 = no cap on waiting requests" in items
    assert "max waiting, batch: 500 at most" in items
    assert "max waiting, interactive: 0 = no band cap" in items
    assert "queue timeout: 503 queue_timeout after 90 s" in items
    assert "global TTL: 0 = models whose ttl is -1 never unload for idleness" in items
    assert ("trusted priority: all empty = requests without a key&#x27;s range are not "
            "clamped") in items
    assert ("models&#x27; concurrencyLimit 0: default: 10 under fifo, no limit under serial "
            "(now fifo: 10 per model)") in items


def test_anonymous_and_non_staff_get_the_login(client, django_user_model):
    url = reverse("admin:scheduling_modeldefinition_changelist")
    r = client.get(url)
    assert r.status_code == 302 and r["Location"].startswith("/admin/login/")
    user = django_user_model.objects.create_user("plain", password="pw")
    client.force_login(user)
    r = client.get(url)
    assert r.status_code == 302 and r["Location"].startswith("/admin/login/")
