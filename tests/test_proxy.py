"""The OpenAI-compatible proxy end to end: Daphne (`gpuproxy serve`), real fake upstreams, the
real `openai` client, real PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.conftest import FAKE, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def config(start_port: int, extra: str = "") -> str:
    return f"""
    startPort: {start_port}
    healthCheckTimeout: 15
    models:
      alpha:
        cmd: {FAKE}
        aliases: [a]
      beta:
        cmd: {FAKE}
        filters:
          setParamsByID:
            beta-short: {{max_tokens: 2}}
      gamma:
        cmd: {FAKE}
        useModelName: gamma-upstream-name
        filters:
          stripParams: "temperature, model"
          setParams: {{max_tokens: 3}}
      broken:
        cmd: {FAKE} --exit-on-start 1
      hidden:
        cmd: {FAKE}
        unlisted: true
      nothere:
        cmd: {FAKE}
        proxy: http://127.0.0.1:1
        checkEndpoint: none
    groups:
      trio:
        swap: false
        exclusive: false
        members: [alpha, beta, gamma]
    {extra}
    """


def client(proxy, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def served_port(fingerprint: str) -> int:
    return int(fingerprint.rsplit(":", 1)[1])


def test_chat_streaming_and_not_with_the_openai_client(serve):
    sp = free_port()
    proxy = serve(config(sp))
    oa = client(proxy)
    chat = oa.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert chat.model == "alpha" and served_port(chat.system_fingerprint) == sp
    assert chat.usage.completion_tokens == 4

    stream = oa.chat.completions.create(model="alpha", stream=True, max_tokens=5,
                                        messages=[{"role": "user", "content": "hi"}],
                                        stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 "


def test_sse_is_relayed_unbuffered_and_a_leaving_client_stops_generation(serve):
    """Chunks arrive while the upstream is still generating, and closing the stream early
    reaches the upstream: it reports the client gone after a few of its 50 tokens (a
    buffering proxy would have let it finish all 50 before the client saw any)."""
    proxy = serve(config(free_port()).replace(f"alpha:\n        cmd: {FAKE}",
                                              f"alpha:\n        cmd: {FAKE} --tps 20"))
    with proxy.http.stream("POST", "/v1/chat/completions", json={
            "model": "alpha", "stream": True, "max_tokens": 50,
            "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        data = (line for line in r.iter_lines() if line.startswith("data:"))
        first = next(data)
        assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant"
        next(data)
        next(data)
    with proxy.http.stream("GET", "/logs/stream/alpha") as logs:
        for line in logs.iter_lines():
            if "client went away after" in line:
                sent = int(line.split("after ")[1].split()[0])
                assert sent < 50
                break


def test_completions_embeddings_and_filters(serve):
    proxy = serve(config(free_port()))
    oa = client(proxy)
    comp = oa.completions.create(model="alpha", prompt="one two", max_tokens=2)
    assert comp.choices[0].text == "tok0 tok1 "
    emb = oa.embeddings.create(model="alpha", input=["x", "y"], encoding_format="float")
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 8

    # setParamsByID: the id is an alias and its params apply
    short = oa.chat.completions.create(model="beta-short", max_tokens=20,
                                       messages=[{"role": "user", "content": "x"}])
    assert short.model == "beta" and short.choices[0].message.content == "tok0 tok1 "
    # useModelName rewrites model; setParams forces max_tokens
    g = proxy.http.post("/v1/chat/completions", json={
        "model": "gamma", "max_tokens": 30, "temperature": 1,
        "messages": [{"role": "user", "content": "x"}]}).json()
    assert g["model"] == "gamma"  # fakellm names itself; the body it saw is below
    assert g["usage"]["completion_tokens"] == 3


def test_multipart_transcription(serve):
    proxy = serve(config(free_port()))
    oa = client(proxy)
    out = oa.audio.transcriptions.create(model="gamma", file=("a.wav", b"\x00" * 1234))
    assert out.text == "fake transcript of 1234 bytes"
    raw = proxy.http.post("/v1/audio/transcriptions", data={"model": "gamma"},
                          files={"file": ("a.wav", b"\x01" * 10)}).json()
    assert raw["form_model"] == "gamma-upstream-name"  # useModelName applied to the form


def test_swap_between_two_models_of_one_group(serve):
    sp = free_port()
    proxy = serve(config(sp, extra="""
    """).replace("swap: false", "swap: true"))
    oa = client(proxy)
    for model, port in [("alpha", sp), ("beta", sp + 1), ("alpha", sp)]:
        r = oa.chat.completions.create(model=model, max_tokens=1,
                                       messages=[{"role": "user", "content": "x"}])
        assert (r.model, served_port(r.system_fingerprint)) == (model, port)
        running = [m["model"] for m in proxy.http.get("/running").json()["running"]]
        assert running == [model]


def test_twelve_concurrent_requests_over_three_models(serve):
    sp = free_port()
    proxy = serve(config(sp))
    ports = {"alpha": sp, "beta": sp + 1, "gamma": sp + 3}  # sorted: alpha beta broken gamma

    def ask(i: int) -> tuple[str, str, int]:
        model = ["alpha", "beta", "gamma"][i % 3]
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=60) as h:
            r = h.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
                headers={"X-Fake-Hold": "0.2"})
        body = r.json()
        return model, body["model"], served_port(body["system_fingerprint"])

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(ask, range(12)))
    for asked, answered, port in results:
        assert answered == asked and port == ports[asked]


def test_models_list(serve):
    proxy = serve(config(free_port(), extra="includeAliasesInList: true"))
    proxy.http.post("/api/models/load/alpha")
    data = proxy.http.get("/v1/models").json()["data"]
    ids = [m["id"] for m in data]
    assert "hidden" not in ids
    assert {"alpha", "a", "beta", "beta-short", "gamma"} <= set(ids)
    by_id = {m["id"]: m for m in data}
    assert by_id["alpha"]["status"]["value"] == "loaded"
    assert by_id["beta"]["status"]["value"] == "unloaded"
    assert by_id["alpha"]["meta"]["llamaswap"]["aliases"] == ["a"]
    assert by_id["a"]["meta"]["llamaswap"] == {"type": "alias", "modelID": "alpha"}
    assert by_id["alpha"]["meta"]["gpuproxy"] == {"state": "ready"}
    assert "name" not in by_id["alpha"] and "description" not in by_id["alpha"]
    assert proxy.http.get("/models").json()["data"] == data


CAPABLE = """
    startPort: {start}
    includeAliasesInList: true
    models:
      alpha:
        cmd: {fake}
        name: " Alpha model "
        aliases: [a]
        capabilities:
          in: [text, image]
          out: [text]
          tools: true
          context: 8192
        metadata:
          foo: bar
          context_length: 5
      beta:
        cmd: {fake}
        description: embeds and ranks
        capabilities:
          reranker: true
        metadata:
          context_length: 5
      gamma:
        cmd: {fake}
      speech:
        cmd: {fake}
        capabilities:
          in: [text, audio, image]
          out: [text, audio, image]
"""


def test_models_list_fields_from_capabilities(serve):
    """llama-swap's rendering of `capabilities` (the records below are its binary's answer
    for the same config, but for `owned_by`, `created` and our `meta.gpuproxy`)."""
    proxy = serve(CAPABLE.format(start=free_port(), fake=FAKE))
    data = proxy.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["a", "alpha", "beta", "gamma", "speech"]
    for m in data:
        assert isinstance(m.pop("created"), int)
        assert m["object"] == "model" and m["owned_by"] == "gpuproxy"
        assert m["meta"].pop("gpuproxy") == {"state": "stopped"}
    by_id = {m["id"]: m for m in data}
    assert by_id["alpha"] == {
        "id": "alpha", "object": "model", "owned_by": "gpuproxy", "name": "Alpha model",
        "architecture": {"input_modalities": ["text", "image"], "output_modalities": ["text"],
                         "modality": "text+image->text"},
        "capabilities": {"function_calling": True, "vision": True},
        "supported_parameters": ["tools", "tool_choice"],
        "context_length": 8192,
        "meta": {"llamaswap": {"foo": "bar", "type": "model", "aliases": ["a"]},
                 "n_ctx": 8192},
        "status": {"value": "unloaded"},
    }
    assert by_id["a"]["meta"] == {"llamaswap": {"foo": "bar", "type": "alias",
                                                "modelID": "alpha"}, "n_ctx": 8192}
    assert by_id["a"]["capabilities"] == by_id["alpha"]["capabilities"]
    assert by_id["beta"] == {
        "id": "beta", "object": "model", "owned_by": "gpuproxy",
        "description": "embeds and ranks", "capabilities": {"reranker": True},
        "meta": {"llamaswap": {"type": "model"}}, "status": {"value": "unloaded"},
    }
    # no capabilities: no rendered field, and the metadata as written; no empty name
    assert by_id["gamma"] == {"id": "gamma", "object": "model", "owned_by": "gpuproxy",
                              "meta": {"llamaswap": {"type": "model"}},
                              "status": {"value": "unloaded"}}
    assert by_id["speech"]["capabilities"] == {
        "vision": True, "audio_transcriptions": True, "audio_speech": True,
        "image_generation": True, "image_to_image": True}
    assert by_id["speech"]["architecture"]["modality"] == "text+audio+image->text+audio+image"
    assert "supported_parameters" not in by_id["speech"]


@pytest.mark.parametrize(("kwargs", "status", "code"), [
    ({"content": b"{not json"}, 400, "invalid_json"),
    ({"json": {"messages": []}}, 400, "missing_model"),
    ({"json": {"model": "nope", "messages": []}}, 404, "model_not_found"),
    ({"json": ["a list"]}, 400, "invalid_json"),
])
def test_bad_requests_get_openai_errors(serve, kwargs, status, code):
    proxy = serve(config(free_port()))
    r = proxy.http.post("/v1/chat/completions", **kwargs)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


def test_other_errors(serve):
    proxy = serve(config(free_port()), extra_env={"GPUPROXY_MAX_BODY_MB": "1"})
    big = proxy.http.post("/v1/chat/completions", content=b"x" * (1024 * 1024 + 10))
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    r = proxy.http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = proxy.http.post("/v1/chat/completions", json={"model": "broken", "messages": []})
    assert r.status_code == 502 and r.json()["error"]["code"] == "start_failed"
    assert '"broken" failed to start' in r.json()["error"]["message"]
    # the upstream's own last words are for the operator (the proxy's log), not the client
    assert "simulated start failure" in proxy.http.get("/logs").text
    r = proxy.http.post("/v1/chat/completions", json={"model": "nothere", "messages": []})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert "nothere" in r.json()["error"]["message"]


def test_upstream_passthrough(serve):
    sp = free_port()
    proxy = serve(config(sp))
    r = proxy.http.get("/upstream/alpha")
    assert r.status_code == 301 and r.headers["location"] == "/upstream/alpha/"
    r = proxy.http.get("/upstream/beta/favicon.ico")  # ignorePaths: never loads
    assert r.status_code == 409
    assert proxy.http.get("/running").json()["running"] == []
    r = proxy.http.get("/upstream/alpha/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "alpha"
    assert r.headers["x-fake-served-by"] == f"alpha:{sp}"
    r = proxy.http.get("/upstream/nope/x")
    assert r.status_code == 404


def test_api_keys_on_the_proxy(serve):
    proxy = serve(config(free_port(), extra="apiKeys: [k-alice]"))
    with pytest.raises(openai.AuthenticationError):
        client(proxy, "wrong").models.list()
    r = proxy.http.get("/v1/models")
    assert r.status_code == 401 and "www-authenticate" in r.headers
    assert [m.id for m in client(proxy, "k-alice").models.list()][:1] == ["alpha"]
    basic = proxy.http.get("/v1/models", auth=("anyone", "k-alice"))
    assert basic.status_code == 200
    ok = proxy.http.get("/v1/models", headers={"x-api-key": "k-alice"})
    assert ok.status_code == 200
