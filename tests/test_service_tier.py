"""Priority from the ecosystem: OpenAI's `service_tier` when the header is absent, and the
priority forwarded to a vLLM upstream in its own `priority` field."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from gpuproxy.proxy.inference import Parsed, apply_filters
from scheduling.core.priority import service_tier_priority
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(("tier", "priority"), [
    ("priority", 100), ("flex", -100), ("default", 0), ("auto", 0), ("FLEX", -100),
    ("scale", None), ("", None), (None, None), (3, None), (["flex"], None)])
def test_service_tier_values(tier, priority):
    assert service_tier_priority(tier) == priority


def test_vllm_priority_is_negated_and_a_client_value_kept():
    def body(json_body: dict) -> dict:
        parsed = Parsed(model="m", stream=False, body=json.dumps(json_body).encode(),
                        json_body=json_body)
        return json.loads(apply_filters(parsed, requested="m", use_model_name="",
                                        strip_params=(), set_params={}, set_params_by_id={},
                                        vllm_priority=100))

    assert body({"model": "m"})["priority"] == -100
    assert body({"model": "m", "priority": 7})["priority"] == 7


def _chat(proxy, model: str, headers: dict | None = None, **extra) -> None:
    """A chat request in the background with extra body fields."""

    def go() -> None:
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=60) as h:
            h.post("/v1/chat/completions", headers=headers or {}, json={
                "model": model, "max_tokens": 1, "messages": [], **extra})

    threading.Thread(target=go, daemon=True).start()


def test_service_tier_orders_the_queue_and_the_header_wins(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    models:
      solo:
        cmd: {FAKE}
    """)
    held = Chat(proxy.base, "solo", gate="g")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    sent = [({}, {"service_tier": "flex"}), ({}, {"service_tier": "priority"}),
            ({"X-LlamaSwap-Priority": "batch"}, {"service_tier": "priority"}),
            ({}, {"service_tier": "scale"})]
    for n, (headers, extra) in enumerate(sent, 1):
        _chat(proxy, "solo", headers, **extra)
        queue_until(proxy, lambda q, n=n: len(q["queued"]) == n)
    q = proxy.http.get("/api/queue").json()
    assert sorted(w["priority"] for w in q["queued"]) == [-100, -100, 0, 100]
    assert q["queued"][0]["priority"] == 100  # "priority" tier, no header: first
    open_gate(start, "g")
    assert held.answered().status_code == 200


def test_the_priority_reaches_a_vllm_upstream_in_its_own_field(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    models:
      vllm:
        cmd: {FAKE}
        vllmPriority: true
      plain:
        cmd: {FAKE}
    groups:
      both: {{swap: false, members: [vllm, plain]}}
    """)

    def upstream_saw(port: int) -> dict:
        return httpx.get(f"http://127.0.0.1:{port}/fake/last-body", trust_env=False).json()[
            "body"]

    r = proxy.http.post("/v1/chat/completions", headers={"X-LlamaSwap-Priority": "batch"},
                        json={"model": "vllm", "max_tokens": 1, "messages": []})
    assert r.status_code == 200
    port_plain, port_vllm = start, start + 1  # ports go in sorted id order
    assert upstream_saw(port_vllm)["priority"] == 100  # vLLM: lower is served first
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "vllm", "max_tokens": 1, "messages": [], "service_tier": "priority"})
    assert upstream_saw(port_vllm)["priority"] == -100
    r = proxy.http.post("/v1/chat/completions", headers={"X-LlamaSwap-Priority": "batch"},
                        json={"model": "plain", "max_tokens": 1, "messages": []})
    assert r.status_code == 200 and "priority" not in upstream_saw(port_plain)
