"""On Anthropic's paths (`/v1/messages`, `/v1/messages/count_tokens`) every error gpuproxy
makes has Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (what the
Anthropic SDK reads), with its status unchanged; an upstream's own error is relayed as it is,
and OpenAI's paths keep OpenAI's shape. (The SDK is not installed here: raw HTTP.)"""

from __future__ import annotations

import hashlib
import json

import pytest

from gpuproxy.proxy.consumers import ProxyConsumer
from gpuproxy.proxy.errors import anthropic_type
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "anthropic-test-key"
AUTH = {"X-Api-Key": KEY}


def config(start: int) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    apiKeys: [{KEY}]
    apiKeyHashes: [{{name: config-{digest[:8]}, sha256: {digest}, admin: true}}]
    models:
      solo:
        cmd: {FAKE}
        concurrencyLimit: 1
      dead:
        cmd: sleep 120
        proxy: http://127.0.0.1:{free_port()}
        checkEndpoint: none
    """


def message(model: str) -> dict:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def anthropic_error(r, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == type_
    assert body["error"]["message"]
    return body["error"]["message"]


def test_the_status_picks_anthropics_type():
    assert [anthropic_type(s) for s in (400, 401, 403, 404, 413, 429, 500, 502, 503, 504)] == [
        "invalid_request_error", "authentication_error", "permission_error",
        "not_found_error", "request_too_large", "rate_limit_error", "api_error", "api_error",
        "overloaded_error", "api_error"]


def test_an_error_after_the_stream_began_is_an_anthropic_error_event():
    """Mid-stream (a cut upstream, an administrator's cancel) on Anthropic's path: its SSE
    `error` event, which the SDK raises with the message; OpenAI's `data:` event elsewhere."""
    consumer = ProxyConsumer()
    consumer.scope = {"path": "/v1/messages"}
    event = consumer.sse_error("model 'm' died", "upstream_error", "upstream_died", 502)
    name, data = event.decode().strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[len("data: "):]) == {
        "type": "error", "error": {"type": "api_error", "message": "model 'm' died"}}
    consumer.scope = {"path": "/v1/chat/completions"}
    event = consumer.sse_error("model 'm' died", "upstream_error", "upstream_died", 502)
    assert json.loads(event.decode()[len("data: "):])["error"]["code"] == "upstream_died"


def test_errors_on_anthropic_paths_have_anthropics_shape(serve):
    start = free_port()
    proxy = serve(config(start))
    h = proxy.http
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v/messages",
                 "/v/messages/count_tokens"):  # and llama-swap's versionless aliases
        # no key: refused on the request head by the edge, and by the consumer for no body
        assert "API key" in anthropic_error(h.post(path, json=message("solo")), 401,
                                            "authentication_error")
        assert "solo" not in anthropic_error(h.post(path), 401, "authentication_error")
        assert "nope" in anthropic_error(h.post(path, json=message("nope"), headers=AUTH),
                                         404, "not_found_error")
    h.headers.update(AUTH)  # (an admin key: the queue below is read with it)
    anthropic_error(h.post("/v1/messages", content=b"{not json", headers={
        **AUTH, "Content-Type": "application/json"}), 400, "invalid_request_error")
    # an upstream that cannot be reached: our 502
    assert "dead" in anthropic_error(h.post("/v1/messages", json=message("dead"),
                                            headers=AUTH), 502, "api_error")
    # the model's one slot is taken: 429 at admission
    held = Chat(proxy.base, "solo", gate="g", start=False)
    held.headers.update(AUTH)
    held.start()
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    anthropic_error(h.post("/v1/messages", json=message("solo"), headers=AUTH), 429,
                    "rate_limit_error")
    open_gate(start, "g")
    assert held.answered().status_code == 200


def test_an_upstreams_own_error_is_relayed_and_openai_paths_keep_openais_shape(serve):
    proxy = serve(config(free_port()))
    h = proxy.http
    # the fake has no /v1/messages: its own 404, in llama.cpp's shape, as it sent it
    r = h.post("/v1/messages", json=message("solo"), headers=AUTH)
    assert r.status_code == 404 and "type" not in r.json() and "error" in r.json()
    r = h.post("/v1/chat/completions", json=message("nope"), headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
