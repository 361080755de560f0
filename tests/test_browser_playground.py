"""The playground (/dashboard/playground) in Chromium against a real `gpuproxy serve`: a chat
streamed with the staff session while API keys are defined (the page holds none), the loading
state while the model starts, the other endpoints' forms, and the load test in which an
interactive stream overtakes a batch flood. See tests/test_browser.py for the fixtures.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from activity import outcomes
from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until
from tests.test_browser import browser, log_in, new_page, orm, screenshot, staff  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = "/dashboard/playground"
KEY = "sk-not-in-the-page"


def test_chat_streams_with_the_session_under_api_keys_and_the_other_forms_answer(
        serve, browser):  # noqa: F811
    start = free_port()
    # the fake answers 503 "Loading model" for 2 s: the page says what it waits for meanwhile
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    apiKeys: [{KEY}]
    models:
      solo:
        cmd: {FAKE} --load-seconds 2 --tps 40
    """)
    page = new_page(browser)
    log_in(page, proxy, PAGE)
    expect(page.get_by_test_id("pages").get_by_text("Playground")).to_have_attribute(
        "aria-current", "page")
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    expect(page.get_by_test_id("chat-model")).to_have_value("solo")
    assert KEY not in page.content()

    page.get_by_test_id("chat-system").fill("You are terse.")
    page.get_by_test_id("chat-priority").select_option("100")
    page.get_by_test_id("chat-form").locator("[name=max_tokens]").fill("24")
    page.get_by_test_id("chat-message").fill("Say something")
    page.get_by_test_id("chat-send").click()
    status = page.get_by_test_id("chat-status")
    expect(status).to_have_text("loading solo…")
    expect(page.get_by_test_id("chat-stop")).to_be_enabled()
    content = page.get_by_test_id("chat-content")
    expect(content).to_contain_text("tok0 tok1")
    expect(content).to_have_text("tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7 tok8 tok9 tok10 "
                                 "tok11 tok12 tok13 tok14 tok15 tok16 tok17 tok18 tok19 tok20 "
                                 "tok21 tok22 tok23 ")
    expect(status).to_contain_text("done: first token")
    expect(page.get_by_test_id("chat-stop")).to_be_disabled()
    screenshot(page, "playground", docs=True, full_page=True)

    rows = orm(lambda: list(RequestLog.objects.filter(path="/v1/chat/completions")
                            .values_list("client", "status_code", "priority")))
    assert rows == [("staff:root", 200, 100)]

    # Stop aborts the fetch mid-stream; the proxy sees its client go, and logs it as such
    page.get_by_test_id("chat-form").locator("[name=max_tokens]").fill("2000")
    page.get_by_test_id("chat-message").fill("Go on")
    page.get_by_test_id("chat-send").click()
    expect(page.get_by_test_id("chat-content").nth(1)).to_contain_text("tok3 ")
    page.get_by_test_id("chat-stop").click()
    expect(status).to_contain_text("stopped after")
    expect(page.get_by_test_id("chat-stop")).to_be_disabled()
    assert until("the stopped request's row", lambda: orm(lambda: RequestLog.objects.filter(
        outcome=outcomes.CANCELLED_INFLIGHT).values_list("client", flat=True).first())) \
        == "staff:root"

    # a model's reasoning goes apart, collapsed (the fake has none: this answer is canned,
    # in llama-server's shape, and the proxy is not asked)
    def chunk(delta: str) -> str:
        return ('data: {"id":"c1","object":"chat.completion.chunk","model":"solo",'
                '"choices":[{"index":0,"delta":' + delta + ',"finish_reason":null}]}\n\n')
    canned = (chunk('{"role":"assistant","content":""}') + chunk('{"reasoning_content":"Two"}')
              + chunk('{"reasoning_content":" thoughts."}') + chunk('{"content":"An answer."}')
              + "data: [DONE]\n\n")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=canned))
    page.get_by_test_id("chat-message").fill("Think")
    page.get_by_test_id("chat-send").click()
    expect(page.get_by_test_id("chat-content").nth(2)).to_have_text("An answer.")
    reasoning = page.get_by_test_id("chat-reasoning").nth(2)
    expect(reasoning).to_be_visible()
    expect(reasoning).not_to_have_attribute("open", "")
    expect(reasoning.locator(".pg-thought")).to_have_text("Two thoughts.")
    expect(page.get_by_test_id("chat-reasoning").nth(0)).to_be_hidden()  # none: no box
    page.unroute("**/v1/chat/completions")

    # rerank: the fake scores by word overlap with the query (tests' own arithmetic:
    # "a red apple" has both words, "red car" one, "blue sky" none)
    page.get_by_role("tab", name="Rerank").click()
    page.get_by_test_id("rerank-query").fill("red apple")
    page.get_by_test_id("rerank-documents").fill("blue sky\nred car\na red apple")
    page.get_by_test_id("rerank-form").get_by_role("button", name="Rerank").click()
    ranked = page.get_by_test_id("rerank-row")
    expect(ranked).to_have_count(3)
    expect(ranked.locator("td:nth-child(3)")).to_have_text(["a red apple", "red car",
                                                            "blue sky"])

    # transcription: the fake says how many bytes of file it received
    page.get_by_role("tab", name="Transcription").click()
    page.get_by_test_id("transcription-file").set_input_files(
        {"name": "hello.wav", "mimeType": "audio/wav", "buffer": b"RIFF0123wave"})
    page.get_by_test_id("transcription-form").get_by_role("button", name="Transcribe").click()
    expect(page.get_by_test_id("transcript")).to_have_text("fake transcript of 12 bytes")

    # images: the fake has no such endpoint; the page says so instead of failing silently
    page.get_by_role("tab", name="Images").click()
    form = page.get_by_test_id("images-form")
    form.locator("textarea[name=prompt]").fill("a red apple")
    form.get_by_role("button", name="Generate").click()
    expect(page.get_by_test_id("images-result").get_by_test_id("result-error")).to_contain_text(
        "HTTP 404")


def test_load_test_shows_interactive_streams_overtaking_a_batch_flood(serve, browser):  # noqa: F811
    start = free_port()
    # one slot; 24 tokens at 10/s: each request streams for 2.4 s, so the batch request
    # that got the slot is still streaming when the interactive ones arrive 0.5 s later
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE} --tps 10
    """)
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    page = new_page(browser)
    log_in(page, proxy, PAGE)
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    page.get_by_role("tab", name="Load test").click()
    groups = page.get_by_test_id("lt-group")
    expect(groups).to_have_count(2)  # the defaults: 4 batch, then 2 interactive
    expect(groups.nth(0).locator("[name=model]")).to_have_value("solo")
    assert [groups.nth(i).locator("[name=priority]").input_value() for i in (0, 1)] == [
        "-100", "100"]
    page.get_by_test_id("lt-run").click()

    timeline = page.get_by_test_id("lt-timeline")
    expect(timeline.get_by_test_id("lt-row")).to_have_count(6)
    expect(timeline).to_have_attribute("data-state", "done", timeout=60_000)
    requests = page.get_by_test_id("lt-request")
    expect(requests).to_have_count(6)
    seen = requests.evaluate_all(
        "rows => rows.map(r => [Number(r.dataset.priority), r.dataset.state,"
        " Number(r.dataset.sent), Number(r.dataset.rank)])")
    assert [s[1] for s in seen] == ["done"] * 6, seen
    batch = [s for s in seen if s[0] == -100]
    interactive = [s for s in seen if s[0] == 100]
    assert (len(batch), len(interactive)) == (4, 2)
    # fired after every batch request ...
    assert min(s[2] for s in interactive) > max(s[2] for s in batch), seen
    # ... and streaming before all but the one batch request that held the slot
    assert sorted(s[3] for s in interactive) == [2, 3], seen
    assert sorted(s[3] for s in batch) == [1, 4, 5, 6], seen
    totals = page.get_by_test_id("lt-total")
    expect(totals).to_have_count(2)
    expect(totals.nth(0)).to_have_attribute("data-priority", "100")
    screenshot(page, "loadtest", docs=True, full_page=True)
