"""The overview's second round (issue 21, closing the gaps with llama-swap's UI) in a real
headless browser against a real `gpuproxy serve`: the active profile switched from the
Routing section, the connection's mark in the tab title, the theme switch's three modes, a
request's user agent and session id in flight, and a model's links to its activity and its
log.

The setup is tests/test_browser.py's (its docstring says why users are created before the
browser opens and database reads go through `orm()`); chromium missing fails, never skips.
"""

from __future__ import annotations

import re
import signal

import pytest
from playwright.sync_api import Page, expect

from activity.models import RequestLog
from scheduling.models import ProxySettings
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, until
from tests.test_browser import browser, log_in, new_page, orm, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

TITLE = "Overview · gpuproxy"
SESSION = "<b>chat-42</b>"  # written as text: no <b> may appear
AGENT = "curl/8.5.0"

#: Every title the page has had, in order: the 🟡 before the socket opens is too brief for an
#: auto-waiting expect to see, so the page records them as they change.
RECORD_TITLES = """
window.titles = [];
new MutationObserver(() => {
  if (window.titles[window.titles.length - 1] !== document.title)
    window.titles.push(document.title);
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      coder:
        cmd: {FAKE}
      writer:
        cmd: {FAKE}
    profiles:
      night:
        description: the writer only
        pins:
          big: writer
          img: ~
      day:
        pins:
          fast: coder
    """


def pins(page: Page):
    return page.get_by_test_id("profile-pins").get_by_test_id("routing-row")


def model_row(page: Page, model: str):
    return page.locator(f"[data-testid=model-row][data-model={model}]")


def saved_profile() -> str:
    return ProxySettings.load().active_profile


def test_profile_title_theme_in_flight_and_a_models_links(serve, browser):  # noqa: F811
    start = free_port()
    proxy = serve(config(start))
    page = new_page(browser)
    page.add_init_script(RECORD_TITLES)
    log_in(page, proxy)

    # the connection's mark in the tab title: connecting, then connected
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    expect(page).to_have_title("🟢 " + TITLE)
    marked = [t for t in page.evaluate("window.titles") if t[:1] in ("🟡", "🟢", "🔴")]
    assert marked == ["🟡 " + TITLE, "🟢 " + TITLE], marked

    # the active profile is a choice: none, then each profile
    choice = page.get_by_test_id("profile-select")
    expect(choice).to_be_visible()
    expect(choice).to_have_value("")
    expect(choice.locator("option")).to_have_text(["none", "day", "night"])
    expect(page.locator("#routing-pins")).to_be_hidden()

    choice.select_option("night")
    expect(page.get_by_test_id("result").first).to_contain_text("profile night is active")
    expect(pins(page)).to_have_text(["bigwriter", "imgdisabled (404)"])
    expect(choice).to_have_value("night")
    expect(choice).to_be_enabled()
    assert orm(saved_profile) == "night"
    assert proxy.http.get("/api/profiles").json()["active"] == "night"

    choice.select_option("day")
    expect(pins(page)).to_have_text(["fastcoder"])
    assert proxy.http.get("/api/profiles").json()["active"] == "day"
    screenshot(page, "overview-profile", clip=page.locator("#routing").bounding_box())

    choice.select_option("")
    expect(page.get_by_test_id("result").first).to_contain_text("no profile is active")
    expect(page.locator("#routing-pins")).to_be_hidden()
    assert orm(saved_profile) == ""

    # the theme: system (light here) -> dark -> light -> system, the stored choice removed
    theme = page.get_by_test_id("theme-switch")
    html = page.locator("html")
    expect(theme).to_have_text("theme: system")
    expect(html).to_have_attribute("data-theme", "light")
    theme.click()
    expect(theme).to_have_text("theme: dark")
    expect(html).to_have_attribute("data-theme", "dark")
    assert page.evaluate("localStorage.getItem('gpuproxy-theme')") == "dark"
    theme.click()
    expect(theme).to_have_text("theme: light")
    expect(html).to_have_attribute("data-theme", "light")
    page.emulate_media(color_scheme="dark")  # a chosen theme does not follow the system
    expect(theme).to_have_attribute("title", re.compile(r"the system's \(dark\)"))  # seen
    expect(html).to_have_attribute("data-theme", "light")
    page.emulate_media(color_scheme="light")
    theme.click()
    expect(theme).to_have_text("theme: system")
    assert page.evaluate("localStorage.getItem('gpuproxy-theme')") is None
    page.emulate_media(color_scheme="dark")  # the system's again: it follows
    expect(html).to_have_attribute("data-theme", "dark")
    page.emulate_media(color_scheme="light")
    expect(html).to_have_attribute("data-theme", "light")

    # in flight: the user agent and the session id, as text (night active for the picture)
    choice.select_option("night")
    expect(pins(page)).to_have_text(["bigwriter", "imgdisabled (404)"])
    assert Chat(proxy.base, "writer").answered().status_code == 200
    held = Chat(proxy.base, "coder", gate="held", start=False)
    held.headers.update({"User-Agent": AGENT, "X-Session-ID": SESSION})
    held.start()
    row = page.locator("[data-testid=inflight-row][data-model=coder]")
    expect(row).to_have_count(1)
    expect(row.get_by_test_id("user-agent")).to_have_text(AGENT)
    expect(row.get_by_test_id("session")).to_have_text("session " + SESSION)
    expect(page.locator("#inflight b")).to_have_count(0)
    screenshot(page, "overview", docs=True, full_page=True)
    open_gate(start, "held")  # coder's port: ports go by sorted id
    assert held.answered().status_code == 200
    expect(row).to_have_count(0)

    # a model's links: its requests on the Activity page, its output on the Logs page
    until("coder's row is written",
          lambda: orm(lambda: RequestLog.objects.filter(model="coder").exists()))
    link = model_row(page, "coder").get_by_test_id("model-id")
    expect(link).to_have_attribute("href", "/dashboard/activity?model=coder")
    link.click()
    expect(page).to_have_url(proxy.base + "/dashboard/activity?model=coder")
    expect(page.get_by_test_id("filter-model")).to_have_value("coder")
    rows = page.get_by_test_id("log-row")
    expect(rows).to_have_count(1)
    expect(rows).to_have_attribute("data-model", "coder")

    page.goto(proxy.base + "/")
    model_row(page, "coder").get_by_test_id("logs-link").click()
    expect(page).to_have_url(proxy.base + "/dashboard/logs?source=coder")
    first = page.get_by_test_id("pane-left")
    expect(first.get_by_test_id("log-source")).to_have_value("coder")
    expect(first.get_by_test_id("log-lines")).to_contain_text("fakellm: model coder loaded")

    # the proxy goes away: the title says disconnected
    page.goto(proxy.base + "/")
    expect(page).to_have_title("🟢 " + TITLE)
    proxy.proc.send_signal(signal.SIGTERM)
    proxy.proc.wait(30)
    expect(page).to_have_title("🔴 " + TITLE)
    expect(page.get_by_test_id("connection")).to_have_text(
        re.compile(r"^disconnected, reconnecting in \d+ s"))
