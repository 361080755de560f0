"""Fuzz every endpoint through the real ASGI application: no 500, no hang, OpenAI errors.

Hypothesis throws malformed bodies (random bytes, random JSON with NaN/Infinity and huge
numbers, deep nesting, wrong types for `model`/`stream`/`messages`/`max_tokens`, forms with
broken boundaries), random methods, header values, query strings and path segments at every
endpoint, in-process (channels' `ApplicationCommunicator` against `gpuproxy.asgi.application`,
the same scope Daphne builds), with a real fake upstream behind one known model. For every
response: the status is below 600 and not 500; it comes within `TIMEOUT` seconds (a hang
fails); and every 4xx/5xx from gpuproxy itself is `{"error": {"message", "type", "param",
"code"}}`. Responses relayed from an upstream are the upstream's business and only checked for
the status. Streams (`/logs/stream`, SSE) are read to their first chunk, then left.

The request-size, header-size and JSON-nesting limits each get a test of their own at the end;
the header limit is Twisted's (checked against a real `gpuproxy serve`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlencode

import pytest
from channels.testing import ApplicationCommunicator
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from gpuproxy.asgi import application
from gpuproxy.proxy.inference import FORM_PATHS, INFERENCE_PATHS, MAX_JSON_DEPTH, too_deep
from gpuproxy.shell import runtime
from scheduling.importer import import_config
from scheduling.llamaswap import parse_config
from tests.conftest import FAKE, free_port

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 10.0  # seconds for a whole exchange; longer is a hang
KNOWN = "alpha"  # the one model with an upstream behind it
KEY = "sk-fuzz-key"
# Examples per fuzz test (about 3 s each at 800); FUZZ_EXAMPLES=5000 for a longer hunt.
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "800")), deadline=None,
                database=None, suppress_health_check=[
                    HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                    HealthCheck.data_too_large])


def config(start: int, extra: str = "") -> str:
    return f"""
startPort: {start}
healthCheckTimeout: 15
{extra}
models:
  {KNOWN}:
    cmd: {FAKE}
    aliases: [al]
"""


async def _runtime(extra: str = ""):
    parsed = parse_config(config(free_port(), extra), {})
    await runtime.run_db(lambda: import_config(parsed))
    return await runtime.get()


@pytest.fixture
async def rt():
    yield await _runtime()
    await runtime.shutdown()


@pytest.fixture
async def rt_keyed():
    yield await _runtime(f"apiKeys: [{KEY}]")
    await runtime.shutdown()


# ---- one exchange ---------------------------------------------------------------------------

@dataclass
class Response:
    method: str
    path: str
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool  # the whole body was read (not a stream left after its first chunk)
    sent: dict = field(default_factory=dict)

    def json(self):
        return json.loads(self.body)


def _scope(method: str, raw_path: str, query: bytes, headers: list[tuple[bytes, bytes]]
           ) -> dict:
    """What Daphne hands the application: `path` is the percent-decoded raw path."""
    return {
        "type": "http", "http_version": "1.1", "method": method, "path": unquote(raw_path),
        "raw_path": raw_path.encode("ascii"), "query_string": query, "root_path": "",
        "scheme": "http", "headers": headers, "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }


class AppCrashed(AssertionError):
    """The application raised instead of answering: Daphne answers such a request with its
    own HTML 500 page."""


async def receive(comm: ApplicationCommunicator) -> dict:
    """The application's next message; AppCrashed as soon as it raises instead."""
    if not comm.output_queue.empty():
        return comm.output_queue.get_nowait()
    get = asyncio.ensure_future(comm.output_queue.get())
    await asyncio.wait({get, comm.future}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    if not comm.output_queue.empty():
        return comm.output_queue.get_nowait()
    exc = None if comm.future.cancelled() else comm.future.exception()
    raise AppCrashed(f"the application ended without answering: {exc!r}") from exc


async def call(method: str, raw_path: str, *, query: bytes = b"",
               headers: list[tuple[bytes, bytes]] | None = None, body: bytes = b"",
               chunks: int = 1) -> Response:
    """One request through the real ASGI app; fails the test if it takes over TIMEOUT."""
    comm = ApplicationCommunicator(application, _scope(method, raw_path, query, headers or []))
    started = time.monotonic()
    try:
        async with asyncio.timeout(TIMEOUT):
            step = max(1, -(-len(body) // chunks)) if body else 1
            pieces = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
            for i, piece in enumerate(pieces):
                await comm.send_input({"type": "http.request", "body": piece,
                                       "more_body": i < len(pieces) - 1})
            start = await receive(comm)
            assert start["type"] == "http.response.start", start
            status = start["status"]
            resp_headers = {k.lower(): v for k, v in start.get("headers", [])}
            out = bytearray()  # a big answer comes in many pieces: no quadratic `+=`
            complete = False
            streaming = resp_headers.get(b"content-type", b"").startswith(
                b"text/event-stream") or unquote(raw_path).startswith("/logs/stream")
            while True:
                msg = await receive(comm)
                assert msg["type"] == "http.response.body", msg
                out += msg.get("body", b"")
                if not msg.get("more_body"):
                    complete = True
                    break
                if streaming:
                    break  # a live stream (its first chunk may be empty): enough
            await comm.send_input({"type": "http.disconnect"})
            await comm.wait(TIMEOUT)
    except AppCrashed as exc:
        pytest.fail(f"{exc} (Daphne: 500): {method} {raw_path}?{query!r} headers={headers!r} "
                    f"body={body[:300]!r}")
    except TimeoutError:
        pytest.fail(f"hang: {method} {raw_path}?{query!r} headers={headers!r} "
                    f"body={body[:300]!r}... got nothing whole within "
                    f"{time.monotonic() - started:.1f} s")
    return Response(method, raw_path, status, resp_headers, bytes(out), complete,
                    {"query": query, "headers": headers, "body": body[:500]})


def _is_envelope(doc) -> bool:
    if not isinstance(doc, dict) or set(doc) != {"error"}:
        return False
    err = doc["error"]
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and isinstance(err["type"], str)
            and (err["param"] is None or isinstance(err["param"], str))
            and (err["code"] is None or isinstance(err["code"], str)))


# Anthropic's paths answer Anthropic's shape, which its SDK reads (docs.anthropic.com, "Errors").
ANTHROPIC_PATHS = {"/v1/messages", "/v1/messages/count_tokens", "/v/messages",
                   "/v/messages/count_tokens"}


def _is_anthropic_envelope(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"type", "error"} and doc["type"] == "error"
            and isinstance(doc["error"], dict) and set(doc["error"]) == {"type", "message"}
            and all(isinstance(v, str) for v in doc["error"].values()))


# Django's own 400s (a malformed Host header, too many query fields, ...) come from
# `handler400`, which the root urlconf must name; without it they are Django's HTML page.
BROWSER_PAGES = ("/admin", "/accounts")  # and "/" itself: the dashboard, HTML by design


def _browser_page(path: str) -> bool:
    p = unquote(path)
    return p == "/" or p.startswith(BROWSER_PAGES)


def check(resp: Response, *, relayed_ok: bool = False) -> None:
    """No 500, a real status, and gpuproxy's own errors in the OpenAI envelope.

    `relayed_ok`: the request may have reached the upstream, whose own error bodies are
    relayed as they are (the fake's carry an extra `model` key and an integer `code`)."""
    with contextlib.suppress(InvalidArgument):  # outside a Hypothesis test
        code = ""
        if resp.status >= 400 and resp.body.startswith(b"{"):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                code = resp.json()["error"].get("code")
        event(f"status {resp.status} {code}".rstrip())
    where = f"{resp.method} {resp.path} -> {resp.status}: {resp.body[:400]!r}; sent {resp.sent!r}"
    assert resp.status != 500, where
    assert 100 <= resp.status < 600, where
    if resp.status < 400 or not resp.complete or (resp.method == "HEAD" and not resp.body):
        return
    ctype = resp.headers.get(b"content-type", b"")
    if _browser_page(resp.path):
        return
    assert ctype.startswith(b"application/json"), where
    doc = resp.json()
    if relayed_ok and isinstance(doc, dict) and "model" in doc:
        return  # the fake upstream's own error, relayed
    if unquote(resp.path).split("?")[0] in ANTHROPIC_PATHS:
        assert _is_anthropic_envelope(doc), where
        return
    assert _is_envelope(doc), where


# ---- strategies -----------------------------------------------------------------------------

METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
TEXT = st.text(st.characters(codec="utf-8"), max_size=24)
# What Twisted lets through in a header value is any byte but NUL, CR and LF; mostly
# printable here, so that most requests get past the header check.
_PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                   exclude_characters="\x7f"), max_size=40)
LATIN1 = st.one_of(_PRINTABLE, _PRINTABLE, _PRINTABLE, st.text(st.characters(
    min_codepoint=0x01, max_codepoint=0xFF, exclude_characters="\r\n"), max_size=40))
ODD_NAMES = ["", " ", "../alpha", "alpha/..", "alpha/../alpha", "alpha%2Fx", "alpha\x00",
             "ALPHA", "alpha ", "ünïcødé-模型", "🙂", "a" * 300, "x" * 20_000, "al", "..", "/"]


@st.composite
def model_names(draw) -> str:
    """Mostly unknown (nothing to load), sometimes the known model or its alias."""
    pick = draw(st.integers(0, 9))
    if pick == 0:
        return draw(st.sampled_from([KNOWN, "al"]))
    if pick < 4:
        return draw(st.sampled_from(ODD_NAMES))
    return draw(TEXT)


SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-10**40, 10**40)
           | st.floats() | TEXT)
JSON_VALUES = st.recursive(
    SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4),
    max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | JSON_VALUES,
     "content": TEXT | JSON_VALUES}), max_size=3)


@st.composite
def request_documents(draw, reaches_upstream: bool = False) -> dict:
    """An inference body with the usual fields present or not, of the right type or not.
    `reaches_upstream`: sent to the known model whatever its `model` (a passthrough)."""
    doc: dict = {}
    if draw(st.integers(0, 5)):
        doc["model"] = draw(model_names()) if draw(st.integers(0, 4)) else draw(JSON_VALUES)
    optional = {
        "stream": st.booleans() | JSON_VALUES,
        "messages": MESSAGES | JSON_VALUES,
        "max_tokens": st.integers(-5, 10**30) | JSON_VALUES,
        "prompt": TEXT | JSON_VALUES,
        "input": TEXT | JSON_VALUES,
        "query": TEXT,
        "documents": st.lists(TEXT, max_size=3) | JSON_VALUES,
        "service_tier": st.sampled_from(["priority", "flex", "default", "auto"]) | JSON_VALUES,
        "temperature": st.floats() | JSON_VALUES,
        "priority": JSON_VALUES,
    }
    for key, strat in optional.items():
        if draw(st.booleans()):
            doc[key] = draw(strat)
    doc.update(draw(st.dictionaries(TEXT, JSON_VALUES, max_size=2)))
    if reaches_upstream or doc.get("model") in (KNOWN, "al"):
        # A real upstream answers: keep its work short (huge max_tokens is its business:
        # 6 million tokens took the fake over TIMEOUT, a "hang" that was only its work).
        doc["max_tokens"] = draw(st.integers(0, 4))
        for key in ("max_completion_tokens", "n_predict", "fake_hold"):
            doc.pop(key, None)
    return doc


def _nested(depth: int, kind: str) -> bytes:
    if kind == "open":
        return b"[" * depth
    if kind == "array":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return (b'{"model":"' + KNOWN.encode() + b'","max_tokens":1,"messages":'
            + b"[" * depth + b"]" * depth + b"}")


DEEP = st.builds(_nested, st.sampled_from([2, 100, 511, 512, 513, 1000, 5000, 100_000]),
                 st.sampled_from(["open", "array", "object", "in_body"]))
LITERALS = st.sampled_from([
    b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # over int()'s digit limit
    b'{"model": "x", "n": 1e999999}', b'{"model": NaN}', b'{"model": "x", "t": -Infinity}',
    b"NaN", b"Infinity", b"1e999999", b"9" * 5000, b"-" + b"9" * 100,
    b'\xef\xbb\xbf{"model": "x"}', '{"model": "x"}'.encode("utf-16"),
    '{"model": "x"}'.encode("utf-32"), b'{"model": "\\ud800"}', b'{"model": "\\u0000"}',
    b'{"model": "x", "model": "alpha", "max_tokens": 1}', b'{"model": "x"', b"{}", b"[]",
    b"null", b'"alpha"', b"\x00" * 10, b"\xff\xfe\xfd", b'{"model": {"$gt": ""}}',
    b'{"model": ["alpha"]}', b'{"model": "alpha", "stream": "yes", "max_tokens": 1}',
])


@st.composite
def forms(draw) -> tuple[bytes, bytes]:
    """(content type, body) for form bodies, well-formed or not."""
    kind = draw(st.sampled_from(["urlencoded", "multipart"]))
    model = draw(model_names())
    if kind == "urlencoded":
        pairs = [*draw(st.lists(st.tuples(TEXT, TEXT), max_size=3)), ("model", model)]
        return b"application/x-www-form-urlencoded", urlencode(pairs).encode()
    boundary = draw(st.sampled_from(["xyz", "----b", "", '"quoted"', "a;b", " ", "x" * 200]))
    ctype = draw(st.sampled_from([
        f"multipart/form-data; boundary={boundary}", "multipart/form-data",
        "multipart/form-data; boundary=", 'multipart/form-data; boundary="',
        "multipart/form-data;boundary", f"multipart/form-data; charset=x; boundary={boundary}",
    ]))
    b = boundary.strip('"').encode()
    parts = [b"--" + b + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
             + model.encode("utf-8", "surrogatepass") + b"\r\n",
             b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
             b"\r\nContent-Type: audio/wav\r\n\r\n" + draw(st.binary(max_size=64)) + b"\r\n"]
    body = b"".join(draw(st.permutations(parts))) + b"--" + b + b"--\r\n"
    if draw(st.booleans()):
        body = draw(st.sampled_from([body[: len(body) // 2], body.replace(b"\r\n", b"\n"),
                                     body + draw(st.binary(max_size=32))]))
    return ctype.encode(), body


CONTENT_TYPES = st.sampled_from([
    b"application/json", b"", b"text/plain", b"application/json; charset=utf-16",
    b"multipart/form-data", b"multipart/form-data; boundary=", b"multipart/form-data; boundary=xyz",
    b"application/x-www-form-urlencoded", b"APPLICATION/JSON", b"application/octet-stream",
]) | LATIN1.map(lambda s: s.encode("latin-1"))


@st.composite
def valid_requests(draw) -> dict:
    """A well-formed request for the known model, so that some reach its upstream."""
    doc = {"model": draw(st.sampled_from([KNOWN, "al"])), "max_tokens": draw(st.integers(0, 4)),
           "messages": [{"role": "user", "content": draw(TEXT)}], "prompt": draw(TEXT),
           "input": draw(TEXT), "query": "q", "documents": ["a", "b"]}
    if draw(st.booleans()):
        doc["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        doc["service_tier"] = draw(st.sampled_from(["priority", "flex", "default", "auto", 7]))
    return doc


@st.composite
def bodies(draw, reaches_upstream: bool = False) -> tuple[bytes | None, bytes]:
    """(content type or None for "keep the drawn one", body); `reaches_upstream` as for
    `request_documents`."""
    pick = draw(st.integers(0, 8))
    if pick >= 7:
        return b"application/json", json.dumps(draw(valid_requests())).encode()
    if pick == 0:
        return None, draw(st.binary(max_size=512))
    if pick == 1:
        return None, json.dumps(draw(JSON_VALUES), allow_nan=True).encode()
    if pick == 2:
        return None, draw(DEEP)
    if pick == 3:
        return None, draw(LITERALS)
    if pick == 4:
        return draw(forms())
    return None, json.dumps(draw(request_documents(reaches_upstream)), allow_nan=True,
                            ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


HEADER_VALUES = LATIN1 | st.sampled_from([
    "interactive", "BATCH", "-20", "+7", "1e3", "9" * 40, "nan", "inf", "-inf", "0", "-1",
    "1e-320", "0.001", "1e309", " 5 ", "\t", "0x10", "1_000",
])


@st.composite
def headers(draw, ctype: bytes | None = None) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    if ctype is not None:
        out.append((b"content-type", ctype))
    elif draw(st.integers(0, 3)):
        out.append((b"content-type", draw(CONTENT_TYPES)))
    for name in (b"x-llamaswap-priority", b"x-llamaswap-queue-timeout", b"authorization",
                 b"x-api-key", b"accept", b"host", b"content-length", b"cookie", b"origin",
                 b"sec-fetch-site", b"access-control-request-headers"):
        if draw(st.integers(0, 3)) == 0:
            if name == b"origin":  # the exposure policy (gpuproxy/proxy/exposure.py) parses it
                value = draw(st.sampled_from([
                    "null", "https://evil.example", "http://127.0.0.1:8080", "http://[::1]:80",
                    "http://[::1", "http://x:99999", "https://", "file://", "http://a/b?c",
                    "http://" + "a" * 300, "HTTP://LOCALHOST."]) | LATIN1)
            elif name == b"sec-fetch-site":
                value = draw(st.sampled_from(["cross-site", "same-site", "same-origin",
                                              "none", "CROSS-SITE "]) | LATIN1)
            elif name == b"access-control-request-headers":
                value = draw(st.sampled_from(["authorization, x-llamaswap-priority", ",,",
                                              "bad(header", "a" * 5000]) | LATIN1)
            elif name == b"content-length":
                value = str(draw(st.integers(-1, 10**6)))
            elif name == b"host":
                value = draw(st.sampled_from(["localhost", "bad host!", "[::1", "a" * 300,
                                              "x:99999", "example.com:80"]) | LATIN1)
            elif name == b"cookie":
                value = draw(st.sampled_from(["csrftoken=" + "a" * 32, "sessionid=x"]) | LATIN1)
            else:
                value = draw(HEADER_VALUES)
            out.append((name, value.encode("latin-1")))
    return out


def _segment(s: str) -> str:
    return quote(s, safe="")


SEGMENTS = st.one_of(
    st.sampled_from([KNOWN, "al", "%2F", "..", "%2E%2E", "a%2Fb", "%00", "%FF", "%", "%zz",
                     "x" * 5000, "alpha/..", "alpha/../..", "alpha%2F..", ".", "proxy",
                     "upstream"]),
    TEXT.map(_segment), model_names().map(_segment),
)

# Django's management paths, with what may follow them.
MANAGEMENT = ["/health", "/running", "/api/models/load/", "/api/models/unload",
              "/api/models/unload/", "/unload", "/api/queue", "/api/activity",
              "/api/activity/stats", "/metrics", "/logs", "/logs/stream", "/logs/stream/",
              "/v1/models", "/models", "/static/", "/favicon.ico", "/api/", "/v2/models"]
TAKES_SEGMENT = {"/api/models/load/", "/api/models/unload/", "/logs/stream/", "/static/",
                 "/api/"}


@st.composite
def activity_queries(draw) -> bytes:
    odd = st.sampled_from(["", "1h", "7d", "0s", "-1h", "1e3h", "9" * 400 + "h", "9" * 30 + "d",
                           "2026-01-31T12:00:00Z", "2026-01-31T12:00:00 01:00", "0001-01-01",
                           "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00",
                           "2026-13-45", "nan", "\x00", "1h\x00", "٣h", "1.5.5h"]) | TEXT
    values = {
        "since": odd, "until": odd,
        "limit": st.sampled_from(["", "0", "1", "1000", "1001", "-1", "1e3", "nan", "٣",
                                  "9" * 5000, " 5", "0x10"]) | TEXT,
        "model": st.sampled_from([KNOWN, "", "\x00", "a" * 5000, "%", "'; drop"]) | TEXT,
        "band": st.sampled_from(["interactive", "normal", "batch", "", "\x00"]) | TEXT,
        "outcome": st.sampled_from(["ok", "", "nope", "\x00", "OK"]) | TEXT,
    }
    pairs = []
    for name, strat in values.items():
        for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
            pairs.append((name, draw(strat)))
    query = urlencode(pairs).encode()
    if draw(st.integers(0, 9)) == 0:
        query += draw(st.sampled_from([b"&" * 3000, b"a=1&" * 1200, b"%", b"=&=", b"no-history"]))
    return query


# ---- the fuzz -------------------------------------------------------------------------------

INFERENCE = sorted(INFERENCE_PATHS)


@FUZZ
@given(data=st.data())
async def test_fuzz_inference_endpoints(rt, data):
    path = data.draw(st.sampled_from(INFERENCE), label="path")
    method = data.draw(st.sampled_from(["POST"] * 12 + ["GET", "PUT", "DELETE", "PATCH",
                                                        "HEAD", "OPTIONS"]), label="method")
    ctype, body = data.draw(bodies(), label="body")
    if ctype is None and path in FORM_PATHS and data.draw(st.booleans()):
        ctype, body = data.draw(forms(), label="form")
    hdrs = data.draw(headers(ctype), label="headers")
    query = data.draw(st.sampled_from([b"", b"model=" + KNOWN.encode(), b"stream=true",
                                       b"model=%00", b"model=" + b"x" * 3000, b"%%", b"&&"]),
                      label="query")
    resp = await call(method, path, query=query, headers=hdrs, body=body,
                      chunks=data.draw(st.integers(1, 3), label="chunks"))
    check(resp, relayed_ok=True)


@FUZZ
@given(data=st.data())
async def test_fuzz_management_endpoints(rt, data):
    base = data.draw(st.sampled_from(MANAGEMENT), label="path")
    path = base + (data.draw(SEGMENTS, label="segment") if base in TAKES_SEGMENT else "")
    if data.draw(st.integers(0, 9)) == 0:
        path += data.draw(st.sampled_from(["/", "/..", "/%2F", "/x", "%00"]))
    method = data.draw(st.sampled_from(["GET"] * 6 + ["POST", "PUT", "DELETE", "PATCH",
                                                      "HEAD", "OPTIONS"]), label="method")
    if base.startswith("/api/activity"):
        query = data.draw(activity_queries(), label="query")
    else:
        query = data.draw(st.sampled_from([b"", b"no-history", b"%", b"a=%00", b"x" * 5000]),
                          label="query")
    ctype, body = data.draw(bodies(), label="body") if method != "GET" else (None, b"")
    hdrs = data.draw(headers(ctype), label="headers")
    resp = await call(method, path, query=query, headers=hdrs, body=body)
    check(resp)


@FUZZ
@given(data=st.data())
async def test_fuzz_upstream_passthrough(rt, data):
    model = data.draw(st.sampled_from([KNOWN, "al"]) | SEGMENTS, label="model")
    rest = data.draw(st.sampled_from([["health"], ["v1", "models"], ["props"],
                                       ["v1", "chat", "completions"]])
                     | st.lists(SEGMENTS | st.sampled_from(["v1", "health", "props", "x.js",
                                                            "index.html", "%3F", "%23", "%20"]),
                                max_size=3), label="rest")
    path = "/upstream/" + model + ("/" + "/".join(rest) if rest or data.draw(st.booleans())
                                   else "")
    # HEAD too: the fake upstream answers it with a body, which desynchronises the pooled
    # connection; the next request on it must still get a 502, never a 500.
    method = data.draw(METHODS, label="method")
    ctype, body = data.draw(bodies(reaches_upstream=True), label="body")
    hdrs = data.draw(headers(ctype), label="headers")
    resp = await call(method, path, headers=hdrs, body=body,
                      query=data.draw(st.sampled_from([b"", b"a=1", b"%00"]), label="query"))
    check(resp, relayed_ok=True)


@FUZZ
@given(data=st.data())
async def test_fuzz_unknown_paths(rt, data):
    path = "/" + "/".join(data.draw(st.lists(SEGMENTS, min_size=1, max_size=4), label="path"))
    assume(not unquote(path).startswith("/upstream/"))  # test_fuzz_upstream_passthrough's
    method = data.draw(METHODS, label="method")
    hdrs = data.draw(headers(), label="headers")
    resp = await call(method, path, headers=hdrs,
                      body=data.draw(st.binary(max_size=64), label="body"))
    if resp.status in (301, 302, 308):  # APPEND_SLASH, the admin's login
        return
    check(resp)


AUTH_VALUES = st.one_of(
    st.just(f"Bearer {KEY}"), st.just("Basic " + base64.b64encode(f"u:{KEY}".encode()).decode()),
    LATIN1, st.sampled_from(["Bearer", "Bearer ", "bearer  " + KEY, "Basic", "Basic ",
                             "Basic !!!!", "Basic " + base64.b64encode(b"\xff:\xfe").decode(),
                             "Basic " + base64.b64encode(b"nocolon").decode(), "Basic ====",
                             "Digest x", "Bearer " + "k" * 20_000, "Bearer \xe9\xff"]),
    TEXT.map(lambda t: "Basic " + base64.b64encode(t.encode()).decode()),
)


@FUZZ
@given(data=st.data())
async def test_fuzz_api_keys(rt_keyed, data):
    path = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/models", "/running",
                                      "/api/queue", "/api/activity", "/metrics", "/logs",
                                      "/upstream/alpha/health", "/api/models/unload/nope"]),
                     label="path")
    hdrs = []
    if data.draw(st.integers(0, 5)):
        hdrs.append((b"authorization", data.draw(AUTH_VALUES, label="auth").encode("latin-1")))
    if data.draw(st.integers(0, 3)) == 0:
        hdrs.append((b"x-api-key", data.draw(LATIN1 | st.just(KEY), label="x-api-key")
                     .encode("latin-1")))
    method = "POST" if path.startswith(("/v1/chat", "/api/models")) else "GET"
    body = json.dumps({"model": "nope", "messages": []}).encode() if method == "POST" else b""
    resp = await call(method, path, headers=[(b"content-type", b"application/json"), *hdrs],
                      body=body)
    check(resp)
    if resp.status == 401:
        assert resp.headers.get(b"www-authenticate"), resp


# ---- explicit cases: the limits, and what the fuzz found ------------------------------------

def chat_headers() -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json")]


def assert_error(resp: Response, status: int, code: str) -> dict:
    check(resp)
    assert resp.status == status, resp
    err = resp.json()["error"]
    assert err["code"] == code, err
    assert err["type"] == "invalid_request_error", err
    return err


@pytest.mark.parametrize("body", [
    b"[" * 100_000,
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    # the body's object is level 1: one level more than the limit
    b'{"model":"alpha","messages":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
], ids=["open-100k", "closed-100k", "objects-100k", "one-over-the-limit"])
async def test_json_nested_too_deep_is_400(rt, body):
    """The stdlib parser would raise RecursionError (not a ValueError) near 1000 levels: a
    500 before the limit existed."""
    resp = await call("POST", "/v1/chat/completions", headers=chat_headers(), body=body)
    err = assert_error(resp, 400, "json_too_deep")
    assert str(MAX_JSON_DEPTH) in err["message"]


async def test_json_nesting_at_the_limit_is_accepted(rt):
    """Exactly MAX_JSON_DEPTH levels (the body object counts as one) parses and is proxied:
    here it names an unknown model, so the answer is the ordinary 404."""
    inner = MAX_JSON_DEPTH - 1
    body = (b'{"model":"nope","messages":' + b"[" * inner + b"]" * inner + b"}")
    resp = await call("POST", "/v1/chat/completions", headers=chat_headers(), body=body)
    check(resp)
    assert resp.status == 404, resp
    assert resp.json()["error"]["code"] == "model_not_found"


def _depth(value) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


TRICKY_TEXT = st.text(st.sampled_from('[]{}"\\/ab\u00e9\U0001f642'), max_size=8)
TRICKY_JSON = st.recursive(
    st.none() | st.integers() | TRICKY_TEXT,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(TRICKY_TEXT, c, max_size=3),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=TRICKY_JSON, limit=st.integers(0, 8), ascii_only=st.booleans())
def test_depth_scan_agrees_with_the_real_depth(value, limit, ascii_only):
    """The pre-parse scan counts exactly what the parser would nest: brackets, quotes and
    backslashes inside strings do not count."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert too_deep(text, limit) == (_depth(value) > limit)


async def test_brackets_inside_strings_do_not_count(rt):
    body = json.dumps({"model": "nope", "prompt": "[" * 100_000 + "{" * 100_000}).encode()
    resp = await call("POST", "/v1/completions", headers=chat_headers(), body=body)
    check(resp)
    assert resp.status == 404, resp


async def test_integer_over_the_digit_limit_is_400(rt):
    """Python refuses int() of more than 4300 digits with a ValueError that is not a
    JSONDecodeError."""
    body = b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    resp = await call("POST", "/v1/chat/completions", headers=chat_headers(), body=body)
    assert_error(resp, 400, "invalid_json")


@pytest.mark.parametrize("ctype", [b"multipart/form-data", b"multipart/form-data; boundary=",
                                   b'multipart/form-data; boundary="'])
async def test_multipart_without_a_boundary_is_400(rt, ctype):
    resp = await call("POST", "/v1/audio/transcriptions",
                      headers=[(b"content-type", ctype)], body=b"--x\r\n\r\n")
    assert_error(resp, 400, "invalid_request")


async def test_integer_over_the_digit_limit_in_a_form_field_is_harmless(rt):
    resp = await call("POST", "/v1/audio/transcriptions",
                      headers=[(b"content-type", b"multipart/form-data; boundary=b")],
                      body=b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                           + b"9" * 5000 + b"\r\n--b--\r\n")
    check(resp)
    assert resp.status == 404, resp


@pytest.mark.parametrize(("path", "query"), [
    ("/upstream/alpha/%00", b""), ("/upstream/alpha/%1F", b""), ("/upstream/alpha/x%7F", b""),
    ("/upstream/alpha/health", b"a=\x01"), ("/v1/chat/completions", b"model=alpha&x=\x1b"),
])
async def test_control_characters_in_proxied_urls_are_400(rt, path, query):
    """httpx refuses such a URL (`InvalidURL`): a 500 before the check existed. They come
    percent-encoded in the path (Daphne decodes it) or raw in the query string."""
    resp = await call("POST" if path.startswith("/v1/") else "GET", path, query=query,
                      headers=chat_headers(), body=b'{"model": "alpha", "max_tokens": 1}'
                      if path.startswith("/v1/") else b"")
    assert_error(resp, 400, "invalid_url")
    assert not rt.upstreams.running_ids(), "nothing to load for a request refused at the door"


@pytest.mark.parametrize("value", [b"\x01", b"a\x7fb", b"\x1b[31m", b"x\x0b"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/upstream/alpha/health"])
async def test_control_characters_in_header_values_are_400(rt, path, value):
    """Twisted passes every byte but NUL, CR and LF in a header value; the upstream client
    (aiohttp) refuses to send the others: a 500 before the check existed."""
    resp = await call("POST" if path.startswith("/v1/") else "GET", path,
                      headers=[*chat_headers(), (b"accept", value)],
                      body=b'{"model": "alpha", "max_tokens": 1}' if path.startswith("/v1/")
                      else b"")
    assert_error(resp, 400, "invalid_header")


async def test_tab_in_a_header_value_is_fine(rt):
    resp = await call("GET", "/upstream/alpha/health", headers=[(b"x-note", b"a\tb")])
    assert resp.status == 200, resp


@pytest.mark.parametrize("model", ["\ud800", "a\udfffb", "\u0000", "alpha\u0000",
                                   "a\nb", "\u007f"])
async def test_model_that_is_not_text_is_400_and_the_activity_log_keeps_writing(rt, model):
    """A lone surrogate made the activity writer take UTF-8's refusal for a database outage:
    it kept the batch and retried it forever, so no request was logged any more. A NUL is
    refused by PostgreSQL. Such a `model` names nothing: 400, and the row is written."""
    from activity.models import RequestLog
    from activity.writer import writer

    resp = await call("POST", "/v1/chat/completions", headers=chat_headers(),
                      body=json.dumps({"model": model, "messages": []}).encode())
    assert_error(resp, 400, "invalid_model")
    assert await writer().flush(5), "the activity writer is stuck"
    rows = await runtime.run_db(lambda: list(RequestLog.objects.values("outcome", "status_code")))
    assert rows == [{"outcome": "bad_request", "status_code": 400}]


@pytest.mark.parametrize("query", [b"model=%00", b"band=%00", b"model=a%00b"])
@pytest.mark.parametrize("path", ["/api/activity", "/api/activity/stats"])
async def test_activity_text_filters_with_nul_are_400(rt, path, query):
    """PostgreSQL text cannot hold NUL: the query failed, a 500."""
    resp = await call("GET", path, query=query)
    if path.endswith("stats") and query.startswith(b"band"):
        assert resp.status == 200  # stats has no band filter
        return
    err = assert_error(resp, 400, "invalid_parameter")
    assert err["param"] == query.split(b"=")[0].decode()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
async def test_health_answers_any_method_without_a_csrf_page(rt, method):
    """`/health` is not a form: a POST got Django's HTML CSRF 403."""
    resp = await call(method, "/health", body=b"x")
    assert resp.status == 200, resp
    assert resp.body == b"OK"


@pytest.mark.parametrize(("path", "query", "hdrs"), [
    ("/running", b"", [(b"host", b"bad host!")]),
    ("/api/activity", b"a=1&" * 1001, []),
    ("/nowhere", b"", [(b"host", b"[::1")]),
])
async def test_django_400s_are_openai_errors(rt, path, query, hdrs):
    """Django's own 400s (a malformed Host header, more than DATA_UPLOAD_MAX_NUMBER_FIELDS
    query fields) were its HTML page."""
    resp = await call("GET", path, query=query, headers=hdrs)
    assert resp.status == 400, resp
    assert resp.headers.get(b"content-type", b"").startswith(b"application/json"), resp
    assert _is_envelope(resp.json()) and resp.json()["error"]["code"] == "bad_request", resp


# ---- Django's suspicious-operation errors outside its handling (gpuproxy/proxy/guard.py) ---------

@pytest.mark.parametrize("path", ["/static/..", "/static/%2E%2E/x"])
async def test_static_path_traversal_is_not_a_crash(rt, path):
    resp = await call("GET", path)
    assert resp.status in (400, 404), resp


async def test_too_many_query_fields_with_a_charset_is_not_a_crash(rt):
    resp = await call("GET", "/api/activity", query=b"&" * 1001 + b"a=1&" * 1001,
                      headers=[(b"content-type", b"text/plain; charset=utf-8")])
    assert resp.status == 400, resp


BROKEN_UPSTREAM = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(16)
while True:
    c, _ = s.accept()
    data = c.recv(65536)
    if b"/health" in data.split(b"\\r\\n", 1)[0]:
        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok")
    else:
        c.sendall(b"this is not HTTP\\r\\n\\r\\n")
    c.close()
"""


@pytest.fixture
async def rt_broken(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN_UPSTREAM)
    parsed = parse_config(f"""
startPort: {free_port()}
healthCheckTimeout: 15
models:
  broken:
    cmd: {sys.executable} {script} ${{PORT}}
""", {})
    await runtime.run_db(lambda: import_config(parsed))
    yield await runtime.get()
    await runtime.shutdown()


async def test_malformed_upstream_response_is_502(rt_broken):
    resp = await call("POST", "/v1/chat/completions", headers=chat_headers(),
                      body=b'{"model": "broken", "messages": []}')
    check(resp)
    assert resp.status == 502, resp


# ---- header size: Twisted's limits, against a real server -------------------------------------

def _raw_exchange(port: int, request: bytes, timeout: float = 10) -> bytes:
    """Send `request` on a fresh connection and read until the server closes it (or the
    answer to a request without a body is complete)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may refuse and close before it has read everything
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def test_oversized_headers_are_refused_and_the_server_lives(serve):
    """The request head is bounded: each line at 16,384 bytes (Twisted's
    `LineReceiver.MAX_LENGTH`), the request line plus all header lines at 16,384 bytes in
    total (`HTTPChannel.totalHeadersSize`) and 500 header lines (`maxHeaders`). Past a limit
    the edge (gpuproxy/proxy/edge.py) answers in the OpenAI envelope and closes: 414 for a request
    line too long, 431 for a header line, the total or the count, never a bare 400 nor a
    dropped connection. NUL, CR and LF in header values and any non-ASCII or control byte in
    the request line get 400. No such request reaches the application, and the server carries
    on."""
    proxy = serve(config(free_port()))
    port = int(proxy.base.rsplit(":", 1)[1])
    close = b"Host: 127.0.0.1\r\nConnection: close\r\n"

    many_small = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 100) for i in range(200))
                  + b"\r\n")  # 20 KB of headers, every line short
    assert _raw_exchange(port, many_small).startswith(b"HTTP/1.1 431 ")

    too_many = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + b"".join(b"X-%d: 1\r\n" % i for i in range(600)) + b"\r\n")
    assert _raw_exchange(port, too_many).startswith(b"HTTP/1.1 431 ")

    one_huge = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000
                + b"\r\n\r\n")
    answer = _raw_exchange(port, one_huge)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]

    huge_priority = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\n"
                     b"X-LlamaSwap-Priority: " + b"9" * 100_000 + b"\r\n\r\n{}")
    answer = _raw_exchange(port, huge_priority)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]

    long_url = b"GET /v1/models?" + b"a" * 100_000 + b" HTTP/1.1\r\n" + close + b"\r\n"
    assert _raw_exchange(port, long_url).startswith(b"HTTP/1.1 414 ")

    nul = b"GET /v1/models HTTP/1.1\r\n" + close + b"X-A: a\x00b\r\n\r\n"
    assert _raw_exchange(port, nul).startswith(b"HTTP/1.1 400 ")

    # Just under the line limit is served; another control byte gets through Twisted, and
    # the proxy refuses it itself (aiohttp would not send it upstream).
    big_ok = b"GET /v1/models HTTP/1.1\r\n" + close + b"X-Big: " + b"a" * 16_000 + b"\r\n\r\n"
    assert _raw_exchange(port, big_ok).startswith(b"HTTP/1.1 200 ")
    ctl = _raw_exchange(port, b"GET /v1/models HTTP/1.1\r\n" + close + b"X-A: \x01\r\n\r\n")
    assert ctl.startswith(b"HTTP/1.1 400 ") and b'"invalid_header"' in ctl

    # Still serving, and nothing crashed.
    assert proxy.http.get("/health").text == "OK"
    r = proxy.http.get("/v1/models", headers={"X-Pad": "a" * 8000})
    assert r.status_code == 200
    assert proxy.proc.poll() is None
    assert "Traceback" not in proxy.output()


def test_request_body_over_the_limit_is_413(serve):
    """GPUPROXY_MAX_BODY_MB, here 1 MB: a bigger body gets 413 in the envelope, without the
    proxy reading it all into one piece first."""
    proxy = serve(config(free_port()), {"GPUPROXY_MAX_BODY_MB": "1"})
    r = proxy.http.post("/v1/chat/completions", content=b"[" * (2 * 1024 * 1024),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert _is_envelope(r.json()) and r.json()["error"]["code"] == "body_too_large"
    assert proxy.http.get("/health").text == "OK"

