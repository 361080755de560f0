"""gpuproxy.testing.fakellm, the fake upstream: a real subprocess on a free port, real sockets,
no mocks.

Everything else (proxy tests, benchmarks, the example config) trusts this server's behaviour,
so each promise it makes is pinned here: load delay, failure modes, signal handling, the
OpenAI/llama.cpp response shapes (checked with the real `openai` client) and the HTTP framing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 10.0


class FakeProcess:
    """A running `python -m gpuproxy.testing.fakellm` whose output lines can be awaited as
    events."""

    def __init__(self, port: int, args: tuple[str, ...]) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(port), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._closed: set[str] = set()
        self._cond = threading.Condition()
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            threading.Thread(target=self._pump, args=(name, stream), daemon=True).start()

    def _pump(self, name: str, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                self.lines[name].append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._closed.add(name)
            self._cond.notify_all()

    def wait_line(self, text: str, stream: str = "stdout", timeout: float = DEADLINE) -> str:
        """The first output line containing `text`, waiting for it to be printed."""

        def found() -> str | None:
            return next((line for line in self.lines[stream] if text in line), None)

        with self._cond:
            self._cond.wait_for(lambda: found() is not None or stream in self._closed, timeout)
            line = found()
        assert line is not None, f"no {text!r} on {stream}; got {self.lines}"
        return line

    def wait_ready(self) -> None:
        """Poll /health (with a deadline) until the model is loaded."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"fakellm exited: {self.lines}"
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise AssertionError("fakellm never became healthy")

    def wait_exit(self, timeout: float = DEADLINE) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(DEADLINE)


@pytest.fixture
def start_fake(port: int) -> Iterator[Callable[..., FakeProcess]]:
    """Start fakellm processes on the test's free port; every one is killed at teardown."""
    started: list[FakeProcess] = []

    def start(*args: str, ready: bool = True) -> FakeProcess:
        fake = FakeProcess(port, args)
        started.append(fake)
        if ready:
            fake.wait_ready()
        return fake

    yield start
    for fake in started:
        fake.stop()


def oai(fake: FakeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake.base}/v1", api_key="x", max_retries=0, timeout=DEADLINE)


def expected_text(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def slots(fake: FakeProcess) -> list[dict[str, object]]:
    return httpx.get(f"{fake.base}/slots").json()


def read_response(f: object) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response from a socket file: status, lower-cased headers, body."""
    status_line = f.readline()  # type: ignore[attr-defined]
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):  # type: ignore[attr-defined]
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = f.read(int(headers.get("content-length", 0)))  # type: ignore[attr-defined]
    return status, headers, body


# ------------------------------------------------------------------------- start-up


def test_health_is_503_while_loading_then_200(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--load-seconds", "0.5", "--model", "slowpoke", ready=False)
    fake.wait_line("fakellm: model slowpoke listening on http://127.0.0.1:")
    started = time.monotonic()
    loading = httpx.get(f"{fake.base}/health")
    assert loading.status_code == 503
    assert loading.json()["error"] == {
        "code": 503,
        "message": "Loading model",
        "type": "unavailable_error",
    }
    assert loading.headers["x-fake-served-by"] == f"slowpoke:{fake.port}"
    chat = httpx.post(f"{fake.base}/v1/chat/completions", json={"messages": []})
    assert chat.status_code == 503
    fake.wait_ready()
    assert time.monotonic() - started >= 0.3
    assert httpx.get(f"{fake.base}/health").json() == {"status": "ok", "model": "slowpoke"}
    assert "fakellm: model slowpoke loaded in 0.5 s" in fake.wait_line("loaded in")


def test_busy_port_exits_1_like_llama_server(
    start_fake: Callable[..., FakeProcess], port: int
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        fake = start_fake(ready=False)
        assert fake.wait_exit() == 1
    line = fake.wait_line("cannot listen", stream="stderr")
    assert line == f"fakellm: cannot listen on 127.0.0.1:{port}: address already in use"


def test_exit_on_start(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--exit-on-start", "7", "--model", "doomed", ready=False)
    assert fake.wait_exit() == 7
    fake.wait_line("fakellm: model doomed listening on")
    fake.wait_line("fakellm: simulated start failure for model doomed", stream="stderr")


def test_sigterm_exits_0_promptly_even_mid_stream(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--tps", "20")
    with httpx.stream(
        "POST",
        f"{fake.base}/v1/chat/completions",
        json={"messages": [], "max_tokens": 1000, "stream": True},
    ) as response:
        next(response.iter_lines())  # a generation is running
        fake.proc.send_signal(signal.SIGTERM)
        assert fake.wait_exit(timeout=3) == 0
    fake.wait_line("fakellm: SIGTERM, exiting")


def test_ignore_sigterm_survives_sigterm_but_not_sigkill(
    start_fake: Callable[..., FakeProcess],
) -> None:
    fake = start_fake("--ignore-sigterm")
    fake.proc.send_signal(signal.SIGTERM)
    fake.wait_line("SIGTERM ignored")
    assert httpx.get(f"{fake.base}/health").status_code == 200
    assert fake.proc.poll() is None
    fake.proc.kill()
    assert fake.wait_exit() == -signal.SIGKILL


# ------------------------------------------------------------------------- endpoints


def test_chat_non_stream(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--model", "m1")
    response = httpx.post(
        f"{fake.base}/v1/chat/completions",
        json={
            "model": "whatever",
            "max_tokens": 5,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello big world"}]},
            ],
        },
    )
    assert response.status_code == 200
    assert response.headers["x-fake-served-by"] == f"m1:{fake.port}"
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"
    assert body["system_fingerprint"] == f"fakellm:m1:{fake.port}"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected_text(5)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    timings = body["timings"]
    assert timings["prompt_n"] == 5
    assert timings["predicted_n"] == 5
    assert timings["cache_n"] == 0
    for key in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"):
        assert isinstance(timings[key], float)


def test_chat_stream_with_openai_client(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--model", "streamer")
    chunks = list(
        oai(fake).chat.completions.create(
            model="streamer",
            messages=[{"role": "user", "content": "one two three"}],
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(6)
    assert {c.model for c in chunks} == {"streamer"}
    assert {c.system_fingerprint for c in chunks} == {f"fakellm:streamer:{fake.port}"}
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 6)
    assert final.usage.total_tokens == 9
    timings = (final.model_extra or {})["timings"]
    assert timings["predicted_n"] == 6
    assert timings["prompt_n"] == 3


def test_chat_default_max_tokens_and_n_predict(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake()
    client = oai(fake)
    default = client.chat.completions.create(model="fake", messages=[])
    assert default.choices[0].message.content == expected_text(16)
    assert default.usage is not None and default.usage.prompt_tokens == 1  # min 1
    n_predict = client.chat.completions.create(
        model="fake", messages=[], extra_body={"n_predict": 2}
    )
    assert n_predict.choices[0].message.content == expected_text(2)


def test_completions_stream_and_non_stream(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake()
    client = oai(fake)
    chunks = list(
        client.completions.create(model="fake", prompt="a b c d", max_tokens=4, stream=True)
    )
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in chunks) == expected_text(4)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 4)
    plain = client.completions.create(model="fake", prompt="a b", max_tokens=3)
    assert plain.choices[0].text == expected_text(3)
    assert plain.usage is not None and plain.usage.total_tokens == 5
    assert (plain.model_extra or {})["timings"]["predicted_n"] == 3


def test_models(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--model", "listed")
    assert [m.id for m in oai(fake).models.list()] == ["listed"]
    data = httpx.get(f"{fake.base}/v1/models").json()["data"]
    assert data[0]["object"] == "model"
    assert data[0]["owned_by"] == "fakellm"


def test_embeddings(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--model", "emb")
    result = oai(fake).embeddings.create(model="emb", input=["alpha", "beta gamma"])
    assert result.model == "emb"
    assert [d.index for d in result.data] == [0, 1]
    vectors = [d.embedding for d in result.data]
    assert all(len(v) == 8 and all(isinstance(x, float) for x in v) for v in vectors)
    assert vectors[0] != vectors[1]
    assert result.usage.prompt_tokens == 3
    # the client asked for base64 float32; plain JSON floats carry the same (deterministic) vector
    single = httpx.post(f"{fake.base}/v1/embeddings", json={"input": "alpha"}).json()
    assert single["data"][0]["embedding"] == pytest.approx(vectors[0], abs=1e-6)
    assert single["object"] == "list"


def test_rerank_on_all_its_paths(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--model", "rr")
    request = {"query": "red apple", "documents": ["a red apple", "a blue sky", "apple pie"]}
    answers = [
        httpx.post(f"{fake.base}{path}", json=request).json()
        for path in ("/v1/rerank", "/rerank", "/v1/reranking")
    ]
    assert answers[0] == answers[1] == answers[2]
    body = answers[0]
    assert body["model"] == "rr"
    assert [r["index"] for r in body["results"]] == [0, 1, 2]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores[0] > scores[2] > scores[1]
    assert body["usage"]["prompt_tokens"] > 0


def test_errors(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake()
    missing = httpx.get(f"{fake.base}/v2/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert missing.json()["error"]["code"] == 404
    assert missing.headers["x-fake-served-by"] == f"fake:{fake.port}"
    malformed = httpx.post(
        f"{fake.base}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == 400
    assert httpx.get(f"{fake.base}/v1/chat/completions").status_code == 405
    assert httpx.post(f"{fake.base}/health").status_code == 405
    bad_tokens = httpx.post(
        f"{fake.base}/v1/chat/completions", json={"messages": [], "max_tokens": "x"}
    )
    assert bad_tokens.status_code == 400
    # errors do not poison the server
    assert httpx.get(f"{fake.base}/health").status_code == 200


# ------------------------------------------------------------------------- misbehaviour


def test_crash_after_2_streaming(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--crash-after", "2")
    first = httpx.post(f"{fake.base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert first.status_code == 200
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST",
            f"{fake.base}/v1/chat/completions",
            json={"messages": [], "max_tokens": 8, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        received.extend(line for line in response.iter_lines() if line)
    assert fake.wait_exit() == 3
    assert [json.loads(line[6:])["choices"][0]["delta"].get("content") for line in received] == [
        "",
        "tok0 ",
        "tok1 ",
        "tok2 ",
        "tok3 ",
    ]
    fake.wait_line("simulated crash")


def test_crash_after_1_non_streaming(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--crash-after", "1")
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{fake.base}/v1/embeddings", json={"input": "x"})
    assert fake.wait_exit() == 3


def test_hold_header_and_body_field(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake()
    started = time.monotonic()
    held = httpx.get(f"{fake.base}/health", headers={"X-Fake-Hold": "0.3"})
    assert held.status_code == 200
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    answer = oai(fake).chat.completions.create(
        model="fake", messages=[], max_tokens=1, extra_body={"fake_hold": 0.3}
    )
    assert time.monotonic() - started >= 0.3
    assert answer.choices[0].message.content == "tok0 "


def test_gate_holds_until_opened_and_notices_a_client_that_left(
    start_fake: Callable[..., FakeProcess],
) -> None:
    fake = start_fake()
    gated = _open_stream(fake, "X-Fake-Gate: g1\r\n")
    left = _open_stream(fake, "X-Fake-Gate: never\r\n")
    deadline = time.monotonic() + DEADLINE
    while [s["is_processing"] for s in slots(fake)] != [True, True]:
        assert time.monotonic() < deadline, slots(fake)
        time.sleep(0.01)
    left.close()
    fake.wait_line("client went away after 0 tokens")
    gated.settimeout(0.3)
    with pytest.raises(TimeoutError):
        gated.recv(1)  # still held: not a byte until the gate opens
    opened = httpx.post(f"{fake.base}/fake/gates/open", json={"gate": "g1"})
    assert opened.json() == {"gate": "g1", "open": True}
    gated.settimeout(DEADLINE)
    assert gated.recv(65536).startswith(b"HTTP/1.1 200")
    gated.close()
    assert httpx.post(f"{fake.base}/fake/gates/open", json={}).status_code == 400


def test_tps_paces_tokens(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake("--tps", "40")
    started = time.monotonic()
    answer = oai(fake).chat.completions.create(model="fake", messages=[], max_tokens=8)
    assert time.monotonic() - started >= 0.19  # 8 tokens at 40/s
    assert (answer.model_extra or {})["timings"]["predicted_ms"] >= 190


def _open_stream(fake: FakeProcess, extra_headers: str = "") -> socket.socket:
    body = json.dumps({"messages": [], "max_tokens": 100000, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", fake.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra_headers.encode()
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    return sock


def test_slots_busy_while_streaming_idle_after_client_disconnects(
    start_fake: Callable[..., FakeProcess],
) -> None:
    fake = start_fake("--tps", "50")
    assert slots(fake) == [{"id": 0, "is_processing": False}]
    sock = _open_stream(fake)
    seen = b""
    while b"tok1 " not in seen:
        chunk = sock.recv(65536)
        assert chunk
        seen += chunk
    assert slots(fake) == [{"id": 0, "is_processing": True}]
    sock.close()
    line = fake.wait_line("client went away after")
    assert 2 <= int(line.split()[-2]) < 100000
    assert slots(fake) == [{"id": 0, "is_processing": False}]


def test_slots_busy_while_held_and_two_generations_use_two_slots(
    start_fake: Callable[..., FakeProcess],
) -> None:
    fake = start_fake()
    held = _open_stream(fake, "X-Fake-Hold: 30\r\n")
    slow = _open_stream(fake, "X-Fake-Hold: 30\r\n")
    deadline = time.monotonic() + DEADLINE
    while slots(fake) != [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": True}]:
        assert time.monotonic() < deadline, slots(fake)
        time.sleep(0.01)
    held.close()
    fake.wait_line("client went away after 0 tokens")
    assert slots(fake) == [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": True}]
    slow.close()
    deadline = time.monotonic() + DEADLINE
    while any(s["is_processing"] for s in slots(fake)):
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ------------------------------------------------------------------------- HTTP framing


def test_keep_alive_expect_continue_and_connection_close(
    start_fake: Callable[..., FakeProcess],
) -> None:
    fake = start_fake()
    with socket.create_connection(("127.0.0.1", fake.port)) as sock:
        f = sock.makefile("rb")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(f)[0] == 200
        body = b'{"input": "x"}'
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert f.readline() == b"\r\n"
        sock.sendall(body)
        status, _, payload = read_response(f)
        assert status == 200
        assert json.loads(payload)["data"][0]["index"] == 0
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = read_response(f)
        assert (status, headers["connection"]) == (200, "close")
        assert f.read() == b""  # the server closed the connection


async def test_hundreds_of_concurrent_streams(start_fake: Callable[..., FakeProcess]) -> None:
    fake = start_fake()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        request = {"prompt": str(i), "max_tokens": 16, "stream": True}
        text = ""
        async with client.stream("POST", "/v1/completions", json=request) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async with httpx.AsyncClient(base_url=fake.base, limits=limits, timeout=DEADLINE) as client:
        texts = await asyncio.gather(*(one(client, i) for i in range(200)))
    assert set(texts) == {expected_text(16)}
