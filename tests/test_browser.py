"""The dashboard and the settings page in a real headless browser (Debian's chromium through
playwright), against a real `gpuproxy serve` on the test database.

What the page shows is awaited with playwright's auto-retrying `expect(...)`, never with
sleeps; the proxy's own state is checked over HTTP (`/api/queue`), polled with a deadline.
Screenshots go to tests/artifacts/; with GPUPROXY_UPDATE_SCREENSHOTS=1 the final ones are also
copied to docs/screenshots/ (committed, embedded in docs/dashboard.md).

Playwright's sync API keeps an asyncio loop marked as running on this thread while it is
open, and Django refuses ORM calls there: users are created before the browser starts, and
later database reads go through `orm()` on a worker thread.
"""

# ruff: noqa: RUF001  (the pages write the multiplication and minus signs)
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.contrib.auth.models import User
from django.db import connections
from playwright.sync_api import Browser, Page, expect, sync_playwright

from scheduling.models import ProxySettings
from tests.conftest import FAKE, Proxy, free_port
from tests.helpers import Chat, open_gate, queue_until

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"
DOCS_SCREENSHOTS = Path(__file__).parent.parent / "docs" / "screenshots"
UPDATE_SCREENSHOTS = os.environ.get("GPUPROXY_UPDATE_SCREENSHOTS") == "1"
VIEWPORT = {"width": 1366, "height": 900}  # a laptop screen
USER, PASSWORD = "root", "pw"
SEEN = 15_000  # ms: how long the page may take to show something (a model load included)

expect.set_options(timeout=SEEN)

T = TypeVar("T")
MARKUP = "<img src=x onerror=window.injected=1> coder"


def pair(start: int, coder_name: str = "Coder 7B") -> str:
    """Two models that cannot run together: `coder` on port `start`, `writer` on
    `start + 1` (ports go by sorted id)."""
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      coder:
        cmd: {FAKE}
        name: "{coder_name}"
      writer:
        cmd: {FAKE}
    groups:
      pair:
        swap: true
        members: [coder, writer]
    """


# ---- fixtures and helpers ------------------------------------------------------------------

@pytest.fixture
def staff() -> User:
    """Created before the browser opens (see the module docstring)."""
    return User.objects.create_superuser(USER, "root@example.com", PASSWORD)


@pytest.fixture
def browser(staff: User) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is missing: scripts/ensure-test-tools installs it "
                    "(apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            yield b
        finally:
            b.close()


def new_page(browser: Browser) -> Page:
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.set_default_timeout(SEEN)
    return page


def orm(fn: Callable[[], T]) -> T:
    """Run a database read on a worker thread (this one has playwright's loop running)."""
    def run() -> T:
        try:
            return fn()
        finally:
            connections.close_all()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def log_in(page: Page, proxy: Proxy, then: str = "/") -> None:
    """Through the admin's login form, as a person does."""
    page.goto(f"{proxy.base}/admin/login/?next={then}")
    page.fill("#id_username", USER)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page).to_have_url(proxy.base + then)


def screenshot(page: Page, name: str, docs: bool = False, **kwargs: Any) -> None:
    """Always an artifact; the ones docs/dashboard.md shows are refreshed only on request, so
    an ordinary run leaves the committed images alone."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), **kwargs)
    if docs and UPDATE_SCREENSHOTS:
        DOCS_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_SCREENSHOTS / f"{name}.png")


def queued(q: dict) -> list[tuple[str, int]]:
    return [(r["model"], r["priority"]) for r in q["queued"]]


def model_row(page: Page, model: str):
    return page.locator(f"[data-testid=model-row][data-model={model}]")


# ---- the settings page ---------------------------------------------------------------------

def test_settings_refuse_120_apply_20_to_the_running_proxy_and_explain_as_you_type(
        serve, browser):
    start = free_port()
    proxy = serve(pair(start))
    page = new_page(browser)
    log_in(page, proxy)
    before = orm(ProxySettings.load)
    assert before.swap_affinity_bonus == 10

    # coder loaded and busy; then writer at priority 15 and coder at 0 wait. With the bonus
    # at 10, coder's score is 10 < 15: writer comes first. At 20 it is 20 > 15: coder first.
    assert proxy.http.post("/api/models/load/coder").status_code == 200
    held = Chat(proxy.base, "coder", gate="held")
    queue_until(proxy, lambda q: q["in_flight"].get("coder") == 1)
    for_writer = Chat(proxy.base, "writer", priority="15")
    queue_until(proxy, lambda q: len(q["queued"]) == 1)
    for_coder = Chat(proxy.base, "coder", priority="0")
    q = queue_until(proxy, lambda q: len(q["queued"]) == 2)
    assert queued(q) == [("writer", 15), ("coder", 0)]

    page.goto(f"{proxy.base}/admin/scheduling/proxysettings/")
    bonus = page.locator("#id_swap_affinity_bonus")
    panel = page.locator("#guarantees-list")
    expect(bonus).to_have_value("10")
    expect(panel).to_contain_text("holds: the bonus (10) is below the 100 points")

    # the panel follows the field as it is typed, before anything is submitted
    bonus.fill("30")
    expect(panel).to_contain_text("holds: the bonus (30) is below the 100 points")
    expect(panel).to_contain_text("(200 + 30) × 60 s")
    bonus.fill("120")
    expect(panel.locator(".guarantee-bad")).to_contain_text(
        "bonus ≥ 100: band isolation is broken")

    # 120 is refused on the field, and nothing changes: not the row, not the proxy
    page.click("input[name=_save]")
    expect(page.locator(".errornote")).to_be_visible()
    expect(page.locator(".field-swap_affinity_bonus .errorlist")).to_contain_text("0..99")
    expect(panel).to_contain_text("refused on save")
    after = orm(ProxySettings.load)
    assert (after.swap_affinity_bonus, after.version) == (10, before.version)
    assert queued(proxy.http.get("/api/queue").json()) == [("writer", 15), ("coder", 0)]

    # 20 is saved, and the running proxy re-ranks the same queue with it
    page.locator("#id_swap_affinity_bonus").fill("20")
    expect(panel).to_contain_text("holds: the bonus (20) is below the 100 points")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist .success")).to_contain_text("changed successfully")
    expect(page.locator("#id_swap_affinity_bonus")).to_have_value("20")
    saved = orm(ProxySettings.load)
    assert saved.swap_affinity_bonus == 20 and saved.version > before.version
    queue_until(proxy, lambda q: queued(q) == [("coder", 0), ("writer", 15)])
    screenshot(page, "settings", docs=True)  # the saved message, the fields and the panel

    # the dashboard, over its WebSocket, says the same
    page.goto(proxy.base + "/")
    expect(page.get_by_test_id("bonus")).to_have_text("20")
    expect(page.locator("[data-testid=band-normal] [data-testid=waiting-row]")).to_have_count(2)
    rows = page.locator("[data-testid=band-normal] [data-testid=waiting-row]")
    expect(rows.nth(0)).to_have_attribute("data-model", "coder")
    expect(rows.nth(0).get_by_test_id("position")).to_have_text("#1")
    expect(rows.nth(1)).to_have_attribute("data-model", "writer")

    open_gate(start, "held")
    assert [c.answered().status_code for c in (held, for_coder, for_writer)] == [200, 200, 200]
    queue_until(proxy, lambda q: not q["queued"] and not q["in_flight"])


# ---- the dashboard -------------------------------------------------------------------------

def test_dashboard_load_queue_cancel_activity_and_logs_live(serve, browser):
    start = free_port()
    proxy = serve(pair(start))
    page = new_page(browser)
    log_in(page, proxy)
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    expect(page.get_by_test_id("scheduler-kind")).to_have_text("serial")
    expect(page.get_by_test_id("bonus")).to_have_text("10")
    for m in ("coder", "writer"):
        expect(model_row(page, m).get_by_test_id("state")).to_have_text("stopped")
    expect(page.get_by_test_id("recent-row")).to_have_count(0)
    page.evaluate("window.sameDocument = true")  # gone if anything reloaded the page
    expect(model_row(page, "coder").get_by_test_id("model-sub")).to_have_text("Coder 7B")

    # Load: the badge turns ready with no reload, and the result is said
    model_row(page, "coder").get_by_test_id("load").click()
    expect(model_row(page, "coder").get_by_test_id("state")).to_have_text("ready")
    expect(model_row(page, "coder").get_by_test_id("pid")).to_have_text(re.compile(r"^\d+$"))
    expect(model_row(page, "coder").get_by_test_id("load")).to_be_disabled()
    expect(page.get_by_test_id("result").first).to_contain_text("coder is ready")
    assert page.evaluate("window.sameDocument") is True
    assert any(m["model"] == "coder" and m["state"] == "ready"
               for m in proxy.http.get("/running").json()["running"])

    # some history for the charts and the activity table: a swap to writer and back
    assert Chat(proxy.base, "writer").answered().status_code == 200
    assert Chat(proxy.base, "coder", priority="interactive").answered().status_code == 200
    expect(page.get_by_test_id("recent-row")).to_have_count(2)

    # Logs: the model's own output, then followed live
    page.get_by_test_id("log-source").select_option("coder")
    expect(page.get_by_test_id("log-lines")).to_contain_text("fakellm: model coder loaded")

    # one request held in flight; Restart waits for it, and the row says so
    held = Chat(proxy.base, "coder", gate="held")
    inflight = page.locator("[data-testid=inflight-row][data-model=coder]")
    expect(inflight).to_have_count(1)
    expect(inflight.get_by_test_id("client")).to_have_text("127.0.0.1")
    expect(inflight.get_by_test_id("path")).to_have_text("/v1/chat/completions")
    restart_needed = model_row(page, "coder").get_by_test_id("restart-needed")
    expect(restart_needed).to_be_hidden()
    model_row(page, "coder").get_by_test_id("restart").click()
    expect(page.get_by_test_id("result").first).to_contain_text("coder restarts when idle")
    expect(restart_needed).to_be_visible()

    # a batch request and a normal one for writer wait behind it
    batch = Chat(proxy.base, "coder", priority="batch")
    waiting = page.locator("[data-testid=band-batch] [data-testid=waiting-row][data-model=coder]")
    expect(waiting).to_have_count(1)
    expect(waiting.get_by_test_id("priority")).to_have_text("−100")
    expect(page.get_by_test_id("depth-batch")).to_have_text("1")
    other = Chat(proxy.base, "writer", priority="5")
    expect(page.locator("[data-testid=band-normal] [data-testid=waiting-row][data-model=writer]")
           ).to_have_count(1)
    expect(page.get_by_test_id("depth-normal")).to_have_text("1")
    expect(model_row(page, "coder").get_by_test_id("in-flight")).to_have_text("1")
    screenshot(page, "dashboard", docs=True, full_page=True)

    # served: the batch row leaves its band and shows up in Recent activity
    open_gate(start, "held")
    expect(waiting).to_have_count(0)
    expect(page.get_by_test_id("depth-batch")).to_have_text("0")
    expect(page.locator("[data-testid=recent-row][data-band=batch][data-model=coder]"
                        "[data-outcome=ok]")).to_have_count(1)
    assert [c.answered().status_code for c in (held, batch, other)] == [200, 200, 200]
    expect(inflight).to_have_count(0)
    expect(restart_needed).to_be_hidden()

    # Cancel: the client gets a 503 saying why, the row leaves, the activity says so
    doomed = Chat(proxy.base, "coder", gate="never")
    row = page.locator("[data-testid=inflight-row][data-model=coder]")
    expect(row).to_have_count(1)
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_test_id("cancel").click()
    r = doomed.answered()
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "cancelled_by_admin"
    expect(row).to_have_count(0)
    expect(page.locator("[data-testid=recent-row][data-model=coder]"
                        "[data-outcome=cancelled_by_admin]")).to_have_count(1)
    expect(page.get_by_test_id("result").first).to_contain_text(
        "cancelled the request to coder from 127.0.0.1")

    # the log tail switches to the proxy's own log
    page.get_by_test_id("log-source").select_option("proxy")
    lines = page.get_by_test_id("log-lines")
    expect(lines).to_contain_text('gpuproxy.upstream.processes: model "coder" ready')
    expect(lines).not_to_contain_text("fakellm: model coder loaded")
    assert page.evaluate("window.sameDocument") is True
    screenshot(page, "dashboard-after", full_page=True)

    # the proxy goes away: the page says so, greys out, and keeps trying with a backoff
    proxy.proc.send_signal(signal.SIGTERM)
    proxy.proc.wait(30)
    expect(page.get_by_test_id("connection")).to_have_text(
        re.compile(r"^disconnected, reconnecting in \d+ s"))
    expect(page.locator("main")).to_have_class(re.compile(r"\bstale\b"))


# ---- who may see it ------------------------------------------------------------------------

WS_PROBE = """(target) => new Promise((resolve) => {
  const ws = new WebSocket(target || "ws://" + location.host + "/ws/dashboard");
  let opened = false;
  ws.onopen = () => { opened = true; };
  ws.onmessage = (e) => { resolve({opened, type: JSON.parse(e.data).type}); ws.close(); };
  ws.onclose = (e) => resolve({opened, code: e.code});
})"""


def test_dashboard_and_its_websocket_are_for_staff_only(serve, browser, staff):
    start = free_port()
    proxy = serve(pair(start, coder_name=MARKUP))
    page = new_page(browser)

    # anonymous: the page sends to the login, the socket is refused
    page.goto(proxy.base + "/")
    expect(page).to_have_url(re.compile(re.escape(proxy.base) + r"/admin/login/\?next=/$"))
    assert page.evaluate(WS_PROBE) == {"opened": False, "code": 1006}

    # staff: both work
    log_in(page, proxy)
    assert page.evaluate(WS_PROBE) == {"opened": True, "type": "state"}

    # a page of another origin on the same host (the browser sends it the same cookies:
    # here coder's upstream) cannot open the socket with the staff session
    assert proxy.http.post("/api/models/load/coder").status_code == 200
    page.goto(f"http://127.0.0.1:{start}/health")
    target = proxy.base.replace("http://", "ws://") + "/ws/dashboard"
    assert page.evaluate(WS_PROBE, target) == {"opened": False, "code": 1006}
    page.goto(proxy.base + "/")

    # what the configuration says is shown as text, never run as markup
    expect(model_row(page, "coder").get_by_test_id("model-sub")).to_have_text(MARKUP)
    expect(page.locator("#models img")).to_have_count(0)
    assert page.evaluate("window.injected") is None

    # logging out from the dashboard's header ends the session
    page.get_by_role("button", name="Log out").click()
    expect(page.locator("#content")).to_contain_text("Logged out")
    page.goto(proxy.base + "/")
    expect(page).to_have_url(re.compile(re.escape(proxy.base) + r"/admin/login/\?next=/$"))
    log_in(page, proxy)

    # the same session once the user is no longer staff: neither works
    def demote() -> None:
        User.objects.filter(pk=staff.pk).update(is_staff=False, is_superuser=False)

    orm(demote)
    page.goto(proxy.base + "/")
    expect(page).to_have_url(re.compile(re.escape(proxy.base) + r"/admin/login/\?next=/$"))
    assert page.evaluate(WS_PROBE) == {"opened": False, "code": 1006}
