"""The playground (/dashboard/playground) in Chromium against a real `gpuproxy serve`: a chat
streamed with the staff session while API keys are defined (the page holds none), the loading
state while the model starts, the other endpoints' forms, and the load test in which an
interactive stream overtakes a batch flood. See tests/test_browser.py for the fixtures.
"""

from __future__ import annotations

import json
import re

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

    # the row is written by the activity writer shortly after the answer ends
    rows = until("the chat's row", lambda: orm(lambda: list(RequestLog.objects.filter(
        path="/v1/chat/completions").values_list("client", "status_code", "priority"))))
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

    # the answer as Markdown, streamed in pieces that split its marks: a code block, bold,
    # an http link; markup in it stays text, a javascript: link stays text
    answer = ("Use **this**:\n\n```python\nprint('<b>hi</b>')\n```\n\nSee "
              "[the docs](https://example.com/d) <img src=x onerror=window.injected=1> "
              "[no](javascript:window.injected=2)")
    pieces = [answer[i:i + 7] for i in range(0, len(answer), 7)]
    canned = "".join(chunk(json.dumps({"content": p})) for p in pieces) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=canned))
    page.get_by_test_id("chat-message").fill("Show me code")
    page.get_by_test_id("chat-send").click()
    rendered = page.get_by_test_id("chat-content").nth(3)
    expect(rendered.locator("pre.md-code code.language-python")).to_have_text(
        "print('<b>hi</b>')")
    expect(rendered.locator("strong")).to_have_text("this")
    expect(rendered.locator("a")).to_have_count(1)
    expect(rendered.locator("a")).to_have_attribute("href", "https://example.com/d")
    expect(rendered.locator("a")).to_have_attribute("rel", "noopener noreferrer")
    expect(rendered).to_contain_text("<img src=x onerror=window.injected=1>")
    expect(rendered).to_contain_text("[no](javascript:window.injected=2)")
    expect(rendered.locator("img, b")).to_have_count(0)
    assert page.evaluate("window.injected") is None
    page.unroute("**/v1/chat/completions")
    screenshot(page, "playground", docs=True, full_page=True)

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

    # speech: the fake lists no voices. With keys defined the page's GET is refused and
    # asked again as a POST (the session path), which the fake answers 404: free text
    page.get_by_role("tab", name="Speech").click()
    speech = page.get_by_test_id("speech-form")
    page.get_by_test_id("speech-voices").click()
    note = page.get_by_test_id("speech-voices-note")
    expect(note).to_contain_text("no voice list (HTTP 404")
    expect(page.get_by_test_id("speech-voice-choice")).to_be_hidden()
    expect(page.get_by_test_id("speech-voice")).to_have_value("alloy")
    def voice_rows() -> list[tuple[str, int, str]] | None:
        found = orm(lambda: list(RequestLog.objects.filter(path="/v1/audio/voices")
                                 .order_by("id").values_list("method", "status_code",
                                                             "client")))
        return found if len(found) == 2 else None
    # the GET without a key: refused, as anyone's; the POST: the staff session's
    assert until("the voices rows", voice_rows) == [("GET", 401, "127.0.0.1"),
                                                    ("POST", 404, "staff:root")]
    # a model that lists them (llama-swap's shape: {"voices": [...]}): a list to pick
    # from, "other" for a typed one; what is sent is what is picked
    page.route(re.compile(r"/v1/audio/voices\?model=solo$"), lambda route: route.fulfill(
        status=200, content_type="application/json",
        body=json.dumps({"voices": ["af_heart", "am_adam"]})))
    spoken: list[str] = []

    def speak(route):
        spoken.append(route.request.post_data_json["voice"])
        route.fulfill(status=200, content_type="audio/wav", body=b"RIFF0000WAVE")
    page.route("**/v1/audio/speech", speak)
    page.get_by_test_id("speech-voices").click()
    expect(note).to_have_text("2 voices from solo")
    choice = page.get_by_test_id("speech-voice-choice")
    expect(choice.locator("option")).to_have_text(["af_heart", "am_adam", "other (type it)…"])
    expect(choice).to_have_value("af_heart")
    expect(page.get_by_test_id("speech-voice")).to_be_hidden()
    choice.select_option("am_adam")
    speech.locator("textarea[name=input]").fill("Hello")
    speech.get_by_role("button", name="Speak").click()
    expect(page.get_by_test_id("speech-audio")).to_have_count(1)
    choice.select_option("")
    page.get_by_test_id("speech-voice").fill("my-own")
    speech.get_by_role("button", name="Speak").click()
    expect(page.get_by_test_id("speech-audio")).to_have_count(1)
    assert spoken == ["am_adam", "my-own"]  # each answered (its player shown) by then
    page.unroute("**/v1/audio/speech")

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


def test_the_load_test_targets_selectors_and_peer_models_too(serve, browser):  # noqa: F811
    start = free_port()
    # a selector that always picks solo, and a peer nothing listens for (port 9): its
    # request fails with the proxy's 502 naming the peer
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE} --tps 40
    selectors:
      fast:
        strategy: pin
        targets: [solo]
    peers:
      cloud:
        proxy: http://127.0.0.1:9
        models: [remote-model]
    """)
    page = new_page(browser)
    log_in(page, proxy, PAGE)
    expect(page.get_by_test_id("connection")).to_have_text("connected")
    # the chat picks any of them too
    chat_kinds = page.get_by_test_id("chat-model").locator("option")
    expect(chat_kinds).to_have_text(["solo (stopped)", "fast (pin selector → solo)",
                                     "cloud/remote-model (peer)"])
    page.get_by_role("tab", name="Load test").click()
    groups = page.get_by_test_id("lt-group")
    picker = groups.nth(0).locator("[name=model]")
    expect(picker.locator("optgroup")).to_have_count(3)
    assert picker.locator("optgroup").evaluate_all("gs => gs.map(g => g.label)") == [
        "models", "selectors", "peers"]
    assert picker.locator("option").evaluate_all(
        "os => os.map(o => [o.value, o.dataset.kind])") == [
        ["solo", "model"], ["fast", "selector"], ["cloud/remote-model", "peer"]]

    groups.nth(0).locator("[name=count]").fill("2")
    picker.select_option("fast")
    groups.nth(0).locator("[name=delay]").fill("0")
    groups.nth(1).locator("[name=count]").fill("1")
    groups.nth(1).locator("[name=model]").select_option("cloud/remote-model")
    page.get_by_test_id("lt-run").click()
    expect(page.get_by_test_id("lt-timeline")).to_have_attribute("data-state", "done",
                                                                 timeout=60_000)
    requests = page.get_by_test_id("lt-request")
    expect(requests).to_have_count(3)
    seen = requests.evaluate_all("rows => rows.map(r => [r.dataset.model, r.dataset.state])")
    assert seen == [["fast", "done"], ["fast", "done"], ["cloud/remote-model", "error"]]
    expect(requests.nth(2).locator("td.pg-error")).to_contain_text(
        "peer 'cloud' at 127.0.0.1:9")
    def logged() -> list[tuple[str, str, int]] | None:
        found = orm(lambda: sorted(RequestLog.objects.filter(client="staff:root").values_list(
            "model_requested", "model", "status_code")))
        return found if len(found) == 3 else None
    assert until("the three rows", logged) == [("cloud/remote-model", "cloud/remote-model", 502),
                      ("fast", "solo", 200), ("fast", "solo", 200)]
