"""The exposure policy (docs/security.md, "Exposure policy") on a real `gpuproxy serve`, over
real HTTP with the Host, Origin and Sec-Fetch-Site headers a browser sends.

Three rules, each checked from the outside: a Host allow-list (against DNS rebinding), the
Origin checked on every state-changing or sensitive request (a text/plain POST skips the
preflight), and CORS: /v1/* permissive as in llama-swap, the management paths same-origin
unless listed. And who may do what: admin keys, other keys, no keys.
"""

from __future__ import annotations

import hashlib
import socket

import httpx
import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_KEY = "sk-ops-5b1e9d"
USER_KEY = "sk-user-77a0c3"
EVIL = "https://evil.example"
UI = "https://ui.example"
CHAT = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def no_keys(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
    """


def keyed(start: int) -> str:
    """A plain `apiKeys` entry (not admin) and an admin key given by its hash."""
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    return no_keys(start) + f"""
    apiKeys: ["{USER_KEY}"]
    apiKeyHashes:
      - {{name: ops, sha256: "{digest}", admin: true}}
    """


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def own(proxy) -> str:
    return proxy.base  # http://127.0.0.1:PORT: the origin of a page this proxy served


def host_port(proxy) -> str:
    return proxy.base.removeprefix("http://")


def envelope(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def loaded(proxy, headers: dict[str, str] | None = None) -> set[str]:
    return {m["model"] for m in proxy.http.get("/running", headers=headers).json()["running"]
            if m["state"] == "ready"}


# ---- the Host allow-list ---------------------------------------------------------------------

REBOUND = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/running"),
           ("GET", "/api/queue"), ("GET", "/logs"), ("GET", "/health"), ("GET", "/admin/login/"),
           ("GET", "/upstream/solo/health"), ("GET", "/metrics")]


def test_a_rebound_host_name_is_refused_on_every_kind_of_path(serve):
    """DNS rebinding: a page on attacker.example whose name now resolves to this machine
    sends `Host: attacker.example`; no answer, Django's or the proxy's, reaches it."""
    proxy = serve(no_keys(free_port()))
    port = host_port(proxy).rsplit(":", 1)[1]
    for method, path in REBOUND:
        r = proxy.http.request(method, path, json=CHAT,
                               headers={"Host": f"attacker.example:{port}"})
        error = envelope(r, 400, "host_not_allowed")
        assert "GPUPROXY_ALLOWED_HOSTS" in error["message"], error
    # the WebSocket handshake too (it needs a staff session as well, checked after this)
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
        s.sendall(b"GET /ws/dashboard HTTP/1.1\r\nHost: attacker.example\r\n"
                  b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        answer = s.recv(4096)
    assert not answer.startswith(b"HTTP/1.1 101"), answer
    assert loaded(proxy) == set()  # the POST above started nothing


def test_local_names_addresses_and_listed_hosts_are_answered(serve):
    proxy = serve(no_keys(free_port()),
                  {"GPUPROXY_ALLOWED_HOSTS": "gpu.example.com, .corp.example"})
    port = host_port(proxy).rsplit(":", 1)[1]
    hosts = [f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "10.11.12.13",
             f"[fd00::7]:{port}", socket.gethostname(), f"{socket.gethostname()}:{port}",
             "gpu.example.com", "a.b.corp.example:443", "LOCALHOST.", "app.localhost"]
    for host in hosts:
        for path in ("/v1/models", "/running"):  # the proxy's consumer, and Django
            r = proxy.http.get(path, headers={"Host": host})
            assert r.status_code == 200, (host, path, r.text)
    for host in ("gpu.example.com.evil.example", "corp.example.evil", "example.com"):
        envelope(proxy.http.get("/running", headers={"Host": host}), 400, "host_not_allowed")


def test_a_star_answers_every_host(serve):
    proxy = serve(no_keys(free_port()), {"GPUPROXY_ALLOWED_HOSTS": "*"})
    assert proxy.http.get("/running", headers={"Host": "anything.example"}).status_code == 200
    assert proxy.http.get("/v1/models", headers={"Host": "anything.example"}).status_code == 200


# ---- the Origin, without keys (a local box) -------------------------------------------------

def test_a_foreign_page_cannot_unload_with_a_simple_request(serve):
    """A form or `fetch(..., {mode: "no-cors"})` with text/plain needs no preflight; the
    server refuses it itself. An <img src=/unload> sends no Origin, but Sec-Fetch-Site."""
    proxy = serve(no_keys(free_port()))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    text = {"Content-Type": "text/plain"}
    envelope(proxy.http.post("/api/models/unload", headers={**text, "Origin": EVIL},
                             content=b"x"), 403, "origin_not_allowed")
    envelope(proxy.http.post("/api/models/unload/solo", headers={"Origin": "null"}),
             403, "origin_not_allowed")
    envelope(proxy.http.get("/unload", headers={"Sec-Fetch-Site": "cross-site"}),
             403, "origin_not_allowed")
    envelope(proxy.http.get("/unload", headers={"Sec-Fetch-Site": "same-site"}),
             403, "origin_not_allowed")
    envelope(proxy.http.post("/api/models/load/solo", headers={"Origin": EVIL}),
             403, "origin_not_allowed")
    assert loaded(proxy) == {"solo"}
    # this proxy's own pages may, and so may programs (no Origin)
    r = proxy.http.post("/api/models/unload", headers={**text, "Origin": own(proxy)})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == own(proxy)
    until("solo unloaded", lambda: loaded(proxy) == set())
    assert proxy.http.get("/unload", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200


def test_sensitive_reads_refuse_a_foreign_origin(serve):
    proxy = serve(no_keys(free_port()))
    for path in ("/running", "/logs", "/api/queue", "/api/activity", "/metrics",
                 "/upstream/solo/health"):
        envelope(proxy.http.get(path, headers={"Origin": EVIL}), 403, "origin_not_allowed")
        envelope(proxy.http.get(path, headers={"Sec-Fetch-Site": "cross-site"}), 403,
                 "origin_not_allowed")
        assert proxy.http.get(path, headers={"Origin": own(proxy)}).status_code == 200, path
        assert proxy.http.get(path).status_code == 200, path
    # no keys: /running shows each model's command, as llama-swap does
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    (record,) = proxy.http.get("/running").json()["running"]
    assert "gpuproxy.testing.fakellm" in record["cmd"]


def test_without_keys_inference_answers_its_own_and_listed_origins_only(serve):
    proxy = serve(no_keys(free_port()), {"GPUPROXY_CORS_ORIGINS": f"{UI}, http://localhost:3000"})
    text = {"Content-Type": "text/plain"}
    import json
    body = json.dumps(CHAT).encode()
    error = envelope(proxy.http.post("/v1/chat/completions", headers={**text, "Origin": EVIL},
                                     content=body), 403, "origin_not_allowed")
    assert "GPUPROXY_CORS_ORIGINS" in error["message"] and "API key" in error["message"]
    assert loaded(proxy) == set()  # refused before it reached the scheduler
    preflight = proxy.http.options("/v1/chat/completions", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST"})
    envelope(preflight, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in preflight.headers

    for origin in (UI, "http://localhost:3000", own(proxy)):
        r = proxy.http.post("/v1/chat/completions", headers={**text, "Origin": origin},
                            content=body)
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "origin" in r.headers["vary"].lower()
        assert "access-control-allow-credentials" not in r.headers
    ok = proxy.http.options("/v1/chat/completions", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, x-llamaswap-priority"})
    assert ok.status_code == 204, ok.text
    assert ok.headers["access-control-allow-origin"] == UI
    assert ok.headers["access-control-allow-headers"] == "content-type, x-llamaswap-priority"

    # a listed origin may use the management paths too (CORS for its scripts)
    r = proxy.http.get("/running", headers={"Origin": UI})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    pre = proxy.http.options("/api/models/unload", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == UI
    envelope(proxy.http.options("/api/models/unload", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST"}), 403, "origin_not_allowed")


# ---- with keys: CORS like llama-swap on /v1/*, admin keys for the rest ------------------------

def test_with_keys_v1_answers_any_origin_like_llama_swap(serve):
    proxy = serve(keyed(free_port()))
    # the preflight carries no key: it is answered before the key check, as llama-swap does
    pre = proxy.http.options("/v1/chat/completions", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization, Content-Type, X-LlamaSwap-Priority"})
    assert pre.status_code == 204, pre.text
    assert pre.headers["access-control-allow-origin"] == "*"
    assert pre.headers["access-control-allow-methods"] == "GET, POST, PUT, PATCH, DELETE, OPTIONS"
    assert pre.headers["access-control-allow-headers"] == (
        "Authorization, Content-Type, X-LlamaSwap-Priority")
    assert pre.headers["access-control-max-age"] == "86400"
    bare = proxy.http.options("/v1/models")  # any OPTIONS, even without an Origin
    assert bare.status_code == 204
    assert bare.headers["access-control-allow-headers"] == (
        "Content-Type, Authorization, Accept, X-Requested-With")

    r = proxy.http.post("/v1/chat/completions", json=CHAT,
                        headers={**bearer(USER_KEY), "Origin": EVIL})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == EVIL
    # a wrong key's 401 is readable by the page (with a body: answered by the edge)
    for extra in ({"json": CHAT}, {}):
        no = proxy.http.post("/v1/chat/completions", headers={"Origin": EVIL}, **extra)
        envelope(no, 401, "invalid_api_key")
        assert no.headers["access-control-allow-origin"] == EVIL
    # the management paths stay same-origin, whatever the key
    envelope(proxy.http.get("/running", headers={**bearer(ADMIN_KEY), "Origin": EVIL}), 403,
             "origin_not_allowed")
    envelope(proxy.http.options("/api/models/unload", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST"}), 403, "origin_not_allowed")


ADMIN_ONLY = [("POST", "/api/models/load/solo"), ("POST", "/api/models/unload"),
              ("POST", "/api/models/unload/solo"), ("GET", "/unload"), ("GET", "/api/queue"),
              ("GET", "/api/activity"), ("GET", "/api/activity/stats"), ("GET", "/logs"),
              ("GET", "/logs/stream/solo?no-history"), ("GET", "/upstream/solo/health")]


def test_other_keys_get_inference_and_admin_keys_the_rest(serve):
    proxy = serve(keyed(free_port()))
    user, admin = bearer(USER_KEY), bearer(ADMIN_KEY)
    assert proxy.http.post("/v1/chat/completions", json=CHAT, headers=user).status_code == 200
    assert proxy.http.get("/v1/models", headers=user).status_code == 200
    assert proxy.http.get("/metrics", headers=user).status_code == 200
    (record,) = proxy.http.get("/running", headers=user).json()["running"]
    assert record["model"] == "solo" and "cmd" not in record, record
    (full,) = proxy.http.get("/running", headers=admin).json()["running"]
    assert "gpuproxy.testing.fakellm" in full["cmd"]
    for method, path in ADMIN_ONLY:
        error = envelope(proxy.http.request(method, path, headers=user), 403,
                         "admin_key_required")
        assert error["type"] == "permission_error" and "admin" in error["message"], error
    assert loaded(proxy, user) == {"solo"}  # none of them unloaded it
    for method, path in ADMIN_ONLY:
        if path.startswith("/logs/stream"):
            with proxy.http.stream(method, path, headers=admin) as r:
                assert r.status_code == 200
            continue
        r = proxy.http.request(method, path, headers=admin)
        assert r.status_code == 200, (path, r.text)


def test_an_ordinary_key_is_refused_before_the_body_on_admin_paths(serve):
    """The edge answers on the head: an ordinary key holder never uploads to a management
    path (the 401 for no key is tests/test_edge.py's)."""
    proxy = serve(keyed(free_port()))
    port = int(host_port(proxy).rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /api/models/load/solo HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {USER_KEY}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 1000000\r\n\r\n".encode())
        s.settimeout(10)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert b'"admin_key_required"' in answer, answer
