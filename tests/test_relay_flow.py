"""The upstream client's flow control, against a real fake server (`gpuproxy/upstream/relay.py`).

aiohttp's body reader asks its protocol to resume reading for every buffered piece it hands
out, paused or not, and an unpaused resume feeds the HTTP parser an empty string: for an SSE
upstream, one HTTP chunk per event, that was a parser call per token for nothing (about 5 % of
the proxy's CPU per SSE chunk at c=32, BENCHMARKS.md). `relay._Handler` resumes only what was
paused, and, once it has paused, everything as aiohttp does. These tests hold all three: nothing
resumed on a connection that never paused, a reader too slow for its upstream still pauses it
and gets every byte once it catches up, and a pause aiohttp's parser outlives (a review found
it) does not hold back the end of an answer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from gpuproxy.upstream import relay
from tests.conftest import free_port
from tests.helpers import until


@pytest.fixture
def upstream() -> Iterator[str]:
    """A fake llama-server of its own: its chat completions URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuproxy.testing.fakellm", "--port",
                             str(port), "--model", "m"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1,
                             trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    until("the fake upstream answers /health", healthy)
    yield f"http://127.0.0.1:{port}/v1/chat/completions"
    proc.kill()
    proc.wait(10)


@dataclass
class Calls:
    empty_feeds: int = 0  # the parser fed b"" (a resume)
    pauses: int = 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """What the connections' protocol was asked to do, counted on its class."""
    seen = Calls()
    feed, pause = relay._Handler.data_received, relay._Handler.pause_reading

    def data_received(self, data: bytes) -> None:
        seen.empty_feeds += not data
        feed(self, data)

    def pause_reading(self) -> None:
        seen.pauses += 1
        pause(self)

    monkeypatch.setattr(relay._Handler, "data_received", data_received)
    monkeypatch.setattr(relay._Handler, "pause_reading", pause_reading)
    return seen


async def ask(url: str, **body: object) -> httpx.Response:
    data = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       **body}).encode()
    return await relay.send("POST", url, [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(data)).encode())],
                            data, 30)


async def test_a_stream_feeds_the_parser_only_what_arrived(upstream, calls):
    response = await ask(upstream, max_tokens=200, stream=True)
    try:
        body = b"".join([chunk async for chunk in response.stream])  # type: ignore[union-attr]
    finally:
        await response.aclose()
        await relay.close()
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"\n\ndata: ") >= 200
    assert calls.empty_feeds == 0


async def test_a_slow_reader_pauses_its_upstream_and_still_gets_every_byte(upstream, calls):
    response = await ask(upstream, max_tokens=100_000)
    got = bytearray()
    try:
        async with asyncio.timeout(30):  # a reading never resumed would wait forever
            async for chunk in response.stream:  # type: ignore[union-attr]
                got += chunk
                await asyncio.sleep(0.002)  # slower than the upstream writes
    finally:
        await response.aclose()
        await relay.close()
    assert len(got) == int(response.headers["content-length"]) > 500_000
    assert json.loads(got)["usage"]["completion_tokens"] == 100_000
    assert calls.pauses >= 1


class _Transport(asyncio.Transport):
    """Just enough of a socket transport for a protocol fed by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        pass

    def close(self) -> None:
        pass


async def test_a_pause_at_a_chunks_end_still_lets_the_rest_through():
    """The case that resuming only a paused connection must not break (a review found it):
    aiohttp pauses a connection that has buffered too many HTTP chunks unread, from the
    callback at a chunk's end. When the bytes read end right there, the compiled parser's
    own pause flag outlives the resume, and stops the parser at the first body bytes of the
    next read: only another empty feed restarts it, which aiohttp's reader gives on every
    piece it hands out. Without it the end of this answer waits for bytes that never come."""
    protocol = relay._Handler(asyncio.get_running_loop())
    protocol.connection_made(_Transport())
    protocol.set_response_params(read_bufsize=2**16)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    over = 2**16 // 16 + 1  # aiohttp's StreamReader pauses past limit // 16 chunks unread
    protocol.data_received(head + b"1\r\nx\r\n" * over)  # ends on the pausing chunk's end
    _message, payload = await protocol.read()
    assert protocol._reading_paused  # the chunk-count pause happened
    async with asyncio.timeout(5):
        first = await payload.read(over)  # drained: resumed
        protocol.data_received(b"1\r\ny\r\n" * 3 + b"0\r\n\r\n")
        rest = await payload.read()
    assert (first, rest) == (b"x" * over, b"yyy")
