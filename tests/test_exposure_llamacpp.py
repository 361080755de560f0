"""CORS in front of a real llama.cpp server, which sets its own: `Access-Control-Allow-Origin`
echoing the request's Origin on every answer (empty when there is none), and on OPTIONS
`Access-Control-Allow-Credentials: true` with `Access-Control-Allow-Headers: *`. The client
sees gpuproxy's CORS headers only, once (docs/security.md, "Exposure policy")."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.test_llamacpp import LLAMA_SERVER, tiny_models  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-cors-31f0"
PAGE = "https://chat.example"


@pytest.fixture
def proxy(serve, tiny_models):  # noqa: F811
    import hashlib

    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 30
    apiKeyHashes:
      - {{name: ops, sha256: "{digest}", admin: true}}
    models:
      tiny:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {tiny_models["a"]} -c 512
        proxy: http://127.0.0.1:${{PORT}}
    """)


def chat(proxy, path: str, headers: dict[str, str]):
    return proxy.http.post(path, headers={"Authorization": f"Bearer {KEY}", **headers}, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def test_the_upstreams_cors_headers_never_reach_the_client(proxy):
    r = chat(proxy, "/v1/chat/completions", {"Origin": PAGE})
    assert r.status_code == 200, r.text
    assert r.headers.get_list("access-control-allow-origin") == [PAGE]
    assert "access-control-allow-credentials" not in r.headers
    # without an Origin llama.cpp still sends an empty Access-Control-Allow-Origin
    r = chat(proxy, "/v1/chat/completions", {})
    assert r.status_code == 200, r.text
    assert not any(k.lower().startswith("access-control-") for k in r.headers), r.headers
    # the passthrough: llama.cpp's own preflight (credentials allowed, for any origin) is
    # never what a page gets; /upstream/* is same-origin unless listed
    pre = proxy.http.options("/upstream/tiny/v1/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403, pre.text
    assert "access-control-allow-credentials" not in pre.headers
    r = chat(proxy, "/upstream/tiny/v1/chat/completions", {})
    assert r.status_code == 200, r.text
    assert not any(k.lower().startswith("access-control-") for k in r.headers), r.headers
