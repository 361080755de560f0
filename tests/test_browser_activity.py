"""The Activity page (dashboard/pages/activity.py) in a real headless browser (Debian's
chromium through playwright), against a real `gpuproxy serve` on the test database with API
keys defined (the page reads with the staff session, never a key): paging, sorting, filters,
the column chooser, the cards and charts over the window, one request's timeline, the link
to the admin, and that only staff get in.

The setup is tests/test_browser.py's (its docstring says why database work goes through
`orm()`); what the page shows is awaited with `expect(...)`, never with sleeps. The rows are
written here with hand-picked numbers, so every expected value is worked out by hand.
"""

# ruff: noqa: RUF001, RUF002, RUF003  (the page writes the en dash of "rows 1–50")
from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from playwright.sync_api import Page, expect

from activity import outcomes
from activity.models import ModelEvent, RequestLog
from tests.conftest import free_port
from tests.helpers import one_model, until
from tests.test_browser import (  # noqa: F401
    MARKUP,
    browser,
    log_in,
    new_page,
    orm,
    screenshot,
    staff,
)

pytestmark = pytest.mark.django_db(transaction=True)

API_KEY = "sk-activity-page-7Hq2pW9x"
ALPHA = 60  # alpha rows: waits 10, 20 … 600 ms


def ms(n: float) -> timedelta:
    return timedelta(milliseconds=n)


def seed() -> dict[str, int]:
    """63 rows in the last hour and two loads; the ids of the rows the test looks for.

    - alpha i = 0..59: normal band, queue wait (i + 1) × 10 ms, decode 20 + i % 5 tok/s
      (twelve each of 20..24: median 22), input 100 + i, output 10;
    - beta: interactive, received → dispatched 300 ms (the last 200 of it a model load) →
      first byte 500 ms → finished 1500 ms, decode 80 tok/s;
    - one alpha request rejected with 429 (no wait: NULL); one with markup for a model name.
    """
    now = datetime.now(UTC).replace(microsecond=0)

    def row(at: datetime, **kw) -> RequestLog:
        base = {"request_id": uuid.uuid4(), "received_at": at, "finished_at": at + ms(50),
                "method": "POST", "path": "/v1/chat/completions", "model_requested": "alpha",
                "model": "alpha", "status_code": 200, "outcome": outcomes.OK, "priority": 0,
                "band": "normal", "scheduler": "serial", "client": "tester"}
        return RequestLog(**{**base, **kw})

    rows = [row(now - timedelta(seconds=30 + 45 * i), queue_wait_ms=(i + 1) * 10,
                ttft_ms=100, duration_ms=50, generation_tps=20 + i % 5, prompt_tps=500,
                input_tokens=100 + i, cached_tokens=0, output_tokens=10)
            for i in range(ALPHA)]
    t = now - timedelta(minutes=10, seconds=7)
    rows.append(row(t, model="beta", model_requested="beta", band="interactive", priority=100,
                    dispatched_at=t + ms(300), first_byte_at=t + ms(500),
                    finished_at=t + ms(1500), queue_wait_ms=300, swap_ms=200, ttft_ms=200,
                    duration_ms=1500, generation_tps=80, prompt_tps=900, input_tokens=40,
                    cached_tokens=32, output_tokens=80))
    rows.append(row(now - timedelta(minutes=20, seconds=3), outcome=outcomes.REJECTED_QUEUE,
                    status_code=429))
    rows.append(row(now - timedelta(minutes=30, seconds=11), model=MARKUP,
                    model_requested=MARKUP))
    RequestLog.objects.bulk_create(rows)
    ModelEvent.objects.bulk_create([
        ModelEvent(at=now - timedelta(minutes=10, seconds=8), model="beta", kind="load"),
        ModelEvent(at=now - timedelta(minutes=40), model="alpha", kind="load"),
    ])
    ids = dict(RequestLog.objects.filter(model__in=["beta"]).values_list("model", "id"))
    ids["rejected"] = RequestLog.objects.get(outcome=outcomes.REJECTED_QUEUE).id
    return ids


def rows(page: Page):
    return page.get_by_test_id("log-row")


def test_the_activity_table_pages_sorts_filters_and_opens_a_request(
        serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port(), f"apiKeys: [{API_KEY}]"))
    ids = orm(seed)
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/activity")
    expect(page.get_by_test_id("pages").get_by_role("link", name="Activity")
           ).to_have_attribute("aria-current", "page")

    # newest first, 50 a page; the last page has the 13 others
    expect(rows(page)).to_have_count(50)
    expect(page.get_by_test_id("range")).to_have_text("rows 1–50")
    expect(page.get_by_test_id("prev")).to_be_disabled()
    expect(rows(page).first.locator("[data-col=queue_wait_ms]")).to_have_text("10 ms")
    page.get_by_test_id("next").click()
    expect(page.get_by_test_id("range")).to_have_text("rows 51–63")
    expect(rows(page)).to_have_count(13)
    expect(page.get_by_test_id("next")).to_be_disabled()
    assert "offset=50" in page.url
    page.get_by_test_id("page-size").select_option("25")
    expect(rows(page)).to_have_count(25)
    expect(page.get_by_test_id("range")).to_have_text("rows 1–25")

    # sorting by the queue wait: the longest first, then the shortest; the rejected request,
    # which never waited, is last either way (below)
    page.get_by_test_id("sort-queue_wait_ms").click()
    expect(rows(page).first.locator("[data-col=queue_wait_ms]")).to_have_text("600 ms")
    expect(page.locator("th[data-col=queue_wait_ms]")).to_have_attribute(
        "aria-sort", "descending")
    page.get_by_test_id("sort-queue_wait_ms").click()
    expect(rows(page).first.locator("[data-col=queue_wait_ms]")).to_have_text("10 ms")
    expect(rows(page).nth(1).locator("[data-col=queue_wait_ms]")).to_have_text("20 ms")
    page.get_by_test_id("page-size").select_option("100")
    expect(rows(page)).to_have_count(63)
    # no wait: the rejected request and the markup one, by id
    expect(rows(page).nth(61)).to_have_attribute("data-id", str(ids["rejected"]))
    expect(rows(page).last).to_have_attribute("data-model", MARKUP)
    page.get_by_test_id("sort-generation_tps").click()  # decode tok/s, the fastest first
    expect(rows(page).first).to_have_attribute("data-model", "beta")
    expect(rows(page).first.locator("[data-col=generation_tps]")).to_have_text("80.0")

    # filters: an outcome, then a model typed in
    page.get_by_test_id("filter-outcome").select_option("rejected_queue")
    expect(rows(page)).to_have_count(1)
    expect(rows(page).first.locator("[data-col=status_code]")).to_have_text("429")
    page.get_by_test_id("filter-outcome").select_option("")
    expect(rows(page)).to_have_count(63)
    page.get_by_test_id("filter-model").fill("beta")
    page.get_by_test_id("filter-model").press("Enter")
    expect(rows(page)).to_have_count(1)
    beta = rows(page).first
    for col, text in (("band", "interactive"), ("input_tokens", "40"), ("cached_tokens", "32"),
                      ("output_tokens", "80"), ("prompt_tps", "900.0"), ("ttft_ms", "200 ms"),
                      ("duration_ms", "1.50 s")):
        expect(beta.locator(f"[data-col={col}]")).to_have_text(text)

    # the page's rows as a Markdown table, in the columns shown
    with page.expect_download() as download:
        page.get_by_test_id("export").click()
    table = download.value.path().read_text().splitlines()
    assert table[0] == ("| id | time | model | band | outcome | status | queue wait | ttft | "
                        "duration | input | cached | output | prefill tok/s | decode tok/s |")
    assert len(table) == 3 and table[2].startswith(f"| {ids['beta']} | ")
    assert table[2].endswith("| beta | interactive | ok | 200 | 300 ms | 200 ms | 1.50 s | 40 "
                             "| 32 | 80 | 900.0 | 80.0 |")

    # the cards follow the model filter: one request, no error
    expect(page.get_by_test_id("card-requests")).to_have_text("1")
    expect(page.get_by_test_id("card-error-rate")).to_have_text("0.0 %")

    # one request: its timeline in phases, its fields, the admin's page
    beta.click()
    detail = page.get_by_test_id("detail")
    expect(detail).to_be_visible()
    for phase, text in (("queue", "queue wait 100 ms"), ("swap", "swap (model load) 200 ms"),
                        ("ttft", "time to first token 200 ms"), ("streaming", "streaming 1.00 s")):
        expect(page.get_by_test_id(f"legend-{phase}")).to_have_text(text)
        expect(page.get_by_test_id(f"phase-{phase}")).to_have_count(1)
    expect(detail.locator("[data-field=priority] dd")).to_have_text("100")
    expect(detail.locator("[data-field=swap_ms] dd")).to_have_text("200")
    admin = f"/admin/activity/requestlog/{ids['beta']}/change/"
    expect(page.get_by_test_id("detail-admin")).to_have_attribute("href", admin)
    expect(beta.get_by_test_id("admin-link")).to_have_attribute("href", admin)
    screenshot(page, "activity-detail")

    # the column chooser hides a column, and the page remembers it after a reload
    page.get_by_test_id("filter-model").fill("")
    page.get_by_test_id("filter-model").press("Enter")
    expect(rows(page)).to_have_count(63)
    expect(page.locator("th[data-col=ttft_ms]")).to_have_count(1)
    page.get_by_test_id("columns").locator("summary").click()
    page.get_by_test_id("column-ttft_ms").uncheck()
    expect(page.locator("th[data-col=ttft_ms]")).to_have_count(0)
    expect(rows(page).first.locator("[data-col=ttft_ms]")).to_have_count(0)
    page.get_by_test_id("column-path").check()
    page.reload()
    expect(rows(page)).to_have_count(63)  # the address kept the page size and the sort
    expect(rows(page).first).to_have_attribute("data-model", "beta")
    expect(page.locator("th[data-col=ttft_ms]")).to_have_count(0)
    expect(rows(page).first.locator("[data-col=path]")).to_have_text("/v1/chat/completions")

    # the cards and charts over the last hour: 63 requests, one error (the 429): 1/63 = 1.6 %;
    # the median of the 61 waits (10..600 and beta's 300) is 300 ms
    expect(page.get_by_test_id("card-requests")).to_have_text("63")
    expect(page.get_by_test_id("card-error-rate")).to_have_text("1.6 %")
    expect(page.get_by_test_id("card-queue_wait_ms").get_by_test_id("p50")).to_have_text(
        "300 ms")
    expect(page.get_by_test_id("card-duration_ms").get_by_test_id("p50")).to_have_text("50 ms")
    # beta's 300 ms wait is in the 300 ms–1 s bucket (the 7th) of the interactive band
    expect(page.locator("[data-testid=hist-bar][data-band=interactive]")).to_have_count(1)
    expect(page.locator("[data-testid=hist-bar][data-band=interactive]")).to_have_attribute(
        "data-bucket", "6")
    # normal: 10, 20 (10–30 ms), 30..90 (30–100 ms), 100..290 (100–300 ms), 300..600
    expect(page.locator("[data-testid=hist-bar][data-band=normal][data-bucket='3']")
           ).to_have_attribute("data-count", "2")
    expect(page.locator("[data-testid=hist-bar][data-band=normal][data-bucket='6']")
           ).to_have_attribute("data-count", "31")
    expect(page.get_by_test_id("swaps-total")).to_have_text("2 loads in the window")
    expect(page.locator("[data-testid=tps-bar]")).to_have_count(2)  # the markup one has none
    expect(page.locator("[data-testid=tps-bar]").first).to_have_attribute("data-model", "beta")
    expect(page.get_by_test_id("chart-tps")).to_contain_text("22.0")  # alpha's median
    # the markup model is text, never HTML
    assert page.evaluate("window.injected") is None
    expect(page.get_by_test_id("log-body")).to_contain_text(MARKUP)
    page.get_by_test_id("page-size").select_option("25")
    expect(rows(page)).to_have_count(25)
    rows(page).first.click()
    expect(page.get_by_test_id("detail")).to_be_visible()
    screenshot(page, "activity", docs=True, full_page=True)
    page.emulate_media(color_scheme="dark")  # the theme follows the system until switched
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    screenshot(page, "activity-dark", full_page=True)

    # the admin link opens the request's own page
    rows(page).first.get_by_test_id("admin-link").click()
    expect(page).to_have_url(proxy.base + f"/admin/activity/requestlog/{ids['beta']}/change/")

    # a bad value in the address is refused with the API's message, not a blank table
    page.goto(proxy.base + "/dashboard/activity/rows?sort=error")
    assert "sort='error' is not one of" in page.content()
    page.goto(proxy.base + "/dashboard/activity?window=7d")
    expect(page.get_by_test_id("window")).to_have_value("7d")
    expect(rows(page)).to_have_count(50)

    # live: a new request shows up on the first page by itself, and in the cards
    expect(page.get_by_test_id("live")).to_be_checked()
    expect(page.get_by_test_id("card-requests")).to_have_text("63")
    orm(lambda: RequestLog.objects.create(
        request_id=uuid.uuid4(), received_at=datetime.now(UTC), model="gamma",
        outcome=outcomes.OK, band="batch", queue_wait_ms=1))
    expect(rows(page).first).to_have_attribute("data-model", "gamma")
    expect(page.get_by_test_id("card-requests")).to_have_text("64")


def test_the_activity_page_and_its_data_are_for_staff_only(serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port(), f"apiKeys: [{API_KEY}]"))
    page = new_page(browser)
    page.goto(proxy.base + "/dashboard/activity")
    expect(page).to_have_url(re.compile(
        re.escape(f"{proxy.base}/admin/login/?next=/dashboard/activity") + "$"))
    for path in ("/dashboard/activity/rows", "/dashboard/activity/stats"):
        assert page.goto(proxy.base + path).status == 403
    # logged in, the API's own path still wants an admin key: the page does not use it
    log_in(page, proxy, "/dashboard/activity")
    status = page.evaluate("fetch('/api/activity').then(r => r.status)")
    assert status == 401
    expect(page.get_by_test_id("log-empty")).to_be_visible()  # nothing yet, and no error
    expect(page.get_by_test_id("status")).to_have_text("")


def test_a_row_with_a_capture_has_a_button_that_opens_it_on_the_captures_page(
        serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port(), f"captureBuffer: 5\n    apiKeys: [{API_KEY}]"))
    key = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert proxy.http.post("/v1/chat/completions", json={**chat, "model": "solo"},
                           headers={**key, "User-Agent": "kept/1"}).status_code == 200
    # refused before anything was captured: no capture, no button
    assert proxy.http.post("/v1/chat/completions", json={**chat, "model": "nope"},
                           headers={**key, "User-Agent": "nope/1"}).status_code == 404

    def both() -> dict[str, int] | None:
        found = orm(lambda: dict(RequestLog.objects.values_list("user_agent", "id")))
        return found if len(found) == 2 else None
    row_ids = until("both rows written", both)
    kept, nope = row_ids["kept/1"], row_ids["nope/1"]
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/activity")
    expect(rows(page)).to_have_count(2)
    kept_row = page.locator(f"[data-testid=log-row][data-id='{kept}']")
    nope_row = page.locator(f"[data-testid=log-row][data-id='{nope}']")
    expect(kept_row.get_by_test_id("capture-link")).to_have_attribute(
        "href", f"/dashboard/captures#{kept}")
    expect(nope_row.get_by_test_id("capture-link")).to_have_count(0)

    # the opened request links to its capture too, when it has one
    nope_row.click()
    expect(page.get_by_test_id("detail")).to_be_visible()
    expect(page.get_by_test_id("detail-capture")).to_be_hidden()
    kept_row.click()
    expect(page.get_by_test_id("detail-capture")).to_have_attribute(
        "href", f"/dashboard/captures#{kept}")

    kept_row.get_by_test_id("capture-link").click()
    expect(page).to_have_url(f"{proxy.base}/dashboard/captures#{kept}")
    detail = page.get_by_test_id("capture-detail")
    expect(detail).to_have_attribute("data-id", str(kept))
    expect(detail.get_by_test_id("req-path")).to_have_text("/v1/chat/completions")
    expect(detail.get_by_test_id("request").get_by_test_id("body-text")).to_contain_text(
        '"model": "solo"')
    expect(page.locator(f"[data-testid=capture-row][data-id='{kept}']")).to_have_class("open")
    # a row without one, named in the address, says why rather than showing nothing
    page.goto(f"{proxy.base}/dashboard/captures#{nope}")
    expect(detail.locator(".notice")).to_contain_text(f"capture {nope} not found")
