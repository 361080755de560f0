"""A peer's model forwarded (gpuproxy/proxy/peers.py): what the peer receives (its model
name, its filters, its key and never the client's, the applied priority as it reads it),
what the client gets back (the answer as it came, a stream as it streams), and the peer that
misbehaves (refuses, closes, hangs past `responseHeader`). Plus the rules on a carried age
(gpuproxy/proxy/urgency.py). The peers are raw asyncio HTTP servers in the test's loop, so
each test sees the bytes that reached them; the proxy is the real ASGI application on the
real runtime and database."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable

import pytest

from gpuproxy.proxy import peers, urgency
from gpuproxy.proxy.inference import parse
from gpuproxy.shell import runtime
from scheduling.catalog import Catalog, CatalogPeer, Route
from tests.helpers import chat_communicator, runtime_on

CLIENT_KEY = "sk-client-of-the-entry-node"
PEER_KEY = "sk-the-peer-key"
TRUSTED_KEY = "sk-trusted-peer-node"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ---- pure: the body and the headers a peer gets ------------------------------------------

def _parsed(body: dict):
    raw = json.dumps(body).encode()
    return parse("POST", "/v1/chat/completions", "",
                 {b"content-type": b"application/json"}, raw)


def _route(requested: str = "lab/qwen") -> Route:
    return Route("peer", "lab/qwen", requested, peer_id="lab", peer_model="qwen")


def test_the_peer_gets_its_bare_model_name_and_its_filters_never_touching_model():
    peer = CatalogPeer("lab", "http://x", models=("qwen",), strip_params=("top_k", "model"),
                       set_params={"temperature": 0.2}, priority_forward="none")
    sent = json.loads(peers.body_for(peer, _route(), _parsed(
        {"model": "lab/qwen", "top_k": 5, "temperature": 1}), 100))
    assert sent == {"model": "qwen", "temperature": 0.2}


def test_the_priority_in_the_body_field_the_peer_reads():
    body = {"model": "qwen", "messages": []}
    vllm = CatalogPeer("lab", "http://x", models=("qwen",), priority_forward="vllm")
    assert json.loads(peers.body_for(vllm, _route("qwen"), _parsed(body), 100))["priority"] == -100
    tier = CatalogPeer("lab", "http://x", models=("qwen",), priority_forward="service_tier")
    assert [json.loads(peers.body_for(tier, _route("qwen"), _parsed(body), p))["service_tier"]
            for p in (150, 0, -100)] == ["priority", "default", "flex"]
    own = {**body, "service_tier": "auto"}  # the client's own field is theirs
    assert json.loads(peers.body_for(tier, _route("qwen"), _parsed(own), 150))[
        "service_tier"] == "auto"
    for mode in ("header", "none"):
        sent = peers.body_for(CatalogPeer("lab", "http://x", models=("qwen",),
                                          priority_forward=mode), _route("qwen"),
                              _parsed(body), 100)
        assert json.loads(sent) == body


def _client_headers() -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {CLIENT_KEY}".encode()),
            (b"x-api-key", b"the-clients-other-credential"), (b"cookie", b"sessionid=abc"),
            (b"x-llamaswap-priority", b"999999"), (b"x-llamaswap-arrived", b"1"),
            (b"content-type", b"application/json"), (b"connection", b"keep-alive")]


def _drop() -> frozenset[bytes]:
    from gpuproxy.proxy.auth import credential_drop
    return credential_drop(dict(_client_headers()), CLIENT_KEY)


def test_with_an_api_key_the_peer_gets_its_key_in_both_headers_and_nothing_of_the_clients():
    peer = CatalogPeer("lab", "http://x", api_key=PEER_KEY, models=("qwen",))
    out = peers.headers_for(peer, _client_headers(), _drop(), 12, 150, 1700000000.25)
    assert out == [(b"content-type", b"application/json"), (b"content-length", b"12"),
                   (b"x-gpuproxy-forwarded", b"1"),
                   (b"authorization", f"Bearer {PEER_KEY}".encode()),
                   (b"x-api-key", PEER_KEY.encode()),
                   (b"x-llamaswap-priority", b"150"),
                   (b"x-llamaswap-arrived", b"1700000000.250")]


def test_without_an_api_key_only_our_own_key_is_held_back():
    """llama-swap passes the client's headers as they are when the peer has no apiKey, its
    own key included; ours stays here, another credential the client sent goes on."""
    peer = CatalogPeer("lab", "http://x", models=("qwen",), priority_forward="none")
    out = dict(peers.headers_for(peer, _client_headers(), _drop(), 2, 150, 0.0))
    assert out == {b"x-api-key": b"the-clients-other-credential",
                   b"content-type": b"application/json", b"content-length": b"2",
                   b"x-gpuproxy-forwarded": b"1"}


def test_messages_name_the_host_never_a_password_in_the_url():
    """The config refuses a user or password in a peer's URL; one that got into a catalog
    anyway shows nowhere, is not sent (the client library raised ValueError, a 500, beside
    the peer's Authorization), and no repr prints the peer's key."""
    peer = CatalogPeer("lab", "https://user:s3cret@gpu.example:8443/base", api_key=PEER_KEY,
                       models=("m",))
    assert peers.host_of(peer) == "gpu.example:8443"
    assert peers.url(peer, "/v1/chat/completions", b"a=1") == (
        "https://gpu.example:8443/base/v1/chat/completions?a=1")
    assert PEER_KEY not in repr(peer)


# ---- pure: the carried arrival ---------------------------------------------------------------

def test_a_carried_arrival_is_an_age_clamped_to_a_day():
    now = 1_800_000_000.0
    assert urgency.carried_age(b"1799999990.5", now) == 9.5
    assert urgency.carried_age(b"1800000100", now) == 0.0  # the peer's clock is ahead
    assert urgency.carried_age(b"1", now) == 24 * 3600
    for junk in (None, b"", b"soon", b"nan", b"inf", b"-inf"):
        assert urgency.carried_age(junk, now) == 0.0


def test_only_a_trusted_peer_key_is_believed():
    catalog = Catalog(api_keys={sha(TRUSTED_KEY): "entry", sha(CLIENT_KEY): "alice"},
                      trusted_peer_keys=frozenset({sha(TRUSTED_KEY)}))
    assert urgency.from_trusted_peer({b"authorization": f"Bearer {TRUSTED_KEY}".encode()},
                                     catalog)
    assert urgency.from_trusted_peer({b"x-api-key": TRUSTED_KEY.encode()}, catalog)
    assert not urgency.from_trusted_peer(
        {b"authorization": f"Bearer {CLIENT_KEY}".encode()}, catalog)
    assert not urgency.from_trusted_peer({}, catalog)
    arrived = f"{time.time() - 30:.3f}".encode()
    assert urgency.age({b"authorization": f"Bearer {CLIENT_KEY}".encode(),
                        urgency.ARRIVED_HEADER: arrived}, catalog) == 0.0
    assert 29 < urgency.age({b"authorization": f"Bearer {TRUSTED_KEY}".encode(),
                             urgency.ARRIVED_HEADER: arrived}, catalog) < 60
    no_keys = Catalog(trusted_peer_keys=frozenset({sha(TRUSTED_KEY)}))
    assert not urgency.from_trusted_peer({b"x-api-key": TRUSTED_KEY.encode()}, no_keys)


# ---- the real application, with peers that are raw servers -----------------------------------

class FakePeer:
    """An HTTP/1.1 server that keeps what it received and answers with `behave`."""

    def __init__(self, behave: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.behave = behave
        self.requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = []
        self.arrived = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakePeer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for h in lines:
                if h:
                    k, _, v = h.partition(":")
                    headers[k.strip().lower().encode()] = v.strip().encode()
            body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
            self.requests.append((line.encode(), headers, body))
            self.arrived.set()
            await self.behave(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def answer_json(writer: asyncio.StreamWriter) -> None:
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": [],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nServer: peerd\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()


async def answer_stream(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    for event in (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"):
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def close_at_once(writer: asyncio.StreamWriter) -> None:
    return None  # FakePeer closes the connection


async def hang(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


async def cut_stream(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    event = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
    await writer.drain()


pytestmark_db = pytest.mark.django_db(transaction=True)


async def _runtime(port: int, extra: str = "") -> None:
    await runtime_on(f"""
models: {{}}
apiKeys: ["{CLIENT_KEY}"]
apiKeyHashes:
  - {{name: entry-node, sha256: {sha(TRUSTED_KEY)}, peer: true}}
peers:
  lab:
    proxy: http://127.0.0.1:{port}/base
    apiKey: {PEER_KEY}
    models: [qwen]
    filters:
      setParams: {{temperature: 0.1}}
    timeouts:
      responseHeader: 1
{extra}
""")


async def call(body: dict, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, bytes]:
    comm = chat_communicator(headers)
    await comm.send_input({"type": "http.request", "body": json.dumps(body).encode(),
                           "more_body": False})
    start = await comm.receive_output(30)
    chunks = []
    while True:
        message = await comm.receive_output(30)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(5)
    return start["status"], dict(start["headers"]), b"".join(chunks)


def _bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


@pytestmark_db
async def test_a_peer_model_is_forwarded_with_the_peers_key_and_its_answer_relayed():
    async with FakePeer(answer_json) as peer:
        await _runtime(peer.port)
        try:
            status, headers, body = await call(
                {"model": "lab/qwen", "messages": [{"role": "user", "content": "x"}]},
                [*_bearer(CLIENT_KEY), (b"x-llamaswap-priority", b"interactive")])
        finally:
            await runtime.shutdown()
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    assert b"server" not in headers  # the peer's Server is not the client's business
    [(line, got, sent)] = peer.requests
    assert line == b"POST /base/v1/chat/completions HTTP/1.1"
    assert json.loads(sent) == {"model": "qwen", "temperature": 0.1,
                                "messages": [{"role": "user", "content": "x"}]}
    assert got[b"authorization"] == f"Bearer {PEER_KEY}".encode()
    assert got[b"x-api-key"] == PEER_KEY.encode()
    assert got[b"x-llamaswap-priority"] == b"100"
    assert abs(float(got[b"x-llamaswap-arrived"]) - time.time()) < 30
    assert CLIENT_KEY.encode() not in b"".join(k + v for k, v in got.items()) + sent


@pytestmark_db
async def test_a_stream_is_relayed_as_it_comes():
    async with FakePeer(answer_stream) as peer:
        await _runtime(peer.port)
        try:
            status, headers, body = await call({"model": "qwen", "stream": True},
                                               _bearer(CLIENT_KEY))
        finally:
            await runtime.shutdown()
    assert status == 200
    assert headers[b"x-accel-buffering"] == b"no"
    assert body == (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
                    b"data: [DONE]\n\n")


@pytestmark_db
async def test_a_peer_that_sends_no_head_within_response_header_is_a_504_naming_it():
    async with FakePeer(hang) as peer:
        await _runtime(peer.port)
        try:
            started = time.monotonic()
            status, _, body = await call({"model": "lab/qwen"}, _bearer(CLIENT_KEY))
            took = time.monotonic() - started
        finally:
            await runtime.shutdown()
    assert status == 504, body
    error = json.loads(body)["error"]
    assert error["code"] == "peer_timeout"
    assert f"peer 'lab' at 127.0.0.1:{peer.port}" in error["message"]
    assert "responseHeader" in error["message"]
    assert PEER_KEY not in body.decode()
    assert 0.9 < took < 10


@pytestmark_db
async def test_a_peer_that_closes_or_refuses_is_a_502_naming_it_never_its_key():
    async with FakePeer(close_at_once) as peer:
        await _runtime(peer.port)
        try:
            status, _, body = await call({"model": "lab/qwen"}, _bearer(CLIENT_KEY))
        finally:
            await runtime.shutdown()
    assert status == 502, body
    error = json.loads(body)["error"]
    assert error["code"] == "peer_error"
    assert f"peer 'lab' at 127.0.0.1:{peer.port} closed the connection" in error["message"]
    assert PEER_KEY not in body.decode()
    # the same port, nothing listening now
    await _runtime(peer.port)
    try:
        status, _, body = await call({"model": "lab/qwen"}, _bearer(CLIENT_KEY))
    finally:
        await runtime.shutdown()
    assert status == 502, body
    assert json.loads(body)["error"]["code"] == "peer_unreachable"


@pytestmark_db
async def test_a_stream_the_peer_cuts_ends_with_an_error_event_never_done():
    async with FakePeer(cut_stream) as peer:
        await _runtime(peer.port)
        try:
            status, _, body = await call({"model": "lab/qwen", "stream": True},
                                         _bearer(CLIENT_KEY))
        finally:
            await runtime.shutdown()
    assert status == 200
    assert body.startswith(b'data: {"choices"')
    assert b"[DONE]" not in body
    last = json.loads(body.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "peer_error"
    assert "peer 'lab'" in last["error"]["message"]


@pytestmark_db
async def test_what_a_trusted_peer_sent_goes_no_further_than_here():
    async with FakePeer(answer_json) as peer:
        await _runtime(peer.port)
        try:
            status, _, body = await call({"model": "lab/qwen"}, _bearer(TRUSTED_KEY))
        finally:
            await runtime.shutdown()
    assert status == 404, body
    assert "at most one hop" in json.loads(body)["error"]["message"]
    assert peer.requests == []


@pytestmark_db
async def test_what_another_gpuproxy_forwarded_goes_no_further_even_untrusted():
    """Two nodes that list each other's models and trust neither key would pass a request
    back and forth: the hop mark every forward carries stops it at the second."""
    async with FakePeer(answer_json) as peer:
        await _runtime(peer.port)
        try:
            status, _, body = await call({"model": "lab/qwen"},
                                         [*_bearer(CLIENT_KEY), (b"x-gpuproxy-forwarded", b"1")])
        finally:
            await runtime.shutdown()
    assert status == 404, body
    assert "at most one hop" in json.loads(body)["error"]["message"]
    assert peer.requests == []


@pytestmark_db
async def test_a_selectors_pick_on_a_peer_is_forwarded_as_the_peers_model():
    """A selector whose target is a peer's model: the scheduler grants it at once, and the
    request goes to the peer as a by-name one would (its model, its filters, its key)."""
    async with FakePeer(answer_json) as peer:
        await _runtime(peer.port, """
selectors:
  planner:
    strategy: pin
    targets: [lab/qwen]
""")
        try:
            status, _, body = await call({"model": "planner"}, _bearer(CLIENT_KEY))
            refused, _, _ = await call({"model": "planner"}, _bearer(TRUSTED_KEY))
        finally:
            await runtime.shutdown()
    assert status == 200, body
    [(_, got, sent)] = peer.requests  # the trusted peer's went no further
    assert json.loads(sent) == {"model": "qwen", "temperature": 0.1}
    assert got[b"authorization"] == f"Bearer {PEER_KEY}".encode()
    assert refused == 404


@pytestmark_db
async def test_without_an_api_key_the_clients_key_for_us_still_never_reaches_the_peer():
    """llama-swap would pass it on; here it is held back whichever header carried it."""
    async with FakePeer(answer_json) as peer:
        await _runtime(peer.port, f"""
  open:
    proxy: http://127.0.0.1:{peer.port}
    models: [llama]
""")
        try:
            for headers in (_bearer(CLIENT_KEY), [(b"x-api-key", CLIENT_KEY.encode())]):
                status, _, body = await call({"model": "llama"}, headers)
                assert status == 200, body
        finally:
            await runtime.shutdown()
    assert len(peer.requests) == 2
    for _, got, sent in peer.requests:
        assert b"authorization" not in got and b"x-api-key" not in got
        assert CLIENT_KEY.encode() not in b"".join(k + v for k, v in got.items()) + sent


class ClosesReused(FakePeer):
    """Keeps a connection open after its first answer, and closes it unanswered when the
    next request comes on it: what a server does to a keep-alive connection it has just
    timed out."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append((head.split(b"\r\n")[0], {}, body))
                if n == 1:
                    return
                await answer_json(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytestmark_db
async def test_a_reused_connection_the_peer_closed_unread_is_sent_once_more_fresh():
    async with ClosesReused(answer_json) as peer:
        await _runtime(peer.port)
        try:
            statuses = [(await call({"model": "lab/qwen"}, _bearer(CLIENT_KEY)))[0]
                        for _ in range(2)]
        finally:
            await runtime.shutdown()
    assert statuses == [200, 200]
    assert len(peer.requests) == 3  # the second was sent twice
