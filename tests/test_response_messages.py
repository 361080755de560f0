"""What the proxy hands its ASGI server for an answer: as few messages as the answer allows.

Each `send` to Daphne costs the proxy a message, a Twisted write and a reactor turn, so the
relay ends a body the moment it has the last byte its `Content-Length` announced, instead of
sending one more empty message to say so (BENCHMARKS.md, "Speed"). Where the length is not
known (chunked, SSE) the end is the empty message, as before. Real fake upstreams, real
PostgreSQL, the real ASGI application."""

from __future__ import annotations

import json

import pytest

from gpuproxy.shell import runtime
from tests.conftest import FAKE, free_port
from tests.helpers import chat_communicator, runtime_on

pytestmark = pytest.mark.django_db(transaction=True)

@pytest.fixture
async def rt():
    yield await runtime_on(f"""
startPort: {free_port()}
healthCheckTimeout: 15
models:
  alpha:
    cmd: {FAKE}
""")
    await runtime.shutdown()


async def answer(body: dict) -> list[dict]:
    """Every message the application sends for one chat request, until the response ends."""
    comm = chat_communicator()
    await comm.send_input({"type": "http.request", "body": json.dumps(body).encode(),
                           "more_body": False})
    messages = [await comm.receive_output(30)]
    while messages[-1]["type"] != "http.response.body" or messages[-1].get("more_body"):
        messages.append(await comm.receive_output(10))
    assert await comm.receive_nothing(0.2), "a message after the response's end"
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(5)
    return messages


def chat(**kw) -> dict:
    return {"model": "alpha", "messages": [{"role": "user", "content": "x"}], **kw}


async def test_a_json_answer_is_its_head_and_one_body_message_that_ends_it(rt):
    start, *bodies = await answer(chat(max_tokens=8))
    assert start["status"] == 200
    headers = {k.lower(): v for k, v in start["headers"]}
    assert len(bodies) == 1, [(len(b["body"]), b.get("more_body")) for b in bodies]
    [body] = bodies
    assert body["more_body"] is False
    assert len(body["body"]) == int(headers[b"content-length"])
    assert json.loads(body["body"])["usage"]["completion_tokens"] == 8


async def test_a_stream_still_ends_with_its_own_empty_message(rt):
    start, *bodies = await answer(chat(max_tokens=5, stream=True))
    assert start["status"] == 200
    assert b"content-length" not in {k.lower() for k, _ in start["headers"]}
    *events, end = bodies
    assert (end["body"], end["more_body"]) == (b"", False)
    assert all(b["more_body"] for b in events)
    assert b"".join(b["body"] for b in events).endswith(b"data: [DONE]\n\n")
