"""The activity rows say which have a capture (`has_capture`, as llama-swap's rows), so that
the Activity page offers its capture button on those only: `/api/activity` and the page's
`/dashboard/activity/rows` from a real `gpuproxy serve` with `captureBuffer` on."""

from __future__ import annotations

import pytest

from activity.models import RequestLog
from tests.conftest import free_port
from tests.helpers import one_model, until

pytestmark = pytest.mark.django_db(transaction=True)


def chat(model: str) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def row_id(agent: str) -> int:
    return until(f"the row of {agent}", lambda: RequestLog.objects.filter(
        user_agent=agent).values_list("id", flat=True).first())


def test_only_the_rows_with_a_capture_say_so(serve):
    proxy = serve(one_model(free_port(), "captureBuffer: 5"))
    assert proxy.http.post("/v1/chat/completions", json=chat("solo"),
                           headers={"User-Agent": "kept/1"}).status_code == 200
    # a request for no model is refused before anything is captured
    assert proxy.http.post("/v1/chat/completions", json=chat("nope"),
                           headers={"User-Agent": "nope/1"}).status_code == 404
    kept, nope = row_id("kept/1"), row_id("nope/1")
    assert proxy.http.get(f"/api/captures/{kept}").status_code == 200
    assert proxy.http.get(f"/api/captures/{nope}").status_code == 404

    listed = proxy.http.get("/api/activity").json()["data"]
    assert {row["id"]: row["has_capture"] for row in listed} == {kept: True, nope: False}


def test_with_captures_off_no_row_has_one(serve):
    proxy = serve(one_model(free_port()))
    assert proxy.http.post("/v1/chat/completions", json=chat("solo"),
                           headers={"User-Agent": "off/1"}).status_code == 200
    off = row_id("off/1")
    listed = proxy.http.get("/api/activity").json()["data"]
    assert [(row["id"], row["has_capture"]) for row in listed] == [(off, False)]
