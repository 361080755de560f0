"""The overview's Fleet panel (issue 24, item 3) in a real headless browser against a real
`gpuproxy serve`: the serve's own node, published by its heartbeat, is up and shows the model
it loads; a second node's row, written here with a heartbeat an hour old by the database's
clock, is shown down, with its queue per model and band when opened. The SQLite answer (an
empty fleet with a note) becomes one line.

The setup is tests/test_browser.py's (its docstring says why database work goes through
`orm()`); chromium missing fails, never skips.
"""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
from django.db import connection
from playwright.sync_api import Page, expect

from activity.models import Node
from tests.conftest import free_port
from tests.helpers import Chat, one_model
from tests.test_browser import browser, log_in, new_page, orm, screenshot, staff  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

HERE, OTHER = "fleet-here", "fleet-gone"


def write_gone_node() -> None:
    """A node that stopped writing an hour ago, by the database's clock; 7 requests queued."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0]
    Node.objects.create(
        node=OTHER, heartbeat_at=now - dt.timedelta(hours=1),
        started_at=now - dt.timedelta(hours=2), pid=99, version="0.9", listen="10.0.0.9:8080",
        loaded=["mistral"], in_flight={"mistral": 2},
        queue={"mistral": {"interactive": {"depth": 1, "oldest_wait_s": 4.0},
                           "batch": {"depth": 6, "oldest_wait_s": 61.5}}})


def row(page: Page, node: str):
    return page.locator(f"[data-testid=fleet-row][data-node={node}]")


def test_the_fleet_panel_shows_each_node_up_or_down(serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port()), {"GPUPROXY_NODE": HERE})
    orm(write_gone_node)
    page = new_page(browser)
    log_in(page, proxy)

    expect(page.get_by_test_id("fleet")).to_be_visible()
    rows = page.get_by_test_id("fleet-row")
    expect(rows).to_have_count(2)
    expect(rows.get_by_test_id("fleet-node")).to_have_text([OTHER, HERE + "this node"])  # by name

    here, gone = row(page, HERE), row(page, OTHER)
    expect(here.get_by_test_id("fleet-status")).to_have_text("up")
    expect(here.get_by_test_id("fleet-status")).to_have_class(re.compile(r"badge-node-up"))
    expect(here.get_by_test_id("fleet-heartbeat")).to_have_text(re.compile(r"^[0-3]\.\d s ago$"))
    expect(gone.get_by_test_id("fleet-status")).to_have_text("down")
    expect(gone.get_by_test_id("fleet-status")).to_have_class(re.compile(r"badge-node-down"))
    expect(gone).to_have_attribute("data-status", "down")
    expect(gone.get_by_test_id("fleet-heartbeat")).to_have_text(re.compile(r"^1 h 0 min ago$"))
    # up and down look different, not only read differently
    colour = "el => getComputedStyle(el).color"
    assert (here.get_by_test_id("fleet-status").evaluate(colour)
            != gone.get_by_test_id("fleet-status").evaluate(colour))

    expect(gone.get_by_test_id("fleet-loaded")).to_have_text("mistral")
    expect(gone.get_by_test_id("fleet-in-flight")).to_have_text("2")
    expect(gone.get_by_test_id("fleet-listen")).to_have_text("10.0.0.9:8080")  # no url
    expect(here.get_by_test_id("fleet-listen")).to_have_text(proxy.base)  # its advertised url
    queued = gone.get_by_test_id("fleet-queued")
    expect(queued.locator("summary")).to_have_text("7")
    expect(queued).to_have_attribute(
        "title", "mistral interactive: 1 (oldest 4.0 s)\nmistral batch: 6 (oldest 61.5 s)")
    queued.locator("summary").click()
    expect(queued.get_by_test_id("fleet-queue-line")).to_have_text(
        ["mistral interactive: 1 (oldest 4.0 s)", "mistral batch: 6 (oldest 61.5 s)"])

    # the serve's own row is live: a request loads `solo`, the next heartbeat says so
    expect(here.get_by_test_id("fleet-loaded")).to_have_text("—")
    assert Chat(proxy.base, "solo").answered().status_code == 200
    expect(here.get_by_test_id("fleet-loaded")).to_have_text("solo")
    expect(queued).to_have_attribute("open", "")  # opened stays open across polls
    screenshot(page, "overview-fleet", clip=page.locator("#fleet").bounding_box())


def test_without_a_fleet_the_panel_is_one_line(serve, browser):  # noqa: F811
    """What /dashboard/fleet answers on SQLite (tests/test_fleet_api.py checks the server
    side), given to the page: one line, no table."""
    proxy = serve(one_model(free_port()), {"GPUPROXY_FLEET_SECONDS": "0"})
    page = new_page(browser)
    sqlite = {"this_node": "solo-box", "down_after_s": 3, "fleet": [],
              "note": "the fleet view needs PostgreSQL: on SQLite ..."}
    page.route("**/dashboard/fleet", lambda route: route.fulfill(
        status=200, content_type="application/json", body=json.dumps(sqlite)))
    log_in(page, proxy)
    note = page.get_by_test_id("fleet-note")
    expect(note).to_have_text("One node; the fleet view needs PostgreSQL.")
    expect(page.locator("#fleet table")).to_be_hidden()
    expect(page.get_by_test_id("fleet-row")).to_have_count(0)


#: Legal node names (scheduling/nodes.py) that are also properties of every plain JS object.
JS_NAMES = ("constructor", "__proto__", "toString")


def test_nodes_named_like_javascripts_own_properties_are_rows_like_any_other(
        serve, browser):  # noqa: F811
    proxy = serve(one_model(free_port()), {"GPUPROXY_NODE": HERE})

    def write() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            now = cursor.fetchone()[0]
        for name in JS_NAMES:
            Node.objects.create(node=name, heartbeat_at=now - dt.timedelta(hours=1),
                                started_at=now - dt.timedelta(hours=2), pid=1, version="0.9",
                                listen="10.0.0.9:8080", loaded=[], in_flight={}, queue={})
        # and one stopping gracefully: its heartbeats (an hour ahead: fresh all test) say so
        Node.objects.create(node="fleet-draining", state="draining",
                            heartbeat_at=now + dt.timedelta(hours=1), started_at=now, pid=2,
                            loaded=[], in_flight={}, queue={})
    orm(write)
    page = new_page(browser)
    log_in(page, proxy)
    expect(page.get_by_test_id("fleet-row")).to_have_count(2 + len(JS_NAMES))
    draining = row(page, "fleet-draining").get_by_test_id("fleet-status")
    expect(draining).to_have_text("draining")
    expect(draining).to_have_class(re.compile(r"badge-node-draining"))
    # in the page's warning colour, not up's nor a plain badge's
    warn = page.evaluate("""() => { const probe = document.createElement("span");
        probe.style.color = "var(--warn)"; document.body.appendChild(probe);
        const c = getComputedStyle(probe).color; probe.remove(); return c; }""")
    assert draining.evaluate("el => getComputedStyle(el).color") == warn
    for name in JS_NAMES:
        found = page.locator(f'[data-testid=fleet-row][data-node="{name}"]')
        expect(found.get_by_test_id("fleet-node")).to_have_text(name)
        expect(found.get_by_test_id("fleet-status")).to_have_text("down")
