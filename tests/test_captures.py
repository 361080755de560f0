"""Captures (`captureBuffer`, `GET /api/captures/{id}`): off by default; on, a model request's
path, headers and bodies with every credential redacted, the oldest out past the budget, a
failed request's request side only. The request and the GET may land in different request
processes (`--workers 2`)."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import pytest

from activity.models import Capture, RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_KEY = "admin-secret-key-4d1f"
CLIENT_KEY = "client-secret-key-93ab"


def config(start: int, capture_mb: int | None, keys: bool = True) -> str:
    admin = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    extra = (f"apiKeys: [{CLIENT_KEY}]\n    apiKeyHashes: [{{name: ops, sha256: {admin}, "
             "admin: true}]") if keys else ""
    buffer = f"captureBuffer: {capture_mb}" if capture_mb is not None else ""
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    {buffer}
    {extra}
    models:
      solo:
        cmd: {FAKE}
    """


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def chat(text: str = "one two three", **kw) -> dict:
    return {"model": "solo", "messages": [{"role": "user", "content": text}],
            "max_tokens": 3, **kw}


def row_of(agent: str) -> RequestLog:
    """The activity row of the request sent with User-Agent `agent`, once it is written."""
    return until(f"the row of {agent}",
                 lambda: RequestLog.objects.filter(user_agent=agent).first())


def body(capture: dict, key: str) -> bytes:
    return base64.b64decode(capture[key])


def test_off_by_default_nothing_is_stored_and_the_get_is_404(serve):
    proxy = serve(config(free_port(), None, keys=False))
    r = proxy.http.post("/v1/chat/completions", json=chat(), headers={"User-Agent": "off/1"})
    assert r.status_code == 200
    row = row_of("off/1")
    got = proxy.http.get(f"/api/captures/{row.id}")
    assert got.status_code == 404 and got.json()["error"]["code"] == "capture_not_found"
    assert not Capture.objects.exists()
    listed = proxy.http.get("/api/metrics/activity").json()["data"]
    assert [x["has_capture"] for x in listed if x["id"] == row.id] == [False]


def test_json_and_sse_answers_are_captured_with_every_credential_redacted(serve):
    proxy = serve(config(free_port(), 5))
    sent = chat("what is in a capture", user="u1")
    r = proxy.http.post("/v1/chat/completions", json=sent, headers={
        "User-Agent": "json/1", "Authorization": f"Bearer {CLIENT_KEY}",
        "Cookie": "session=cookie-secret-77", "X-Trace": "kept"})
    assert r.status_code == 200
    with proxy.http.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers={
            "User-Agent": "sse/1", "X-Api-Key": CLIENT_KEY}) as s:
        assert s.status_code == 200
        streamed = s.read()

    captured = proxy.http.get(f"/api/captures/{row_of('json/1').id}", headers=ADMIN)
    assert captured.status_code == 200, captured.text
    c = captured.json()
    assert set(c) == {"id", "req_path", "req_headers", "req_body", "resp_headers", "resp_body"}
    assert c["id"] == row_of("json/1").id and c["req_path"] == "/v1/chat/completions"
    assert c["req_headers"]["Authorization"] == "[REDACTED]"
    assert c["req_headers"]["Cookie"] == "[REDACTED]"
    assert c["req_headers"]["X-Trace"] == "kept"
    assert json.loads(body(c, "req_body")) == sent
    assert json.loads(body(c, "resp_body")) == r.json()
    assert c["resp_headers"]["Content-Type"].startswith("application/json")
    for secret in (CLIENT_KEY, "cookie-secret-77"):
        assert secret not in captured.text

    sse = proxy.http.get(f"/api/captures/{row_of('sse/1').id}", headers=ADMIN)
    assert sse.status_code == 200
    c = sse.json()
    assert c["req_headers"]["X-Api-Key"] == "[REDACTED]" and CLIENT_KEY not in sse.text
    assert body(c, "resp_body") == streamed and streamed.rstrip().endswith(b"data: [DONE]")
    assert c["resp_headers"]["Content-Type"].startswith("text/event-stream")

    # llama-swap's activity list says which rows have one: not a request for no model
    assert proxy.http.post("/v1/chat/completions", json={**sent, "model": "nope"}, headers={
        "User-Agent": "nope/1", "Authorization": f"Bearer {CLIENT_KEY}"}).status_code == 404
    nope = row_of("nope/1").id
    listed = proxy.http.get("/api/metrics/activity", headers=ADMIN).json()["data"]
    has = {x["id"]: x["has_capture"] for x in listed}
    assert (has[row_of("json/1").id], has[row_of("sse/1").id], has[nope]) == (True, True, False)

    # prompts: admin keys only
    other = proxy.http.get(f"/api/captures/{row_of('sse/1').id}",
                           headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert other.status_code == 403
    assert proxy.http.get(f"/api/captures/{row_of('sse/1').id}").status_code == 401
    assert proxy.http.get("/api/captures/x", headers=ADMIN).status_code == 400


def test_a_failed_request_keeps_its_request_side_only(serve):
    proxy = serve(config(free_port(), 5, keys=False))
    # through /upstream: the fake answers 400 to a body that is not a JSON object
    r = proxy.http.post("/upstream/solo/v1/chat/completions", content=b"[1, 2]",
                        headers={"User-Agent": "failed/1", "Content-Type": "application/json"})
    assert r.status_code == 400
    c = proxy.http.get(f"/api/captures/{row_of('failed/1').id}").json()
    assert c["req_path"] == "/upstream/solo/v1/chat/completions"
    assert body(c, "req_body") == b"[1, 2]"
    assert c["resp_body"] is None and c["resp_headers"] is not None


def test_the_oldest_captures_go_past_the_budget(serve):
    proxy = serve(config(free_port(), 1, keys=False))
    # ~400 kB that compress to ~300 kB each: the third and later push the first ones out
    for i in range(5):
        noise = base64.b64encode(os.urandom(300_000)).decode()
        r = proxy.http.post("/v1/chat/completions", json=chat(noise),
                            headers={"User-Agent": f"big/{i}"})
        assert r.status_code == 200
        # stored before the next is sent: with --workers 2 each request process writes its
        # own, and the order they are stored in is the order they go in
        n = row_of(f"big/{i}").id
        until(f"capture {i} stored",
              lambda n=n: proxy.http.get(f"/api/captures/{n}").status_code == 200)
    ids = [row_of(f"big/{i}").id for i in range(5)]
    statuses = [proxy.http.get(f"/api/captures/{i}").status_code for i in ids]
    assert statuses[0] == 404 and statuses[-1] == 200
    kept = statuses.index(200)
    assert statuses[kept:] == [200] * (5 - kept)  # the oldest went, the newest stayed
    assert 0 < sum(Capture.objects.values_list("size", flat=True)) <= 1024 * 1024
