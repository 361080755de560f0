"""The overview's Models section and the models admin in a real headless browser (Debian's
chromium through playwright), against a real `gpuproxy serve` on the test database (issue 21):
capability tags from the definitions, a link to each ready model's own server, "Unload all"
after a confirmation, and the models list fitting a 1366 px screen.

The setup is tests/test_browser.py's (its docstring says why users are created before the
browser opens); chromium missing fails, never skips.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from dashboard.consumer import capability_tags
from tests.conftest import FAKE, free_port
from tests.test_browser import browser, log_in, model_row, new_page, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int) -> str:
    """Two models that may run together (a group that does not swap; ungrouped models swap),
    one with capabilities, and a third with a long name and URL, as real definitions have."""
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      coder:
        cmd: {FAKE}
        name: "Coder 7B"
        capabilities: {{in: [text, image], out: [text], tools: true, context: 32768}}
      writer:
        cmd: {FAKE}
      qwen3-coder-30b-a3b-instruct-ud-q4_k_xl-128k:
        cmd: {FAKE}
        proxy: http://inference-node-07.gpu-cluster.lab.example.internal:${{PORT}}
        name: "Qwen3 Coder 30B A3B Instruct (UD Q4_K_XL, 128k context, 4 slots)"
        aliases: [qwen-coder-big, qwen3-coder-30b, coder-long]
        concurrencyLimit: 0
        ttl: 900
    groups:
      together:
        swap: false
        members: [coder, writer]
    """


def test_capability_tags_say_what_the_definition_says():
    assert capability_tags({}) == []
    assert capability_tags({"in": ["text", "image"], "out": ["text"], "tools": True,
                            "context": 32768}) == ["vision", "tools", "32k context"]
    assert capability_tags({"reranker": True, "context": 8000}) == ["reranker",
                                                                    "8,000 context"]
    assert capability_tags({"in": ["audio"], "out": ["text"]}) == ["transcription"]
    assert capability_tags({"in": ["text"], "out": ["audio"]}) == ["speech"]


def test_overview_models_tags_upstream_link_and_unload_all(serve, browser):  # noqa: F811
    start = free_port()
    proxy = serve(config(start))
    page = new_page(browser)
    log_in(page, proxy)
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    coder, writer = model_row(page, "coder"), model_row(page, "writer")
    expect(coder.get_by_test_id("capability")).to_have_text(["vision", "tools", "32k context"])
    expect(writer.get_by_test_id("capability")).to_have_count(0)
    unload_all = page.get_by_test_id("unload-all")
    expect(unload_all).to_be_disabled()  # nothing runs
    expect(coder.get_by_test_id("upstream-link")).to_be_hidden()

    for row in (coder, writer):
        row.get_by_test_id("load").click()
        expect(row.get_by_test_id("state")).to_have_text("ready")
    link = coder.get_by_test_id("upstream-link")
    expect(link).to_be_visible()
    expect(link).to_have_attribute("href", "/upstream/coder/")
    expect(link).to_have_attribute("target", "_blank")
    assert proxy.http.get("/upstream/coder/health").status_code == 200  # where it leads
    expect(unload_all).to_be_enabled()
    screenshot(page, "dashboard-models", full_page=True)

    # dismissed: nothing stops
    asked: list[str] = []

    def dismiss(dialog) -> None:
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)
    unload_all.click()
    assert len(asked) == 1 and "coder, writer" in asked[0], asked
    expect(coder.get_by_test_id("state")).to_have_text("ready")

    page.once("dialog", lambda dialog: dialog.accept())
    unload_all.click()
    for row in (coder, writer):
        expect(row.get_by_test_id("state")).to_have_text("stopped")
    expect(page.get_by_test_id("result").first).to_contain_text(
        "unloaded all models: every model is stopped")
    expect(link).to_be_hidden()
    expect(unload_all).to_be_disabled()
    assert not [m for m in proxy.http.get("/running").json()["running"] if m["state"] == "ready"]


def test_models_admin_fits_a_1366_px_screen(serve, browser):  # noqa: F811
    proxy = serve(config(free_port()))
    page = new_page(browser)  # 1366 x 900
    log_in(page, proxy, then="/admin/scheduling/modeldefinition/")
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(3)
    screenshot(page, "models-admin", docs=True, full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert page.evaluate("document.documentElement.scrollWidth <= 1366"), width
    # the admin scrolls a wide table inside its own box (overflow-x: auto), not the page
    table = page.evaluate("(() => { const box = document.querySelector('#changelist .results');"
                          " return [box.scrollWidth, box.clientWidth]; })()")
    assert table[0] <= table[1], table
    expect(page.locator("#result_list")).to_contain_text(
        "0 (default: 10 under fifo, no limit under serial)")
    expect(page.locator("#result_list")).to_contain_text("15 min")
    expect(page).to_have_title(re.compile(r"\| gpuproxy administration$"))
    # the icon, as a browser asks for it of the running proxy
    icon = proxy.http.get("/favicon.ico", follow_redirects=True)
    assert (icon.status_code, icon.headers["content-type"]) == (200, "image/svg+xml"), icon
