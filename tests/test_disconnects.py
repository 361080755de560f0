"""Every window in which a client can leave, in-process through the real ASGI application.

Channels' ApplicationCommunicator lets the test send `http.disconnect` at an exact moment; the
upstreams are real fake-server processes, the database is real PostgreSQL. Each test asserts
that the scheduler saw the request end (Cancelled or ServeDone), that the upstream was told
(it logs "client went away"), and that the slot was freed.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest
from channels.testing import ApplicationCommunicator

from gpuproxy.shell import runtime
from gpuproxy.upstream.logbuffer import registry as logs
from scheduling.core.events import Cancelled, RequestArrived, ServeDone, SwapDone
from tests import helpers
from tests.conftest import FAKE, free_port

pytestmark = pytest.mark.django_db(transaction=True)



def config(start: int) -> str:
    return f"""
startPort: {start}
healthCheckTimeout: 15
models:
  alpha:
    cmd: {FAKE} --tps 20
  beta:
    cmd: {FAKE} --load-seconds 1.5
groups:
  pair:
    swap: true
    members: [alpha, beta]
"""


@pytest.fixture
async def rt():
    r = await helpers.runtime_on(config(free_port()))
    r.run_loop.processed = asyncio.Queue()
    yield r
    await runtime.shutdown()


async def until(rt: runtime.Runtime, kind: type, within: float = 20):
    """The next processed event of `kind` (events of other kinds are skipped)."""
    async with asyncio.timeout(within):
        while True:
            ev = await rt.run_loop.processed.get()
            if isinstance(ev, kind):
                return ev


async def upstream_said(model: str, text: str, within: float = 10) -> str:
    buf = logs.get(model)
    with buf.subscribe() as queue:
        for line in buf.history():
            if text in line:
                return line
        async with asyncio.timeout(within):
            while True:
                line = await queue.get()
                if text in line:
                    return line


def request(body: dict, headers: list | None = None) -> ApplicationCommunicator:
    return helpers.chat_communicator(headers)


async def send(comm: ApplicationCommunicator, body: dict) -> None:
    await comm.send_input({"type": "http.request", "body": json.dumps(body).encode(),
                           "more_body": False})


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "x"}], **kw}


async def open_gate(rt: runtime.Runtime, model: str, gate: str) -> None:
    """helpers.open_gate, off the event loop this test shares with the proxy."""
    port = urlsplit(rt.upstreams.existing(model).spec.proxy).port
    await asyncio.to_thread(helpers.open_gate, port, gate)


def assert_free(rt: runtime.Runtime, model: str) -> None:
    s = rt.run_loop.scheduler
    assert s.in_flight(model) == 0
    assert s.reserved(model) == 0
    assert s.queued() == []


async def test_disconnect_mid_stream(rt):
    comm = request({})
    await send(comm, chat("alpha", stream=True, max_tokens=200))
    start = await comm.receive_output(30)
    assert start["status"] == 200
    # The stream waits for alpha's load first, and says so at once (": waiting ..."
    # comments): leave only once the upstream's own answer has begun.
    first = await comm.receive_output(10)
    while first["body"].startswith(b":"):
        first = await comm.receive_output(10)
    assert first["body"].startswith(b"data: ")
    await comm.send_input({"type": "http.disconnect"})
    await until(rt, ServeDone)
    line = await upstream_said("alpha", "client went away")
    assert int(line.split("after ")[1].split()[0]) < 200
    assert_free(rt, "alpha")
    await comm.wait(5)


async def test_disconnect_before_first_byte(rt):
    comm = request({}, [(b"x-fake-hold", b"30")])
    await send(comm, chat("alpha", max_tokens=1))
    await until(rt, SwapDone)  # alpha loaded and the request granted
    await comm.send_input({"type": "http.disconnect"})
    await until(rt, ServeDone)
    await upstream_said("alpha", "client went away after 0 tokens")
    assert_free(rt, "alpha")
    await comm.wait(5)


async def test_disconnect_non_streaming_mid_generation(rt):
    comm = request({})
    await send(comm, chat("alpha", max_tokens=200))  # 10 s at 20 tok/s, sent at the end
    await until(rt, SwapDone)
    await comm.send_input({"type": "http.disconnect"})
    await until(rt, ServeDone)
    await upstream_said("alpha", "client went away")
    assert_free(rt, "alpha")
    await comm.wait(5)


async def test_disconnect_while_waiting_for_a_load(rt):
    comm = request({})
    await send(comm, chat("beta", max_tokens=1))  # beta takes 1.5 s to load
    await until(rt, RequestArrived)
    await comm.send_input({"type": "http.disconnect"})
    await until(rt, Cancelled)
    assert rt.run_loop.scheduler.reserved("beta") == 0
    done = await until(rt, SwapDone)  # the swap still completes (llama-swap parity)...
    assert done.model == "beta" and done.error is None
    assert_free(rt, "beta")  # ...and serves nobody
    await comm.wait(5)


async def test_disconnect_while_queued_never_loads(rt):
    """A queued client that leaves must never cause a load (beta would evict busy alpha)."""
    busy = request({}, [(b"x-fake-gate", b"busy")])  # in flight until the gate opens
    await send(busy, chat("alpha", max_tokens=1))
    await until(rt, SwapDone)
    queued = request({})
    await send(queued, chat("beta", max_tokens=1))
    await until(rt, RequestArrived)
    assert [r.model for r in rt.run_loop.scheduler.queued()] == ["beta"]
    await queued.send_input({"type": "http.disconnect"})
    await until(rt, Cancelled)
    assert rt.run_loop.scheduler.queued() == []
    await open_gate(rt, "alpha", "busy")
    start = await busy.receive_output(30)  # alpha's request completes normally
    assert start["status"] == 200
    await until(rt, ServeDone)
    assert rt.upstreams.existing("beta") is None  # beta was never started
    assert_free(rt, "alpha")
    await busy.send_input({"type": "http.disconnect"})
    await busy.wait(5)
    await queued.wait(5)


async def test_a_disconnect_before_the_request_task_runs_still_writes_its_row(rt):
    """The body's last chunk starts the request's task; a disconnect handled before that task
    takes its first step cancels a coroutine that never ran, and the row it would have made
    was never made. The consumer's handlers are called back to back here, as an ASGI server
    may deliver the two messages."""
    from activity.models import RequestLog
    from activity.writer import writer
    from gpuproxy.proxy.consumers import ProxyConsumer

    consumer = ProxyConsumer()
    consumer.scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions",
        "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    await consumer.http_request({"type": "http.request", "more_body": False,
                                 "body": json.dumps(chat("alpha")).encode()})
    await consumer.http_disconnect({"type": "http.disconnect"})
    assert await writer().flush(5), "the activity writer is stuck"
    rows = await runtime.run_db(lambda: list(RequestLog.objects.values_list(
        "path", "outcome", "status_code")))
    assert rows == [("/v1/chat/completions", "cancelled_queued", 499)]
