"""The routing pages in a real headless browser (Debian's chromium through playwright), against
a real `gpuproxy serve` on the test database: a matrix set's expression checked as it is
typed, before anything is submitted, then saved; the active profile chosen on the settings
page; the dashboard's routing panel following both live, and never showing a peer's key.

The setup is tests/test_browser.py's (its docstring says why users are created before the
browser opens and database reads go through `orm()`); chromium missing fails, never skips.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from scheduling.routing_models import MatrixSet
from tests.conftest import FAKE, free_port
from tests.test_browser import browser, log_in, new_page, orm, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

PEER_KEY = "sk-peer-Vb7kD3mQ9sL1"


def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      llama:
        cmd: {FAKE}
      qwen:
        cmd: {FAKE}
      embed:
        cmd: {FAKE}
    routing:
      router:
        use: matrix
        settings:
          matrix:
            sets:
              solo: "llama | qwen"
    peers:
      cloud:
        proxy: http://127.0.0.1:9
        apiKey: {PEER_KEY}
        models: [remote-model]
    selectors:
      coder:
        strategy: warm
        targets: [qwen, llama]
    profiles:
      night:
        description: small models only
        pins:
          big: qwen
          img: ~
    """


def rows(page: Page, testid: str):
    return page.get_by_test_id(testid).get_by_test_id("routing-row")


def test_a_set_is_checked_as_typed_saved_and_the_dashboard_follows(serve, browser):  # noqa: F811
    proxy = serve(config(free_port()))
    page = new_page(browser)
    add = "/admin/scheduling/matrixset/add/"
    log_in(page, proxy, add)

    page.fill("#id_name", "pair")
    page.locator("#id_dsl").press_sequentially("llama & (qwen")
    error = page.get_by_test_id("dsl-error")
    expect(error).to_have_text("set 'pair': missing closing parenthesis")
    # under the expression field, before anything was submitted
    expect(page.locator(".field-dsl [data-testid=dsl-check]")).to_be_visible()
    expect(page).to_have_url(proxy.base + add)
    assert orm(lambda: MatrixSet.objects.filter(name="pair").exists()) is False

    page.fill("#id_dsl", "llama & nothing")
    expect(error).to_have_text(re.compile(r"^set 'pair': unknown var or model 'nothing'"))

    page.fill("#id_dsl", "(llama | qwen) & embed")
    combos = page.get_by_test_id("dsl-combinations").locator("li")
    expect(combos).to_have_text(["embed & llama", "embed & qwen"])
    expect(error).to_have_count(0)
    screenshot(page, "matrix-set-check", docs=True)
    page.click("input[name=_save]")
    expect(page).to_have_url(re.compile(re.escape(proxy.base) + r"/admin/scheduling/matrixset/"
                                        r"(\?.*)?$"))
    assert orm(lambda: MatrixSet.objects.get(name="pair").dsl) == "(llama | qwen) & embed"

    page.goto(proxy.base + "/")
    expect(page.get_by_test_id("router")).to_have_text("matrix")
    expect(rows(page, "matrix-sets")).to_have_text([re.compile(r"^solo"),
                                                    re.compile(r"^pair\(llama")])
    expect(rows(page, "peers")).to_have_text(["cloud127.0.0.1:9remote-modelheader"])
    expect(rows(page, "selectors")).to_have_text(["coderwarmqwen → llamaqwen"])
    expect(page.get_by_test_id("active-profile")).to_have_text("none")
    assert PEER_KEY not in page.content()

    # the active profile, chosen on the settings page, shows on the dashboard with its pins
    page.goto(proxy.base + "/admin/scheduling/proxysettings/")
    page.select_option("#id_active_profile", "night")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist .success")).to_be_visible()
    page.goto(proxy.base + "/")
    expect(page.get_by_test_id("active-profile")).to_have_text("night")
    expect(rows(page, "profile-pins")).to_have_text(["bigqwen", "imgdisabled (404)"])
    screenshot(page, "dashboard-routing", docs=True,
               clip=page.locator("#routing").bounding_box())
    assert PEER_KEY not in page.content()
