"""The exposure policy's rules one by one (gpuproxy/proxy/exposure.py), as plain functions: which
Host is answered, which Origin may do what on which path, and the CORS headers. The wiring
(Django's paths, the consumer's, the WebSocket, the edge) is tests/test_exposure.py's, on a
real `gpuproxy serve`; expected values here are written by hand from docs/security.md."""

from __future__ import annotations

import socket

import pytest
from django.test import override_settings

from gpuproxy.proxy import exposure
from gpuproxy.proxy.exposure import Request, decide, host_refusal, normalize_origin, path_class


@pytest.mark.parametrize("host", [
    "127.0.0.1", "127.0.0.1:8080", "10.1.2.3:80", "[::1]", "[::1]:8080", "[fd00::7]:1",
    "localhost", "LOCALHOST:8080", "localhost.", "a.localhost", socket.gethostname(),
    socket.gethostname().upper() + ":9",
])
def test_addresses_and_local_names_are_answered(host):
    assert host_refusal(host) is None


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil",
                                  "127.0.0.1.nip.io", "0x7f.example"])
def test_other_names_are_refused(host):
    refused = host_refusal(host)
    assert refused is not None and refused[0] == "host_not_allowed"


@pytest.mark.parametrize("host", ["bad host!", "[::1", "a b", "x:y:z"])
def test_a_malformed_host_is_a_bad_request(host):
    refused = host_refusal(host)
    assert refused is not None and refused[0] == "bad_request"


def test_listed_names_domains_and_star():
    with override_settings(GPUPROXY_ALLOWED_HOSTS=["gpu.example.com", ".corp.example"]):
        assert host_refusal("gpu.example.com:8080") is None
        assert host_refusal("corp.example") is None and host_refusal("a.b.corp.example") is None
        assert host_refusal("gpu.example.com.evil") is not None
        assert host_refusal("example.com") is not None
    with override_settings(GPUPROXY_ALLOWED_HOSTS=["*"]):
        assert host_refusal("anything.example") is None


def test_the_listen_name_is_answered():
    assert host_refusal("gpubox-listen.lan") is not None
    exposure.add_listen_host("GPUBOX-LISTEN.lan")
    try:
        assert host_refusal("gpubox-listen.lan:8080") is None
    finally:
        exposure._listen_names.discard("gpubox-listen.lan")


def test_the_advertised_name_is_answered():
    # another node forwards with Host: the name in this node's GPUPROXY_ADVERTISE
    # (docs/fleet.md, "Forwarding between nodes")
    assert host_refusal("gpu-b.lan:8080") is not None
    with override_settings(GPUPROXY_ADVERTISE="http://GPU-B.lan:8080"):
        assert host_refusal("gpu-b.lan:8080") is None
        assert host_refusal("gpu-c.lan:8080") is not None
    assert host_refusal("gpu-b.lan:8080") is not None


@pytest.mark.parametrize(("value", "expected"), [
    ("http://LOCALHOST:80", "http://localhost"), ("https://a.example:443", "https://a.example"),
    ("http://[::1]:8080", "http://[::1]:8080"), ("https://a.example:8443", "https://a.example:8443"),
    ("null", None), ("file://", None), ("http://", None), ("http://x:99999", None),
    ("http://a.example/path", None), ("ws://a.example", None),
])
def test_origins_are_compared_normalised(value, expected):
    assert normalize_origin(value) == expected


@pytest.mark.parametrize(("path", "klass"), [
    ("/v1/chat/completions", "inference"), ("/v1/anything", "inference"),
    ("/completion", "inference"), ("/models", "inference"), ("/v/chat/completions", "inference"),
    ("/running", "management"), ("/logs", "management"), ("/logs/stream/x", "management"),
    ("/api/models/unload", "management"), ("/api/activity", "management"),
    ("/upstream/m/health", "management"), ("/unload", "management"), ("/metrics", "management"),
    ("/health", "other"), ("/admin/", "other"), ("/", "other"), ("/static/x.css", "other"),
])
def test_path_classes(path, klass):
    assert path_class(path) == klass


OWN = "http://127.0.0.1:8080"
HOST = "127.0.0.1:8080"


def req(method: str, path: str, origin: str | None = None, site: str | None = None,
        acrh: str | None = None) -> Request:
    return Request(method, path, "http", HOST, origin, site, acrh)


@pytest.mark.parametrize(("method", "path", "origin", "site", "keys", "status"), [
    # management: own origin and programs only, any method
    ("GET", "/running", "https://evil.example", None, True, 403),
    ("GET", "/running", OWN, None, False, 0),
    ("GET", "/running", None, None, False, 0),
    ("GET", "/running", None, "cross-site", False, 403),
    ("GET", "/unload", None, "same-site", False, 403),
    ("GET", "/unload", None, "same-origin", False, 0),
    ("GET", "/unload", None, "none", False, 0),
    ("POST", "/api/models/unload", "null", None, False, 403),
    ("POST", "/api/models/unload", "http://127.0.0.1:9999", None, False, 403),
    ("POST", "/api/models/unload", "https://127.0.0.1:8080", None, False, 403),
    # inference: any origin once keys exist, else own only
    ("POST", "/v1/chat/completions", "https://evil.example", None, True, 0),
    ("POST", "/v1/chat/completions", "https://evil.example", None, False, 403),
    ("POST", "/v1/chat/completions", OWN, None, False, 0),
    ("POST", "/v1/chat/completions", None, None, False, 0),
    ("GET", "/v1/models", "https://evil.example", None, False, 403),
    # a page served from this machine is a local program: inference, not management
    ("POST", "/v1/chat/completions", "http://localhost:3000", None, False, 0),
    ("POST", "/v1/chat/completions", "http://127.0.0.2:3000", None, False, 0),
    ("POST", "/v1/chat/completions", "http://[::1]:3000", None, False, 0),
    ("POST", "/v1/chat/completions", "http://ui.localhost", None, False, 0),
    ("POST", "/v1/chat/completions", "http://localhost.evil.example", None, False, 403),
    ("POST", "/v1/chat/completions", "http://10.0.0.5:3000", None, False, 403),
    ("POST", "/api/models/unload", "http://localhost:3000", None, False, 403),
    # a foreign <img> on an inference path loads a model: refused while no key is defined
    ("GET", "/v1/audio/voices", None, "cross-site", False, 403),
    ("GET", "/v/audio/voices", None, "same-site", False, 403),
    ("GET", "/v1/models", None, "cross-site", True, 0),
    ("GET", "/v1/models", None, "same-origin", False, 0),
    # elsewhere: state-changing requests only
    ("POST", "/admin/login/", "https://evil.example", None, True, 403),
    ("POST", "/health", None, "cross-site", True, 403),
    ("GET", "/admin/", "https://evil.example", None, True, 0),
    ("GET", "/admin/", None, "cross-site", True, 0),
])
def test_the_origin_rule(method, path, origin, site, keys, status):
    verdict = decide(req(method, path, origin, site), keys)
    assert verdict.status == status, verdict
    if status:
        assert verdict.code == "origin_not_allowed"


def test_listed_origins_and_star():
    with override_settings(GPUPROXY_CORS_ORIGINS=["https://UI.example:443"]):
        ok = decide(req("POST", "/api/models/unload", "https://ui.example"), False)
        assert ok.status == 0
        assert dict(ok.headers) == {b"access-control-allow-origin": b"https://ui.example",
                                    b"vary": b"Origin"}
        assert decide(req("POST", "/v1/embeddings", "https://ui.example"), False).status == 0
        assert decide(req("POST", "/v1/embeddings", "https://other.example"), False).status
    with override_settings(GPUPROXY_CORS_ORIGINS=["*"]):
        assert decide(req("GET", "/logs", "https://any.example"), False).status == 0
        pre = decide(req("OPTIONS", "/logs", "https://any.example"), False)
        assert dict(pre.headers)[b"access-control-allow-origin"] == b"*"


def test_preflights_are_llama_swaps():
    pre = decide(req("OPTIONS", "/v1/chat/completions", "https://a.example",
                     acrh="Authorization, X-LlamaSwap-Priority, bad(one), , x-ok"), True)
    assert pre.preflight and pre.status == 0
    assert dict(pre.headers) == {
        b"access-control-allow-origin": b"*",
        b"access-control-allow-methods": b"GET, POST, PUT, PATCH, DELETE, OPTIONS",
        b"access-control-allow-headers": b"Authorization, X-LlamaSwap-Priority, x-ok",
        b"access-control-max-age": b"86400"}
    bare = decide(req("OPTIONS", "/completion"), False)
    assert bare.preflight
    assert dict(bare.headers)[b"access-control-allow-headers"] == (
        b"Content-Type, Authorization, Accept, X-Requested-With")
    # without keys the allowed origin is named, not `*`
    own = decide(req("OPTIONS", "/v1/models", OWN), False)
    assert dict(own.headers)[b"access-control-allow-origin"] == OWN.encode()
    assert dict(own.headers)[b"vary"] == b"Origin"
    # elsewhere OPTIONS is the application's (Django's /health answers it)
    assert decide(req("OPTIONS", "/health", "https://a.example"), True) == exposure.GO


def test_no_credentials_are_ever_allowed():
    for verdict in (decide(req("POST", "/v1/chat/completions", "https://a.example"), True),
                    decide(req("OPTIONS", "/v1/chat/completions", "https://a.example"), True),
                    decide(req("GET", "/running", OWN), False)):
        assert b"access-control-allow-credentials" not in dict(verdict.headers)


@pytest.mark.parametrize(("origin", "site", "status"), [
    ("https://evil.example", None, 403),
    ("http://localhost:3000", None, 403),  # a local page: not with the browser's password
    (None, "cross-site", 403),
    (OWN, None, 0),
    (None, "same-origin", 0),
    (None, None, 0),  # a program (curl -u)
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/unload", "/logs/stream"])
def test_a_saved_basic_password_counts_only_from_this_proxys_pages(origin, site, status, path):
    """We answer 401 with a Basic challenge, so a browser may have saved the key as a password
    and sends it with any page's request, even where /v1/* is open to every origin."""
    headers = [(b"host", HOST.encode()), (b"authorization", b"Basic OnNrLWtleQ==")]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if site is not None:
        headers.append((b"sec-fetch-site", site.encode()))
    method = "POST" if path.startswith("/v1/") else "GET"
    request = exposure.request_from_headers(method, path, "http", headers)
    assert request.basic
    verdict = decide(request, True)
    assert verdict.status == status, verdict
    if status:
        assert "Bearer" in verdict.message
    bearer = exposure.request_from_headers(method, path, "http", [
        (b"authorization", b"Bearer sk-key"), *headers[:1], *headers[2:]])
    assert not bearer.basic
