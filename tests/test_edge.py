"""What reaches `gpuproxy serve` from outside, on real sockets: big bodies, trickling clients,
long lines, unauthenticated uploads (gpuproxy/proxy/edge.py).

Every test talks raw HTTP/1.1 to a real `gpuproxy serve` so that what the client sees on the
wire (a status or a dropped connection, a 100 Continue or the final answer, when it comes) is
what is checked, and the server's memory is read from the kernel (psutil on its pid).
"""

from __future__ import annotations

import hashlib
import json
import select
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import FAKE, free_port

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-edge-7c1d"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
LIMIT_MB = 4
HEADER_DEADLINE = 2  # GPUPROXY_HEADER_TIMEOUT_SECONDS in these tests
BASE_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def proxy(serve):
    return serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 15
    apiKeyHashes:  # an admin key: the management paths need one (docs/security.md)
      - {{name: edge, sha256: "{hashlib.sha256(KEY.encode()).hexdigest()}", admin: true}}
    models:
      solo:
        cmd: {FAKE}
    """, {"GPUPROXY_MAX_BODY_MB": str(LIMIT_MB),
          "GPUPROXY_HEADER_TIMEOUT_SECONDS": str(HEADER_DEADLINE)})


def port_of(proxy) -> int:
    return int(proxy.base.rsplit(":", 1)[1])


def head(method: str, path: str, *lines: bytes) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + b"".join(lines)
            + b"\r\n")


class Answer:
    """The first response head (and what body came with it) on a connection, and when."""

    def __init__(self, raw: bytes, elapsed: float) -> None:
        self.raw = raw
        self.elapsed = elapsed
        first, _, rest = raw.partition(b"\r\n")
        self.status = int(first.split()[1]) if first.startswith(b"HTTP/1.1 ") else None
        self.head, _, self.body = rest.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in self.head.lower():
            self.body = dechunk(self.body)

    def json(self) -> dict:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Answer {self.status} after {self.elapsed:.2f} s: {self.raw[:300]!r}>"


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def first_answer(s: socket.socket, within: float) -> Answer:
    """Read until the first response is complete (Content-Length), the peer closes, or
    `within` seconds pass; never sends anything."""
    t0 = time.monotonic()
    s.settimeout(within)
    data = b""
    while True:
        if b"\r\n\r\n" in data:
            headers = data.split(b"\r\n\r\n", 1)[0].lower()
            if data.startswith(b"HTTP/1.1 100 "):
                break  # an interim answer is an answer here: the tests look at which one
            if b"transfer-encoding: chunked" in headers and data.endswith(b"\r\n0\r\n\r\n"):
                return Answer(data, time.monotonic() - t0)
            for line in headers.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    if len(data.split(b"\r\n\r\n", 1)[1]) >= int(line.split(b":")[1]):
                        return Answer(data, time.monotonic() - t0)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return Answer(data, time.monotonic() - t0)


def exchange(port: int, request: bytes, within: float = 5.0) -> Answer:
    with socket.create_connection(("127.0.0.1", port), timeout=within) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return first_answer(s, within)


def envelope(answer: Answer, status: int, code: str) -> dict:
    assert answer.status == status, answer
    assert b"content-type: application/json" in answer.head.lower(), answer
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# ---- the body limit, before the body ----------------------------------------------------------

GIB = 1024 ** 3


def test_an_over_limit_content_length_is_refused_before_the_body_arrives(proxy):
    """Only the head is sent: an answer can come only from the Content-Length."""
    a = exchange(port_of(proxy), head("POST", "/v1/chat/completions", AUTH,
                                      b"Content-Type: application/json\r\n",
                                      f"Content-Length: {GIB}\r\n".encode()))
    error = envelope(a, 413, "body_too_large")
    assert str(LIMIT_MB * 1024 * 1024) in error["message"] and "GPUPROXY_MAX_BODY_MB" in \
        error["message"]
    assert b"connection: close" in a.head.lower()


@pytest.mark.parametrize(("path", "auth", "length", "status", "code"), [
    ("/v1/chat/completions", AUTH, GIB, 413, "body_too_large"),
    ("/v1/chat/completions", b"", GIB, 401, "invalid_api_key"),
    ("/v1/chat/completions", b"Authorization: Bearer wrong\r\n", 1000, 401, "invalid_api_key"),
    ("/api/models/load/solo", b"", 1000, 401, "invalid_api_key"),
    ("/upstream/solo/v1/chat/completions", b"", 1000, 401, "invalid_api_key"),
])
def test_expect_100_continue_gets_the_final_status_not_100(proxy, path, auth, length, status,
                                                          code):
    a = exchange(port_of(proxy), head("POST", path, auth, b"Expect: 100-continue\r\n",
                                      f"Content-Length: {length}\r\n".encode()))
    envelope(a, status, code)
    if status == 401:
        assert b'www-authenticate: bearer realm="gpuproxy"' in a.head.lower()


def test_expect_100_continue_with_a_key_and_a_small_body_continues(proxy):
    body = b'{"model": "solo", "max_tokens": 1, "messages": []}'
    with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=30) as s:
        s.sendall(head("POST", "/v1/chat/completions", AUTH, b"Expect: 100-continue\r\n",
                       b"Content-Type: application/json\r\n",
                       f"Content-Length: {len(body)}\r\n".encode()))
        interim = first_answer(s, 5)
        assert interim.raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        s.sendall(body)
        final = first_answer(s, 30)
    final = Answer(final.raw[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
                   if final.raw.startswith(b"HTTP/1.1 100") else final.raw, final.elapsed)
    assert final.status == 200, final
    assert final.json()["choices"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/models/load/solo",
                                  "/upstream/solo/v1/chat/completions"])
def test_no_key_is_refused_before_the_body_is_read(proxy, path):
    """An unauthenticated client never gets to upload: the 401 comes on the head alone."""
    a = exchange(port_of(proxy), head("POST", path, b"Content-Type: application/json\r\n",
                                      b"Content-Length: 1000000\r\n"))
    envelope(a, 401, "invalid_api_key")


def _chunked_upload(port: int, total: int, result: dict) -> None:
    """Send up to `total` bytes chunked (with the key) and stop when an answer arrives."""
    piece = b"[" * 65536
    frame = b"%x\r\n%s\r\n" % (len(piece), piece)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head("POST", "/v1/chat/completions", AUTH,
                       b"Content-Type: application/json\r\n",
                       b"Transfer-Encoding: chunked\r\n"))
        try:
            while sent < total:
                readable, _, _ = select.select([s], [], [], 0)
                if readable:
                    break
                s.sendall(frame)
                sent += len(piece)
            else:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        result["sent"] = sent
        result["answer"] = first_answer(s, 60)


def test_chunked_uploads_are_cut_at_the_limit_and_memory_stays_bounded(proxy):
    """Three 256 MB chunked uploads at once (the field report: RSS peaked at 893 MB and each
    got its 413 only after the whole body). Each must be stopped near the limit, and the
    server's resident memory must not grow by anything like a body."""
    server = psutil.Process(proxy.proc.pid)
    baseline = server.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], server.memory_info().rss)
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results = [{} for _ in range(3)]
    uploads = [threading.Thread(target=_chunked_upload,
                                args=(port_of(proxy), 256 * 1024 * 1024, r))
               for r in results]
    for t in uploads:
        t.start()
    for t in uploads:
        t.join(180)
    stop.set()
    sampler.join()
    for r in results:
        envelope(r["answer"], 413, "body_too_large")
        # the limit plus what socket buffers on both sides hold (a few MB on loopback)
        assert r["sent"] < 64 * 1024 * 1024, r["sent"]
    grown = (peak[0] - baseline) / 1024 / 1024
    assert grown < 100, f"RSS grew by {grown:.0f} MB during three refused uploads"
    assert proxy.http.get("/health").text == "OK"


# ---- the request head: a deadline, and statuses for what is too long --------------------------

def test_a_trickling_head_is_answered_408_at_the_deadline(proxy):
    """One header byte every 0.2 s, forever: the idle timeout (reset by every byte) never
    fires; the header deadline does."""
    with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=1) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        t0 = time.monotonic()
        data = b""
        while time.monotonic() - t0 < HEADER_DEADLINE + 8:
            try:
                s.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
            readable, _, _ = select.select([s], [], [], 0.2)  # the client's own pace
            if readable:
                chunk = s.recv(65536)
                data += chunk
                if not chunk:
                    break
        elapsed = time.monotonic() - t0
    a = Answer(data, elapsed)
    error = envelope(a, 408, "request_header_timeout")
    assert f"{HEADER_DEADLINE:g} s" in error["message"], error
    assert HEADER_DEADLINE - 0.5 <= elapsed < HEADER_DEADLINE + 5, a


def test_a_slow_body_upload_is_not_cut_by_the_header_deadline(proxy):
    """The deadline covers the head only: a body trickling in for twice as long is fine."""
    body = b'{"x": "' + b"a" * 60 + b'"}'
    with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=30) as s:
        s.sendall(head("POST", "/api/models/unload", AUTH, b"Content-Type: application/json\r\n",
                       f"Content-Length: {len(body)}\r\n".encode()))
        t0 = time.monotonic()
        for i in range(0, len(body), 4):
            s.sendall(body[i:i + 4])
            select.select([s], [], [], 0.4)  # the client's pace: 4 bytes per 0.4 s
        assert time.monotonic() - t0 > 2 * HEADER_DEADLINE
        a = first_answer(s, 30)
    assert a.status == 200, a
    assert a.json() == {"msg": "ok"}


def test_a_long_response_is_not_cut_by_the_header_deadline(proxy):
    body = b'{"model": "solo", "max_tokens": 1, "messages": []}'
    with socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=60) as s:
        s.sendall(head("POST", "/v1/chat/completions", AUTH, b"Content-Type: application/json\r\n",
                       f"X-Fake-Hold: {2 * HEADER_DEADLINE}\r\n".encode(),
                       f"Content-Length: {len(body)}\r\n".encode()) + body)
        a = first_answer(s, 60)
    assert a.status == 200, a
    assert a.elapsed >= 2 * HEADER_DEADLINE


def test_a_20_kb_url_gets_414(proxy):
    a = exchange(port_of(proxy), b"GET /v1/models?q=" + b"a" * 20_000 + b" HTTP/1.1\r\n"
                 b"Host: 127.0.0.1\r\n\r\n")
    error = envelope(a, 414, "uri_too_long")
    assert "16384" in error["message"], error


def test_a_20_kb_header_line_gets_431(proxy):
    a = exchange(port_of(proxy), head("GET", "/v1/models", b"X-Big: " + b"a" * 20_000 + b"\r\n"))
    envelope(a, 431, "header_fields_too_large")


def test_headers_over_the_total_get_431(proxy):
    """Each line fits, together they are over 16 KB (Twisted's totalHeadersSize)."""
    lines = [b"X-Pad-%d: %s\r\n" % (i, b"a" * 6000) for i in range(3)]
    a = exchange(port_of(proxy), head("GET", "/v1/models", *lines))
    envelope(a, 431, "header_fields_too_large")


# ---- error messages name no path of this machine ------------------------------------------

@pytest.mark.parametrize("path", ["/static/../../etc/passwd", "/static/..", "/static/%2E%2E/x"])
def test_a_static_traversal_names_no_install_path(proxy, path):
    a = exchange(port_of(proxy), head("GET", path, b"Connection: close\r\n"))
    assert a.status in (400, 404), a
    assert str(BASE_DIR).encode() not in a.raw and b"site-packages" not in a.raw, a
    assert b"/etc/passwd" not in a.body, a
    if a.status == 400:
        envelope(a, 400, "bad_request")


class _Headers:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def getRawHeaders(self, name: bytes) -> list[bytes] | None:
        value = self.headers.get(name)
        return [value] if value is not None else None


class _Request:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.requestHeaders = _Headers(headers)


def test_before_the_runtime_exists_the_edge_knows_the_admin_keys_read_at_start(monkeypatch):
    """Connections (and /health) are answered before the runtime is built: an ordinary key's
    upload to an admin path is refused on its head then too, from the ranks read at start
    (it used to pass, and the application then waited for a body the client never sent)."""
    from gpuproxy.proxy import edge

    user, admin = "sk-user", "sk-admin"
    digest = {k: hashlib.sha256(k.encode()).hexdigest() for k in (user, admin)}
    monkeypatch.setattr(edge.limits, "keys_at_start", {digest[user]: "u", digest[admin]: "a"})
    monkeypatch.setattr(edge.limits, "admin_keys_at_start", frozenset({digest[admin]}),
                        raising=False)
    keys, admin_keys = edge._keys()  # no runtime in this process
    path = "/api/models/load/solo"

    refused = edge._key_refusal(_Request({b"authorization": f"Bearer {user}".encode()}), path,
                                keys, admin_keys)
    assert refused is not None and (refused.status, refused.code) == (403, "admin_key_required")
    assert edge._key_refusal(_Request({b"authorization": f"Bearer {admin}".encode()}), path,
                             keys, admin_keys) is None
