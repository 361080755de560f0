"""UpstreamProcess against a real upstream: `python -m gpuproxy.testing.fakellm` on a free port.

No mocks: every scenario spawns the fake server with a misbehaviour flag and watches the real
process (pid, process group, health endpoint). Waiting uses `wait_for_state` (a 10 ms poll with
a deadline, the only polling here) or `asyncio.wait_for`, so a hang fails the test instead of
stalling the suite. No database is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuproxy.upstream.logbuffer import LogBuffer
from gpuproxy.upstream.processes import StartFailed, State, UpstreamProcess, stop_all
from scheduling.spec import UpstreamSpec
from tests.conftest import free_port

DEADLINE = 15.0  # no single await in these tests may take longer; a hang fails, not stalls


def fake_spec(port: int, *flags: str, **fields: Any) -> UpstreamSpec:
    cmd = shlex.join([sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(port),
                      *flags])
    fields.setdefault("model_id", "fake")
    return UpstreamSpec(cmd=cmd, proxy=f"http://127.0.0.1:{port}", **fields)


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """The one allowed poll (10 ms, with a deadline): process state is advisory, so tests
    watch it from outside instead of sleeping a guessed amount."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 (no event to wait on from outside)
            await asyncio.sleep(0.01)


async def wait_for_state(proc: UpstreamProcess, state: State,
                         timeout: float = 5.0) -> None:  # noqa: ASYNC109 (a poll deadline)
    await wait_until(lambda: proc.state is state, timeout)


async def wait_for_pid(proc: UpstreamProcess, timeout: float = 5.0) -> int:  # noqa: ASYNC109
    """STARTING is set before the spawn completes, so a pid may lag the state by a moment."""
    await wait_until(lambda: proc.pid is not None, timeout)
    assert proc.pid is not None
    return proc.pid


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


class Recorder:
    """Collects on_state calls, as the UI's event stream would see them."""

    def __init__(self) -> None:
        self.states: list[State] = []

    def __call__(self, model_id: str, state: State) -> None:
        assert model_id == "fake"
        self.states.append(state)


Make = Callable[..., UpstreamProcess]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    """Builds processes and always closes them, so no test leaves an upstream running."""
    made: list[UpstreamProcess] = []

    def build(spec: UpstreamSpec, on_state: Recorder | None = None) -> UpstreamProcess:
        proc = UpstreamProcess(spec, LogBuffer(spec.model_id), on_state)
        made.append(proc)
        return proc

    yield build
    errors: list[BaseException] = []
    for proc in made:  # every one, even after a failure: never leak a fake server
        pid = proc.pid
        try:
            await asyncio.wait_for(proc.close(), DEADLINE)
            assert pid is None or pid_gone(pid), f"close() left pid {pid} running"
        except BaseException as exc:
            errors.append(exc)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    if errors:
        raise errors[0]


async def test_start_becomes_ready(make: Make, port: int) -> None:
    seen = Recorder()
    proc = make(fake_spec(port), seen)

    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    assert proc.state is State.READY
    assert seen.states == [State.STARTING, State.READY]
    assert proc.pid is not None and not pid_gone(proc.pid)
    assert os.getpgid(proc.pid) == proc.pid, "the upstream must lead its own process group"
    assert proc.started_at is not None and proc.ready_at is not None
    assert proc.ready_at >= proc.started_at
    async with httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    assert any("listening" in line for line in proc._log.history()), "output reaches the log"


async def test_slow_load_is_seen_within_a_poll(make: Make, port: int) -> None:
    """Readiness must show within ~100 ms of the load finishing (llama-swap polls every 1 s)."""
    seen = Recorder()
    proc = make(fake_spec(port, "--load-seconds", "1"), seen)
    loop = asyncio.get_running_loop()
    loaded_at: list[float] = []

    async def watch_log() -> None:
        with proc._log.subscribe() as lines:
            while True:
                if "loaded in" in await lines.get():
                    loaded_at.append(loop.time())
                    return

    watcher = asyncio.create_task(watch_log())
    await asyncio.sleep(0)  # subscribed before the process exists
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    await asyncio.wait_for(watcher, 2)

    assert seen.states == [State.STARTING, State.READY]
    assert proc.ready_at is not None and proc.started_at is not None
    assert proc.ready_at - proc.started_at >= 1.0, "ready before the load finished"
    lag = proc.ready_at - loaded_at[0]
    assert lag < 0.3, f"readiness seen {lag:.3f} s after the load finished"


async def test_health_check_timeout_kills_and_fails(make: Make, port: int) -> None:
    proc = make(fake_spec(port, "--load-seconds", "30", health_check_timeout=1.5))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    starting = asyncio.create_task(proc.ensure_ready())
    pid = await wait_for_pid(proc)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(starting, DEADLINE)

    err = info.value
    assert err.reason == "timeout"
    assert loop.time() - t0 >= 1.5
    assert "did not become ready within 1.5 s" in str(err)
    assert "HTTP 503" in str(err), "the message says what the health check last saw"
    assert "healthCheckTimeout" in str(err)
    assert proc.state is State.FAILED and proc.last_error is err
    assert proc.pid is None
    assert pid_gone(pid) and group_gone(pid)


async def test_exit_during_start_fails_fast(make: Make, port: int) -> None:
    proc = make(fake_spec(port, "--exit-on-start", "1", health_check_timeout=30))
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    err = info.value
    assert loop.time() - t0 < 5, "an exit must fail the start at once, not at the timeout"
    assert (err.reason, err.exit_code) == ("exited", 1)
    assert any("simulated start failure" in line for line in err.output_tail)
    assert "exited with code 1 during start" in str(err)
    assert "simulated start failure" in str(err)
    assert proc.state is State.FAILED


async def test_failed_start_retries_from_scratch(make: Make, port: int) -> None:
    proc = make(fake_spec(port, "--exit-on-start", "2"))
    with pytest.raises(StartFailed):
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    proc.update_spec(fake_spec(port))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    assert proc.state is State.READY and proc.last_error is None


async def test_missing_executable_is_a_spawn_failure(make: Make, port: int) -> None:
    spec = UpstreamSpec(model_id="fake", cmd=f"llama-serverx-gpuproxy-test --port {port}",
                        proxy=f"http://127.0.0.1:{port}")
    seen = Recorder()
    proc = make(spec, seen)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    err = info.value
    assert err.reason == "spawn"
    assert "executable 'llama-serverx-gpuproxy-test' not found" in str(err)
    assert "check the model's cmd" in str(err)
    assert seen.states == [State.STARTING, State.FAILED]


async def test_busy_port_exits_with_its_reason(make: Make) -> None:
    """Bound, not listening: nothing answers there, so the start goes ahead and the server's
    own exit says why (a port something listens on fails before the spawn:
    test_process_escapes.py)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = make(fake_spec(port, health_check_timeout=30))

        with pytest.raises(StartFailed) as info:
            await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    err = info.value
    assert (err.reason, err.exit_code) == ("exited", 1)
    tail = " ".join(err.output_tail)
    assert str(port) in tail and "address already in use" in tail
    assert "address already in use" in str(err)


async def test_ignored_sigterm_is_escalated_to_sigkill(
        make: Make, port: int, caplog: pytest.LogCaptureFixture) -> None:
    proc = make(fake_spec(port, "--ignore-sigterm"))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    pid = proc.pid
    assert pid is not None
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    with caplog.at_level(logging.INFO, logger="gpuproxy.upstream.processes"):
        await asyncio.wait_for(proc.stop(timeout=1.0), DEADLINE)

    assert loop.time() - t0 >= 1.0, "SIGKILL came before the unload timeout"
    assert pid_gone(pid) and group_gone(pid)
    assert proc.state is State.STOPPED and proc.pid is None
    assert any("sending SIGKILL" in r.getMessage() and str(pid) in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert any("SIGTERM ignored" in line for line in proc._log.history())


async def test_cmd_stop_runs_with_pid_and_env(make: Make, port: int, tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    script = ("import os, signal, sys; "
              "open(sys.argv[1], 'w').write(sys.argv[2] + ' ' + os.environ['GP_MARK']); "
              "os.kill(int(sys.argv[2]), signal.SIGINT)")  # SIGINT: proves it wasn't our SIGTERM
    cmd_stop = shlex.join([sys.executable, "-c", script, str(marker)]) + " ${PID}"
    proc = make(fake_spec(port, "--ignore-sigterm", cmd_stop=cmd_stop, env={"GP_MARK": "env-ok"},
                          unload_timeout=10))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    pid = proc.pid
    assert pid is not None
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    await asyncio.wait_for(proc.stop(), DEADLINE)

    assert loop.time() - t0 < 5, "cmd_stop should have stopped it long before SIGKILL"
    assert marker.read_text() == f"{pid} env-ok"
    assert pid_gone(pid)
    assert any("SIGINT, exiting" in line for line in proc._log.history())


async def test_ttl_unloads_when_idle(make: Make, port: int) -> None:
    seen = Recorder()
    proc = make(fake_spec(port, ttl=0.5, unload_timeout=5), seen)
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    pid = proc.pid
    assert pid is not None and proc.ready_at is not None
    loop = asyncio.get_running_loop()

    await wait_for_state(proc, State.STOPPED, timeout=5)

    assert loop.time() - proc.ready_at >= 0.5 - 0.01
    assert seen.states == [State.STARTING, State.READY, State.STOPPING, State.STOPPED]
    assert pid_gone(pid)


async def test_ttl_never_unloads_during_a_request(make: Make, port: int) -> None:
    proc = make(fake_spec(port, ttl=0.3, unload_timeout=5))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    proc.serving(True)
    assert proc.busy

    with pytest.raises(TimeoutError):  # well past the ttl: a busy model must stay
        await wait_for_state(proc, State.STOPPING, timeout=0.9)
    assert proc.state is State.READY

    loop = asyncio.get_running_loop()
    proc.serving(False)
    finished = loop.time()
    await wait_for_state(proc, State.STOPPED, timeout=5)
    assert loop.time() - finished >= 0.3 - 0.01, "idle time runs from the request's end"
    assert not proc.busy


async def test_crash_stops_then_next_request_restarts(
        make: Make, port: int, caplog: pytest.LogCaptureFixture) -> None:
    proc = make(fake_spec(port, "--crash-after", "1"))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    first = proc.pid
    assert first is not None

    with caplog.at_level(logging.WARNING, logger="gpuproxy.upstream.processes"):
        proc.serving(True)
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                with pytest.raises(httpx.HTTPError):
                    response = await client.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4})
                    response.raise_for_status()
        finally:
            proc.serving(False)
        await wait_for_state(proc, State.STOPPED, timeout=5)

    assert proc.pid is None and pid_gone(first)
    assert any("exited unexpectedly with code 3" in r.getMessage() and str(first) in r.getMessage()
               for r in caplog.records)

    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    assert proc.state is State.READY
    assert proc.pid is not None and proc.pid != first


async def test_stop_during_start_aborts_it(make: Make, port: int) -> None:
    seen = Recorder()
    proc = make(fake_spec(port, "--load-seconds", "30"), seen)
    starting = asyncio.create_task(proc.ensure_ready())
    pid = await wait_for_pid(proc)
    assert proc.state is State.STARTING

    await asyncio.wait_for(proc.stop(timeout=5), DEADLINE)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(starting, DEADLINE)
    assert info.value.reason == "aborted"
    assert proc.state is State.STOPPED
    assert pid_gone(pid) and group_gone(pid)
    assert seen.states == [State.STARTING, State.STOPPING, State.STOPPED]


async def test_start_during_stop_waits_then_starts(make: Make, port: int) -> None:
    """llama-swap #946: a request arriving during an unload used to hang forever."""
    seen = Recorder()
    # unload_timeout: closing this SIGTERM-deaf fake at teardown waits that long before SIGKILL
    proc = make(fake_spec(port, "--ignore-sigterm", unload_timeout=1), seen)
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    first = proc.pid
    assert first is not None

    stopping = asyncio.create_task(proc.stop(timeout=1.0))
    await wait_for_state(proc, State.STOPPING)
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    assert stopping.done(), "the start must come after the stop finished"
    await stopping
    assert proc.state is State.READY
    assert proc.pid is not None and proc.pid != first and pid_gone(first)
    assert seen.states == [State.STARTING, State.READY, State.STOPPING, State.STOPPED,
                           State.STARTING, State.READY]


async def test_concurrent_callers_share_one_start(make: Make, port: int) -> None:
    seen = Recorder()
    proc = make(fake_spec(port, "--load-seconds", "0.3"), seen)
    pids: list[int | None] = []

    async def caller() -> None:
        await proc.ensure_ready()
        pids.append(proc.pid)

    await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(8))), DEADLINE)

    assert seen.states == [State.STARTING, State.READY]
    assert len(set(pids)) == 1 and pids[0] is not None


async def test_cancelled_caller_does_not_stop_the_start(make: Make, port: int) -> None:
    proc = make(fake_spec(port, "--load-seconds", "0.3"))
    leaver = asyncio.create_task(proc.ensure_ready())
    stayer = asyncio.create_task(proc.ensure_ready())
    await wait_for_state(proc, State.STARTING)
    leaver.cancel()

    await asyncio.wait_for(stayer, DEADLINE)
    assert leaver.cancelled()
    assert proc.state is State.READY


async def test_start_and_stop_are_idempotent(make: Make, port: int) -> None:
    seen = Recorder()
    proc = make(fake_spec(port), seen)
    await asyncio.wait_for(proc.stop(), DEADLINE)  # never started: a no-op
    assert seen.states == []

    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    pid = proc.pid
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    assert proc.pid == pid

    await asyncio.wait_for(proc.stop(), DEADLINE)
    await asyncio.wait_for(proc.stop(), DEADLINE)
    assert seen.states == [State.STARTING, State.READY, State.STOPPING, State.STOPPED]


async def test_no_health_check_is_ready_at_once(make: Make, port: int) -> None:
    proc = make(fake_spec(port, "--load-seconds", "30", check_endpoint="none"))
    await asyncio.wait_for(proc.ensure_ready(), 5)
    assert proc.state is State.READY


async def test_on_state_errors_are_logged_not_raised(
        make: Make, port: int, caplog: pytest.LogCaptureFixture) -> None:
    def broken(model_id: str, state: State) -> None:
        raise RuntimeError("ui went away")

    proc = UpstreamProcess(fake_spec(port), LogBuffer("fake"), broken)
    try:
        with caplog.at_level(logging.ERROR, logger="gpuproxy.upstream.processes"):
            await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
        assert proc.state is State.READY
        assert any("on_state callback failed" in r.getMessage() for r in caplog.records)
    finally:
        await asyncio.wait_for(proc.close(), DEADLINE)


async def test_close_leaves_no_process(make: Make, port: int) -> None:
    proc = make(fake_spec(port))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    pid = proc.pid
    assert pid is not None

    await asyncio.wait_for(proc.close(), DEADLINE)

    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with pytest.raises(StartFailed) as info:
        await proc.ensure_ready()
    assert info.value.reason == "aborted"


async def test_stop_all_stops_in_parallel(make: Make) -> None:
    procs = [make(fake_spec(free_port(), "--ignore-sigterm")) for _ in range(3)]
    await asyncio.wait_for(asyncio.gather(*(p.ensure_ready() for p in procs)), DEADLINE)
    pids = [p.pid for p in procs]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    await asyncio.wait_for(stop_all(procs, timeout=1.0), DEADLINE)

    assert loop.time() - t0 < 2.5, "stops must run in parallel, not one after another"
    assert all(p.state is State.STOPPED for p in procs)
    assert all(pid is not None and pid_gone(pid) for pid in pids)
