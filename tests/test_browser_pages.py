"""The Performance, Logs, Captures and About pages (dashboard/pages/) in a real headless
browser (Debian's chromium through playwright), against a real `gpuproxy serve` on the test
database: each page's main action, and a screenshot of each for docs/dashboard.md.

The setup is tests/test_browser.py's (its docstring says why users are created before the
browser opens and database reads go through `orm()`); chromium missing fails, never skips.
What the page shows is awaited with `expect(...)` or `wait_for_function`, never with sleeps.
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata
from pathlib import Path

import django
import httpx
import psutil  # type: ignore[import-untyped]
import pytest
from django.db import connection
from playwright.sync_api import Page, expect

from tests.conftest import FAKE, free_port
from tests.test_browser import browser, log_in, new_page, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

API_KEY = "sk-about-page-Qz81fLw0"


def one_model(start: int, extra: str = "") -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    {extra}
    models:
      coder:
        cmd: {FAKE}
    """


def samples(page: Page) -> int:
    return int(page.get_by_test_id("perf").get_attribute("data-samples") or "0")


# ---- performance ---------------------------------------------------------------------------

def test_performance_draws_the_samples_follows_them_live_and_says_when_monitoring_is_off(
        serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port(), "performance: {every: 1s}"))
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/performance")
    expect(page.get_by_test_id("pages").get_by_role("link", name="Performance")
           ).to_have_attribute("aria-current", "page")
    page.wait_for_function("Number(document.getElementById('perf').dataset.samples) >= 2")

    # CPU, memory and load are drawn from the samples, with the newest value in the caption
    for chart in ("cpu", "memory", "load"):
        figure = page.get_by_test_id(f"chart-{chart}")
        expect(figure.locator("svg path.line").first).to_be_visible()
        expect(figure.locator("svg path.line").first).to_have_css("fill", "none")  # a line
        expect(figure.get_by_test_id("chart-empty")).to_have_count(0)
    expect(page.get_by_test_id("chart-cpu").locator(".now")).to_have_text(
        re.compile(r"^\d+(\.\d+)? %$"))

    # no GPU on the machine: the GPU charts say so, they draw no zeros
    gpus = proxy.http.get("/api/performance").json()["gpu_stats"]
    for chart in ("gpu-util", "gpu-vram", "gpu-temp", "gpu-power"):
        figure = page.get_by_test_id(f"chart-{chart}")
        if gpus:
            expect(figure.locator("svg path.line").first).to_be_visible()
        else:
            expect(figure.get_by_test_id("chart-empty")).to_have_text(
                re.compile(r"^no GPU series"))
            expect(figure.locator("svg")).to_have_count(0)

    # live: new samples arrive without a reload
    page.evaluate("window.sameDocument = true")
    seen = samples(page)
    page.wait_for_function(
        f"Number(document.getElementById('perf').dataset.samples) > {seen}")
    assert page.evaluate("window.sameDocument") is True

    # pointing at a chart: the sample nearest that moment, in the caption
    cpu = page.get_by_test_id("chart-cpu")
    cpu.locator("svg").hover()
    expect(cpu.locator(".now")).to_have_text(re.compile(r"^at \d\d:\d\d:\d\d: \d+(\.\d+)? %$"))
    page.mouse.move(0, 0)
    expect(cpu.locator(".now")).to_have_text(re.compile(r"^\d+(\.\d+)? %$"))

    # the window selector
    window = page.get_by_test_id("window")
    window.get_by_role("button", name="1 h").click()
    expect(page.get_by_test_id("perf")).to_have_attribute("data-window", "3600")
    expect(window.get_by_role("button", name="1 h")).to_have_attribute("aria-pressed", "true")
    expect(window.get_by_role("button", name="5 min")).to_have_attribute("aria-pressed", "false")
    window.get_by_role("button", name="5 min").click()
    expect(page.get_by_test_id("perf")).to_have_attribute("data-window", "300")
    screenshot(page, "performance", docs=True, full_page=True)

    # monitoring off (the endpoint's 503, tests/test_dashboard_pages.py): how to turn it on
    page.route("**/dashboard/performance/data*", lambda route: route.fulfill(
        status=503, content_type="application/json", body='{"enabled": false}'))
    page.reload()
    expect(page.get_by_test_id("perf-off")).to_be_visible()
    expect(page.get_by_test_id("perf-off")).to_contain_text("performance: {disabled: false}")
    expect(page.get_by_test_id("perf-status")).to_have_text("monitoring is off")


# ---- logs ----------------------------------------------------------------------------------

NOISY = ("\\033[1;31mred alert\\033[0m plain \\033[92mbright green\\033[0m "
         "<script>window.injected=1</script> <b>bold?</b>\\n")


def test_logs_two_panes_follow_live_with_ansi_colours_and_markup_as_text(
        serve, browser, tmp_path: Path):  # noqa: F811
    script = tmp_path / "noisy.sh"
    script.write_text(f"#!/bin/sh\nprintf '{NOISY}'\n"
                      f'exec {sys.executable} -m gpuproxy.testing.fakellm --port "$1" '
                      '--model "$2"\n')
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      noisy:
        cmd: sh {script} ${{PORT}} ${{MODEL_ID}}
      plain:
        cmd: {FAKE}
    """)
    assert proxy.http.post("/api/models/load/noisy").status_code == 200
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/logs")
    left, right = page.get_by_test_id("pane-left"), page.get_by_test_id("pane-right")
    expect(left.get_by_test_id("log-source")).to_have_value("proxy")
    expect(right.get_by_test_id("log-source")).to_have_value("noisy")

    # the upstream's colours are rendered, the escapes never shown, the markup only as text
    lines = right.get_by_test_id("log-lines")
    expect(lines).to_contain_text(
        "red alert plain bright green <script>window.injected=1</script> <b>bold?</b>")
    red = lines.locator("span.ansi-fg-1.ansi-bold")
    expect(red).to_have_text("red alert")
    expect(red).to_have_css("color", "rgb(207, 34, 46)")  # --ansi-1, light theme
    expect(red).to_have_css("font-weight", "700")
    expect(lines.locator("span.ansi-fg-10")).to_have_text("bright green")
    page.get_by_test_id("theme-switch").click()  # the dark theme has its own palette
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    expect(red).to_have_css("color", "rgb(255, 123, 114)")  # --ansi-1, dark
    page.get_by_test_id("theme-switch").click()
    expect(red).to_have_css("color", "rgb(207, 34, 46)")
    expect(lines).not_to_contain_text("[1;31m")
    expect(lines).not_to_contain_text("[0m")
    assert "\x1b" not in lines.inner_text()
    expect(page.locator(".log-lines script, .log-lines b")).to_have_count(0)
    assert page.evaluate("window.injected") is None
    expect(right.get_by_test_id("log-status")).to_have_text("following")

    # the filter keeps the lines holding its text (any case), the new ones too
    right.get_by_test_id("log-filter").fill("RED ALERT")
    expect(lines.locator(".log-line:visible")).to_have_count(1)
    expect(lines.locator(".log-line:visible")).to_contain_text("red alert plain")
    right.get_by_test_id("log-filter").fill("")
    expect(lines.locator(".log-line:visible")).to_have_count(lines.locator(".log-line").count())

    # followed live: a model loaded now shows up in the proxy's pane with no reload
    expect(left.get_by_test_id("log-lines")).to_contain_text('model "noisy" ready')
    page.evaluate("window.sameDocument = true")
    expect(left.get_by_test_id("log-lines")).not_to_contain_text('model "plain" ready')
    left.get_by_test_id("log-filter").fill('"plain"')
    assert proxy.http.post("/api/models/load/plain").status_code == 200
    expect(left.get_by_test_id("log-lines")).to_contain_text('model "plain" ready')
    proxy_lines = left.locator(".log-line:visible")
    expect(proxy_lines.filter(has_text='model "plain" ready')).to_have_count(1)
    expect(proxy_lines.filter(has_text='model "noisy" ready')).to_have_count(0)
    left.get_by_test_id("log-filter").fill("")

    # the right pane switched to the other model: its log only
    right.get_by_test_id("log-source").select_option("plain")
    expect(lines).to_contain_text("fakellm: model plain loaded")
    expect(lines).not_to_contain_text("red alert")
    assert page.evaluate("window.sameDocument") is True
    right.get_by_test_id("log-source").select_option("noisy")
    expect(lines).to_contain_text("red alert")
    screenshot(page, "logs", docs=True, full_page=True)


# ---- captures ------------------------------------------------------------------------------

SECRET = "Bearer sk-never-shown-7f3a"


def test_captures_lists_the_captured_requests_and_opens_one(serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port(), "captureBuffer: 5"))
    with httpx.Client(base_url=proxy.base, trust_env=False, timeout=60) as h:
        plain = h.post("/v1/chat/completions", headers={"Authorization": SECRET}, json={
            "model": "coder", "max_tokens": 3,
            "messages": [{"role": "user", "content": "one two"}]})
        assert plain.status_code == 200
        streamed = h.post("/v1/chat/completions", json={
            "model": "coder", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "three"}]})
        assert streamed.status_code == 200
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/captures")
    rows = page.get_by_test_id("capture-row")
    expect(rows).to_have_count(2)  # the page refreshes its list every 5 s
    expect(rows.nth(0).locator("td.path")).to_have_text("POST /v1/chat/completions (stream)")
    expect(rows.nth(1).locator("td.path")).to_have_text("POST /v1/chat/completions")

    # the plain one: headers as stored (the credential redacted), JSON pretty-printed
    rows.nth(1).click()
    detail = page.get_by_test_id("capture-detail")
    expect(detail.get_by_test_id("req-path")).to_have_text("/v1/chat/completions")
    request = detail.get_by_test_id("request")
    expect(request.locator("[data-header=authorization] [data-testid=header-value]")
           ).to_have_text("[REDACTED]")
    expect(request.get_by_test_id("body")).to_have_attribute("data-kind", "json")
    body = request.get_by_test_id("body-text")
    expect(body).to_contain_text('  "model": "coder",\n  "max_tokens": 3,')
    response = detail.get_by_test_id("response")
    expect(response.get_by_test_id("body")).to_have_attribute("data-kind", "json")
    expect(response.get_by_test_id("body-text")).to_contain_text('"choices": [')
    assert "sk-never-shown" not in page.content()

    # the streamed one: its answer as server-sent events, the last one [DONE]
    rows.nth(0).click()
    expect(response.get_by_test_id("body")).to_have_attribute("data-kind", "sse")
    events = response.get_by_test_id("sse-event")
    expect(events.last.locator("pre")).to_have_text("[DONE]")
    expect(events.first.locator("pre")).to_contain_text('"object": "chat.completion.chunk"')
    assert events.count() >= 3
    # the fake's answer put back together: "tok0 ", "tok1 ", "tok2 " for max_tokens 3
    expect(response.get_by_test_id("sse-answer")).to_have_text(re.compile(r"^tok0 tok1 tok2\s*$"))
    expect(rows.nth(0)).to_have_class("open")
    screenshot(page, "captures", docs=True, full_page=True)


# ---- about ---------------------------------------------------------------------------------

def test_about_says_what_runs_where_and_nothing_secret(
        serve, browser, tmp_path: Path):  # noqa: F811
    proxy = serve(one_model(free_port(), f"apiKeys: [{API_KEY}]"))
    page = new_page(browser)
    log_in(page, proxy, "/dashboard/about")

    def value(section: str, key: str):
        return page.get_by_test_id(f"about-{section}").locator(f"[data-key={key}] dd")

    expect(value("build", "gpuproxy")).to_have_text(metadata.version("gpuproxy"))
    expect(value("build", "python")).to_contain_text(platform.python_version())
    expect(value("build", "django")).to_have_text(django.get_version())
    expect(value("machine", "cpu")).to_contain_text(f"{psutil.cpu_count(logical=True)} threads")
    expect(value("machine", "memory")).to_have_text(
        f"{psutil.virtual_memory().total / 1024 ** 3:.1f} GiB")
    expect(value("scheduler", "scheduler")).to_have_text("serial")
    expect(value("scheduler", "swap-affinity-bonus")).to_have_text("10")
    expect(value("scheduler", "aging-divisor")).to_have_text("60 s")
    expect(value("scheduler", "api-keys")).to_have_text("1 (0 admin)")
    expect(value("scheduler", "capture-buffer")).to_have_text("off")
    expect(value("config", "config-file")).to_contain_text(str(tmp_path / "config.yaml"))
    expect(value("config", "database")).to_contain_text(connection.display_name)

    # copy summary: the page as text, for a bug report
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.get_by_test_id("copy-summary").click()
    expect(page.get_by_test_id("copy-result")).to_have_text("copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.startswith("## Build\ngpuproxy: " + metadata.version("gpuproxy") + "\n")
    assert "\nscheduler: serial\n" in copied and "\n## Machine\n" in copied
    assert API_KEY not in copied

    html = page.content()
    for secret in (API_KEY, "postgres://", "DATABASE_URL", "gpuproxy.testing.fakellm",
                   "--listen", "GPUPROXY_DATA_DIR"):
        assert secret not in html, secret
    screenshot(page, "about", docs=True, full_page=True)
