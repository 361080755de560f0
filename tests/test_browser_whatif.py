"""The settings page's what-if panel (issue 22) in a real headless browser (Debian's chromium
through playwright), against a real `gpuproxy serve` on the test database: the activity log
holds a synthetic trace as the proxy would have served it under the defaults, the panel shows
today's replay matching it, and follows the fields as they are typed (debounced).

The setup is tests/test_browser.py's (its docstring says why users are created before the
browser opens and database reads go through `orm()`); chromium missing fails, never skips.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid

import pytest
from playwright.sync_api import Page, Request, expect

from activity import events, outcomes
from activity.models import ModelEvent, RequestLog
from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.priority import band
from scheduling.core.swapper import GroupSwapper
from scheduling.replay import Row, replay
from tests.conftest import FAKE, free_port
from tests.test_browser import browser, log_in, new_page, orm, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

MODELS = ("A", "B", "C")
REQUESTS = 300
LOAD_S = 8.0


def config(start: int) -> str:
    """Three models and no group: one at a time, as the trace below was served."""
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
""" + "".join(f"      {m}:\n        cmd: {FAKE}\n" for m in MODELS)


def record_trace() -> int:
    """The log of REQUESTS requests over the last two hours, served one model at a time under
    the defaults (serial, divisor 60, bonus 10) with loads of LOAD_S: the rows the proxy writes
    (arrival, grant, done, queue wait) and a load and its ready per swap. Returns the swaps."""
    rnd = random.Random(22)
    trace = sorted((Row(rnd.uniform(0, 3000), rnd.choice(MODELS), rnd.choice((100, 0, -100)),
                        round(rnd.uniform(1, 8), 3)) for _ in range(REQUESTS)),
                   key=lambda r: r.arrival)
    served = replay(trace, SchedulerConfig(
        models={m: ModelConfig() for m in MODELS}, swapper=GroupSwapper([], list(MODELS)),
        scheduler="serial", aging_divisor=60.0, swap_affinity_bonus=10), LOAD_S)
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)

    def at(seconds: float) -> dt.datetime:
        return t0 + dt.timedelta(seconds=seconds)

    RequestLog.objects.bulk_create(RequestLog(
        request_id=uuid.uuid4(), received_at=at(j.row.arrival), dispatched_at=at(j.granted),
        finished_at=at(j.done), model=j.row.model, model_requested=j.row.model,
        priority=j.row.priority, band=band(j.row.priority), outcome="ok", scheduler="serial",
        queue_wait_ms=(j.granted - j.row.arrival) * 1000) for j in served.jobs)
    ModelEvent.objects.bulk_create(
        e for t, m, _evicted in served.swap_log
        for e in (ModelEvent(model=m, kind=events.LOAD, reason=events.REQUEST, at=at(t)),
                  ModelEvent(model=m, kind=events.READY, reason=events.REQUEST,
                             at=at(t + LOAD_S), duration_ms=LOAD_S * 1000)))
    return served.swaps


def settled(page: Page) -> None:
    """The panel shows an answer: no question in flight, no state line."""
    expect(page.locator("#whatif")).not_to_have_attribute("aria-busy", "true")
    expect(page.get_by_test_id("whatif-result")).to_be_visible()
    expect(page.get_by_test_id("whatif-state")).to_be_hidden()


def swaps(page: Page) -> tuple[str, str]:
    cells = page.locator("[data-testid=whatif-swaps] td")
    return cells.nth(1).inner_text(), cells.nth(2).inner_text()


def test_the_panel_replays_the_last_24h_as_the_fields_are_typed(serve, browser):  # noqa: F811
    proxy = serve(config(free_port()))
    recorded = orm(record_trace)
    page = new_page(browser)
    asked: list[str] = []

    def count(request: Request) -> None:
        if "/api/whatif?" in request.url:
            asked.append(request.url)

    page.on("request", count)
    log_in(page, proxy)
    page.goto(f"{proxy.base}/admin/scheduling/proxysettings/")
    settled(page)

    # today's settings in both columns, and today's replay is the log
    fidelity = page.get_by_test_id("whatif-fidelity")
    expect(fidelity).to_contain_text(f"100% of {REQUESTS} queue waits within 1 s or 10%")
    expect(fidelity).to_contain_text(f"swaps: recorded {recorded}, replayed {recorded}")
    expect(fidelity).to_contain_text("the replay matches: trust the what-if figures")
    assert swaps(page) == (str(recorded), str(recorded))
    all_row = page.locator("[data-testid=whatif-table] tr[data-band=all] td")
    expect(all_row.nth(1)).to_have_text(str(REQUESTS))
    expect(page.locator("[data-testid=whatif-table] .whatif-changed")).to_have_count(0)

    # bonus 0: the what-if column changes, with more swaps; today's stays
    page.locator("#id_swap_affinity_bonus").fill("0")
    expect(page.locator("[data-testid=whatif-swaps] .whatif-changed")).to_be_visible()
    settled(page)
    today, what_if = swaps(page)
    assert today == str(recorded) and int(what_if) > recorded
    expect(page.get_by_test_id("whatif-makespan")).to_contain_text("(+")
    screenshot(page.locator("#whatif"), "settings-whatif", docs=True)

    # a divisor the settings page refuses: the server's reason, no figures
    page.locator("#id_aging_divisor").fill("0")
    state = page.get_by_test_id("whatif-state")
    expect(state).to_contain_text("agingDivisor ≤ 0: waiting would never raise a score")
    expect(page.get_by_test_id("whatif-result")).to_be_hidden()

    page.locator("#id_aging_divisor").fill("60")
    settled(page)
    before = len(asked)
    # four keystrokes in quick succession: one question, for what was typed last
    bonus = page.locator("#id_swap_affinity_bonus")
    bonus.fill("")
    bonus.press_sequentially("1234", delay=40)
    expect(page.get_by_test_id("whatif-result")).to_contain_text(
        "swapAffinityBonus 1234 is above 99")
    settled(page)
    typed = asked[before:]
    assert 1 <= len(typed) <= 2, typed
    assert "swap_affinity_bonus=1234&" in typed[-1], typed


def test_the_panel_says_when_the_last_24h_hold_nothing_to_replay(serve, browser):  # noqa: F811
    proxy = serve(config(free_port()))

    def refused_only() -> None:  # a request that never ran has no service time to replay
        RequestLog.objects.create(
            request_id=uuid.uuid4(), received_at=dt.datetime.now(dt.UTC), model="A",
            model_requested="A", priority=0, band="normal", outcome=outcomes.REJECTED_QUEUE,
            scheduler="serial")

    orm(refused_only)
    page = new_page(browser)
    log_in(page, proxy)
    page.goto(f"{proxy.base}/admin/scheduling/proxysettings/")
    state = page.get_by_test_id("whatif-state")
    expect(state).to_contain_text("Nothing to replay in the last 24 h: no request to replay")
    expect(state).to_contain_text("1 never dispatched")
    expect(page.get_by_test_id("whatif-result")).to_be_hidden()
