"""The run loop and the upstream processes, in-process, against the real fake server: the
scheduler hears of an exit as an event (ModelExited), the next request restarts the model, and
a storm of unloads against waiting loads wedges nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import pytest

from gpuproxy.shell.run_loop import RunLoop
from gpuproxy.shell.upstreams import Upstreams
from gpuproxy.upstream.states import State
from scheduling.catalog import Catalog, CatalogModel
from scheduling.core.errors import ShuttingDown, SwapFailed
from scheduling.core.events import Event, ModelExited, ServeDone
from scheduling.core.policies import make_scheduler
from scheduling.core.swapper import Group
from tests.conftest import free_port
from tests.test_process_escapes import no_leftovers
from tests.test_processes import DEADLINE, fake_spec, wait_for_state

__all__ = ["no_leftovers"]


@contextlib.asynccontextmanager
async def running(catalog: Catalog) -> AsyncIterator[RunLoop]:
    """A started run loop over `catalog`'s models, shut down (upstreams stopped) at the end."""

    async def load() -> Catalog:
        return catalog

    upstreams = Upstreams(load)
    await upstreams.refresh()
    loop = RunLoop(upstreams, catalog.scheduler_config(), make_scheduler)
    loop.processed = asyncio.Queue()
    loop.start()
    try:
        yield loop
    finally:
        await asyncio.wait_for(loop.shutdown(), DEADLINE)
        await asyncio.wait_for(upstreams.shutdown(), DEADLINE)


@pytest.fixture
async def run_loop(port: int) -> AsyncIterator[RunLoop]:
    async with running(Catalog(models={"fake": CatalogModel("fake", fake_spec(port))})) as loop:
        yield loop


async def next_of(queue: asyncio.Queue[Event], kind: type) -> Event:
    while not isinstance(event := await queue.get(), kind):
        pass
    return event


async def test_an_exit_reaches_the_scheduler_and_the_next_request_restarts(
        run_loop: RunLoop) -> None:
    grant = await asyncio.wait_for(run_loop.acquire("fake"), DEADLINE)
    proc = run_loop.upstreams.process("fake")
    first = proc.pid
    assert first is not None
    grant.release()
    assert run_loop.processed is not None

    os.kill(first, signal.SIGKILL)
    exited = await asyncio.wait_for(next_of(run_loop.processed, ModelExited), DEADLINE)

    assert exited.model == "fake"
    grant = await asyncio.wait_for(run_loop.acquire("fake"), DEADLINE)
    assert proc.pid is not None and proc.pid != first
    grant.release()


async def test_an_unload_storm_while_requests_wait_for_loads_wedges_nothing(
        run_loop: RunLoop) -> None:
    """C12: loads aborted by unloads answer their waiters with a clear error, every call
    ends, the scheduler ends empty, and the model still loads afterwards."""
    async def load() -> str:
        grant = await run_loop.acquire("fake")
        grant.release()
        return "served"

    calls: list[asyncio.Task] = []
    for i in range(60):
        calls.append(asyncio.create_task(load()))
        if i % 4 == 3:
            calls.append(asyncio.create_task(run_loop.unload(["fake"])))
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "no load was aborted: the storm missed"
    assert all(isinstance(e, SwapFailed) for e in errors), errors
    assert all(e.message.startswith('model "fake" start aborted: stopped while starting')
               for e in errors), {e.message for e in errors}
    assert "served" in results
    s = run_loop.scheduler
    assert (s.queued(), s.active_swaps(), s.in_flight("fake")) == ([], {}, 0)
    assert await asyncio.wait_for(load(), DEADLINE) == "served"


async def test_after_shutdown_acquire_and_unload_answer_at_once(run_loop: RunLoop) -> None:
    """A request that passed the edge just before a drain began reaches a run loop that has
    stopped taking events: it must get 503 shutting_down, not wait on a dead queue."""
    await asyncio.wait_for(run_loop.shutdown(), DEADLINE)
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(run_loop.acquire("fake"), DEADLINE)
    await asyncio.wait_for(run_loop.unload(["fake"]), DEADLINE)  # nothing left to stop


@pytest.fixture
async def ttl_loop(port: int) -> AsyncIterator[RunLoop]:
    spec = fake_spec(port, ttl=0.3)
    async with running(Catalog(models={"fake": CatalogModel("fake", spec, parallel=2)})) as loop:
        yield loop


async def test_the_ttl_waits_for_the_schedulers_in_flight_count(ttl_loop: RunLoop) -> None:
    """In flight is counted once, by the scheduler: the process stays while any grant of its
    model is held (two here, released one by one), and its idle time runs from the last
    release, which the run loop reports once the scheduler's count is 0."""
    first = await asyncio.wait_for(ttl_loop.acquire("fake"), DEADLINE)
    second = await asyncio.wait_for(ttl_loop.acquire("fake"), DEADLINE)
    proc = ttl_loop.upstreams.process("fake")
    assert proc.busy and proc.state is State.READY
    first.release()
    assert ttl_loop.processed is not None
    await asyncio.wait_for(next_of(ttl_loop.processed, ServeDone), DEADLINE)
    assert proc.busy, "one grant is still held"
    with pytest.raises(TimeoutError):  # well past the ttl: a busy model must stay
        await wait_for_state(proc, State.STOPPING, timeout=0.9)

    loop = asyncio.get_running_loop()
    second.release()
    released = loop.time()
    await asyncio.wait_for(next_of(ttl_loop.processed, ServeDone), DEADLINE)
    assert not proc.busy
    await wait_for_state(proc, State.STOPPED, timeout=5)
    assert loop.time() - released >= 0.3 - 0.01, "idle time runs from the last release"


async def test_unload_everything_stops_a_load_still_evicting(port: int) -> None:
    """Loading `b` must first stop `a`, which takes its time (it ignores SIGTERM). "Unload
    everything" handled meanwhile counts `b` as loading, but `b` has no process yet to stop:
    the load must not go on once `a` is gone. The waiter hears that the start was aborted,
    nothing is left running, and the unload ends only then: a request made after it loads
    `b` afresh instead of joining the aborted load."""
    slow = fake_spec(port, "--ignore-sigterm", model_id="a", unload_timeout=1.0)
    quick = fake_spec(free_port(), model_id="b")
    catalog = Catalog(models={"a": CatalogModel("a", slow), "b": CatalogModel("b", quick)},
                      groups=(Group("g", frozenset({"a", "b"})),))
    async with running(catalog) as run_loop:
        upstreams = run_loop.upstreams
        (await asyncio.wait_for(run_loop.acquire("a"), DEADLINE)).release()
        waiter = asyncio.create_task(run_loop.acquire("b"))
        await wait_for_state(upstreams.process("a"), State.STOPPING, timeout=DEADLINE)
        await asyncio.wait_for(run_loop.unload_all(), DEADLINE)
        with pytest.raises(SwapFailed) as failed:
            await asyncio.wait_for(waiter, DEADLINE)
        assert failed.value.message.startswith('model "b" start aborted: stopped while starting')
        assert upstreams.running_ids() == []
        (await asyncio.wait_for(run_loop.acquire("b"), DEADLINE)).release()
        assert upstreams.running_ids() == ["b"]


async def test_a_request_after_an_unload_of_a_loading_model_gets_a_fresh_load(
        port: int) -> None:
    """`b` is unloaded while its load still waits for `a` to stop. The unload is not over
    until that load has given up: a request made once the unload has returned waits for a
    load of its own, and gets it, instead of joining the doomed one and failing with it."""
    slow = fake_spec(port, "--ignore-sigterm", model_id="a", unload_timeout=1.0)
    quick = fake_spec(free_port(), model_id="b")
    catalog = Catalog(models={"a": CatalogModel("a", slow), "b": CatalogModel("b", quick)},
                      groups=(Group("g", frozenset({"a", "b"})),))
    async with running(catalog) as run_loop:
        (await asyncio.wait_for(run_loop.acquire("a"), DEADLINE)).release()
        doomed = asyncio.create_task(run_loop.acquire("b"))
        await wait_for_state(run_loop.upstreams.process("a"), State.STOPPING, timeout=DEADLINE)
        await asyncio.wait_for(run_loop.unload(["b"]), DEADLINE)
        later = await asyncio.wait_for(run_loop.acquire("b"), DEADLINE)
        later.release()
        with pytest.raises(SwapFailed):
            await asyncio.wait_for(doomed, DEADLINE)
        assert run_loop.upstreams.running_ids() == ["b"]
