"""The lifecycle of one upstream inference server process: start, health-check, stop, idle-unload.

One owner task per `UpstreamProcess` (`_run_owner`) is the only code that writes its lifecycle
state, its subprocess handle and its waiter lists. Public methods are thin clients: they put a
request carrying a future on the owner's queue and await the future. Slow work (polling health,
running `cmd_stop`, waiting for the exit) runs in helper tasks that never change state; they
report back to the owner as events on the same queue. Reading `state`, `pid` and friends from
outside is fine for display and metrics, but those reads are advisory: never decide from them
(`if proc.state is STOPPED: start`) — ask the owner with `ensure_ready()` / `stop()`. This is
what makes a request that arrives during a TTL unload wait for the stop and then start the model
again, instead of hanging forever (llama-swap #946).

States: `stopped → starting → ready → stopping → stopped`, plus `failed` (a start that failed;
the next `ensure_ready()` starts from scratch). No Django imports here on purpose: the process
manager is tested against a real fake upstream (`gpuproxy.fakellm`) without a database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from gpuproxy.logbuffer import LogBuffer, registry
from gpuproxy.orphans import ProcessRecords, pdeathsig_argv
from gpuproxy.spec import UpstreamSpec, split_command

logger = logging.getLogger("gpuproxy.processes")

HEALTH_POLL_INTERVAL = 0.05  # llama-swap polls once a second; readiness must show within 100 ms
HEALTH_TRY_TIMEOUT = 1.0  # one health GET; a wedged upstream must not stall the poll for long
FAILED_START_GRACE = 5.0  # SIGTERM → SIGKILL grace when a start times out (llama-swap: 5 s)
OUTPUT_TAIL_LINES = 20  # lines of upstream output kept on a StartFailed
MESSAGE_TAIL_LINES = 3  # of those, shown in str(StartFailed)
READER_DRAIN = 0.5  # after the exit, how long to wait for the last output before reporting it
GROUP_SWEEP_WAIT = 2.0  # after SIGKILL to leftovers of a group, how long to wait for them to go
STREAM_LIMIT = 1 << 20  # longest upstream output line read whole (asyncio's default is 64 KiB)


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class StartFailed(Exception):
    """A start that did not reach `ready`; the message is one line a person can act on.

    `reason` is `"spawn"` (the command could not be run at all), `"exited"` (it exited during
    the start), `"timeout"` (no 200 from the health endpoint in time) or `"aborted"` (a stop or
    the proxy's shutdown ended the start).
    """

    def __init__(self, model_id: str, reason: str, detail: str, *, cmd: str = "",
                 exit_code: int | None = None, output_tail: Iterable[str] = (),
                 remedy: str = "") -> None:
        self.model_id = model_id
        self.reason = reason
        self.exit_code = exit_code
        self.output_tail = list(output_tail)
        self.cmd = cmd
        message = f'model "{model_id}" {detail}'
        shown = [_clip(line, 300) for line in self.output_tail if line.strip()]
        if shown:
            message += "; last output: " + " | ".join(shown[-MESSAGE_TAIL_LINES:])
        if remedy:
            message += "; " + remedy
        super().__init__(message)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _check_executable(program: str, path: str | None) -> None:
    """Raise what exec would, before exec: the upstream starts through `setpriv`, whose own
    failure to find the program would otherwise look like a server that exited at start."""
    found = shutil.which(program, mode=os.F_OK, path=path) if os.sep not in program else (
        program if os.path.exists(program) else None)
    if found is None:
        raise FileNotFoundError(program)
    if not os.access(found, os.X_OK) or os.path.isdir(found):
        raise PermissionError(program)


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False when it is already gone (nothing to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# Requests from callers (each carries the future the caller awaits) and events from helper tasks.
# `gen` ties an event to one run, so a late event from an earlier run is ignored.


@dataclass
class _EnsureReq:
    future: asyncio.Future[None]


@dataclass
class _StopReq:
    timeout: float | None
    future: asyncio.Future[None]


@dataclass
class _CloseReq:
    future: asyncio.Future[None]


@dataclass
class _Healthy:
    gen: int


@dataclass
class _HealthTimedOut:
    gen: int
    last_probe: str


@dataclass
class _Exited:
    gen: int
    code: int


@dataclass
class _KillDue:
    gen: int


@dataclass
class _TtlDue:
    gen: int


@dataclass
class _RequestDone:
    pass


_Message = (_EnsureReq | _StopReq | _CloseReq | _Healthy | _HealthTimedOut | _Exited | _KillDue
            | _TtlDue | _RequestDone)


@dataclass
class _Run:
    """One spawned process and its helpers; created and dropped only by the owner."""

    gen: int
    spec: UpstreamSpec  # the spec it was started with (update_spec affects only the next run)
    cmd: str
    proc: asyncio.subprocess.Process
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    reader: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    health: asyncio.Task[None] | None = None
    kill_timer: asyncio.TimerHandle | None = None
    kill_at: float | None = None
    # Set when the stop ends a start: the start's waiters get this StartFailed reason on exit.
    start_failure: str | None = None
    health_detail: str = ""
    stop_began: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class UpstreamProcess:
    """One upstream server process, started on demand and stopped on request or when idle.

    Bound to the event loop it is first used on; its owner task starts lazily there.
    """

    def __init__(self, spec: UpstreamSpec, log: LogBuffer | None = None,
                 on_state: Callable[[str, State], None] | None = None,
                 records: ProcessRecords | None = None) -> None:
        self._model_id = spec.model_id
        self._spec = spec  # written by update_spec; read by the owner at the next start
        self._log = log if log is not None else registry.get(spec.model_id)
        self._on_state = on_state
        self._records = records  # process groups on disk, for the sweep after a crash
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Message] | None = None
        self._owner: asyncio.Task[None] | None = None
        self._closed = False  # set by the owner when it has ended; later calls get no owner
        # Written only by the owner task (_run_owner and the _on_* handlers it calls):
        self._state = State.STOPPED
        self._run: _Run | None = None
        self._gen = 0
        self._waiters: list[asyncio.Future[None]] = []  # ensure_ready callers of this start
        self._next_waiters: list[asyncio.Future[None]] = []  # arrived while stopping
        self._stop_waiters: list[asyncio.Future[None]] = []
        self._closing = False
        self._started_at: float | None = None
        self._ready_at: float | None = None
        self._last_error: StartFailed | None = None
        self._last_ensure = 0.0
        self._ttl_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Written by request_started/request_finished on the loop thread; the owner reads them
        # when a TTL timer fires, so an in-flight request is always seen (no queue lag).
        self._in_flight = 0
        self._last_done = 0.0

    def __repr__(self) -> str:
        return f"<UpstreamProcess {self._model_id!r} {self._state} pid={self.pid}>"

    # -- advisory reads ---------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def pid(self) -> int | None:
        run = self._run
        if run is None or run.proc.returncode is not None:
            return None
        return run.pid

    @property
    def spec(self) -> UpstreamSpec:
        return self._spec

    @property
    def started_at(self) -> float | None:
        """Loop (monotonic) time the current or last run was spawned."""
        return self._started_at

    @property
    def ready_at(self) -> float | None:
        """Loop (monotonic) time the current run became ready; None until it has."""
        return self._ready_at

    @property
    def last_error(self) -> StartFailed | None:
        """The failure of the last start, until a start succeeds."""
        return self._last_error

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- commands ---------------------------------------------------------------------------------

    async def ensure_ready(self) -> None:
        """Return once the upstream answers its health check; start it if needed.

        ready → at once; stopped/failed → start; starting → join that start (every concurrent
        caller shares one process); stopping → wait for the stop, then start. Raises StartFailed.
        Cancelling the caller only drops its wait: the start goes on for the other waiters.
        """
        if self._closed:
            raise self._shutting_down()
        future = self._loop_or_raise().create_future()
        self._post(_EnsureReq(future))
        await future

    async def stop(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (a grace period)
        """Stop the upstream and return once it and its process group are gone.

        Graceful first (`cmd_stop`, else SIGTERM to the group), SIGKILL to the group after
        `timeout` seconds (default: the spec's unload_timeout). A stop during a start aborts it;
        its ensure_ready callers get StartFailed("aborted"). Stopped already → no-op.
        """
        if self._closed:
            return
        future = self._loop_or_raise().create_future()
        self._post(_StopReq(timeout, future))
        await future

    async def close(self) -> None:
        """Stop the upstream and end the owner task (proxy shutdown); later starts are refused."""
        if self._closed:
            return
        if self._owner is None:  # never used: nothing runs, nothing to stop
            self._closed = True
            return
        future = self._loop_or_raise().create_future()
        self._post(_CloseReq(future))
        await future
        with contextlib.suppress(asyncio.CancelledError):
            await self._owner

    def update_spec(self, spec: UpstreamSpec) -> None:
        """Use `spec` for the next start; a running process keeps the spec it was started with."""
        self._spec = spec

    def request_started(self) -> None:
        """Count a request in flight: the TTL never unloads a model that is serving."""
        self._in_flight += 1

    def request_finished(self) -> None:
        """Count a request done; the TTL idle time runs from the last of these."""
        self._in_flight = max(0, self._in_flight - 1)
        if self._loop is not None:
            self._last_done = self._loop.time()
        if self._queue is not None and not self._closed:
            self._queue.put_nowait(_RequestDone())

    # -- plumbing ---------------------------------------------------------------------------------

    def _loop_or_raise(self) -> asyncio.AbstractEventLoop:
        """Start the owner lazily, on the running loop (there is none at import or in __init__)."""
        loop = asyncio.get_running_loop()
        if self._owner is None:
            self._loop = loop
            self._queue = asyncio.Queue()
            self._owner = loop.create_task(self._run_owner(), name=f"upstream {self._model_id}")
        elif self._loop is not loop:
            raise RuntimeError(f"UpstreamProcess for model {self._model_id!r} is bound to another "
                               "event loop; use one UpstreamProcess per loop")
        return loop

    def _post(self, message: _Message) -> None:
        assert self._queue is not None
        self._queue.put_nowait(message)

    def _now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A helper task, kept referenced (asyncio holds only weak ones) and cancelled at close."""
        assert self._loop is not None
        task = self._loop.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _shutting_down(self) -> StartFailed:
        return StartFailed(self._model_id, "aborted",
                           "cannot start: the proxy is shutting down")

    # -- the owner --------------------------------------------------------------------------------

    async def _run_owner(self) -> None:
        """The single writer: take requests and events one at a time until closed."""
        assert self._queue is not None
        try:
            while not (self._closing and self._run is None):
                message = await self._queue.get()
                try:
                    await self._handle(message)
                except Exception:  # a bug here must not strand every future waiter
                    logger.exception('model "%s": error handling %s', self._model_id,
                                     type(message).__name__)
        finally:
            self._finish_owner()

    async def _handle(self, message: _Message) -> None:
        match message:
            case _EnsureReq(future):
                await self._on_ensure(future)
            case _StopReq(timeout, future):
                self._on_stop(timeout, future)
            case _CloseReq(future):
                self._on_close(future)
            case _Healthy(gen):
                self._on_healthy(gen)
            case _HealthTimedOut(gen, last_probe):
                self._on_health_timed_out(gen, last_probe)
            case _Exited(gen, code):
                await self._on_exited(gen, code)
            case _KillDue(gen):
                self._on_kill_due(gen)
            case _TtlDue(gen):
                self._on_ttl_due(gen)
            case _RequestDone():
                self._schedule_ttl()

    def _finish_owner(self) -> None:
        """Closed (or the loop is going away): answer everything still waiting, kill leftovers."""
        self._closed = True
        self._cancel_ttl()
        run = self._run
        if run is not None and run.proc.returncode is None:
            # Only reached if the owner is cancelled mid-life (loop shutdown without close()):
            # never leave an upstream holding a GPU behind us.
            logger.warning('model "%s": owner ended with pid %d still running; SIGKILL to its '
                           "process group", self._model_id, run.pid)
            _signal_group(run.pid, signal.SIGKILL)
        error = self._shutting_down()
        _fail_all(self._waiters, error)
        _fail_all(self._next_waiters, error)
        _resolve_all(self._stop_waiters)
        assert self._queue is not None
        while not self._queue.empty():
            match self._queue.get_nowait():
                case _EnsureReq(future):
                    _fail_all([future], error)
                case _StopReq(_, future) | _CloseReq(future):
                    _resolve_all([future])
                case _:
                    pass
        for task in list(self._background):
            task.cancel()

    def _set_state(self, state: State) -> None:
        self._state = state
        if self._on_state is not None:
            try:
                self._on_state(self._model_id, state)
            except Exception:
                logger.exception('model "%s": on_state callback failed for %s', self._model_id,
                                 state)

    async def _on_ensure(self, future: asyncio.Future[None]) -> None:
        if self._closing:
            _fail_all([future], self._shutting_down())
            return
        match self._state:
            case State.READY:
                self._last_ensure = self._now()  # a caller is about to use it: not idle now
                self._schedule_ttl()
                _resolve_all([future])
            case State.STARTING:
                self._waiters.append(future)
            case State.STOPPING:
                self._next_waiters.append(future)  # #946: wait for the stop, then start
            case State.STOPPED | State.FAILED:
                self._waiters.append(future)
                await self._start()

    def _on_stop(self, timeout: float | None, future: asyncio.Future[None]) -> None:
        run = self._run
        match self._state:
            case State.STOPPED | State.FAILED:
                _resolve_all([future])
                return
            case State.STOPPING:
                # The later command wins: a stop cancels a start queued behind the current stop.
                _fail_all(self._next_waiters, self._aborted(run))
                self._next_waiters = []
            case State.STARTING:
                assert run is not None
                run.start_failure = "aborted"
            case State.READY:
                pass
        self._stop_waiters.append(future)
        assert run is not None
        self._begin_stop(run, timeout if timeout is not None else run.spec.unload_timeout,
                         why="on request")

    def _on_close(self, future: asyncio.Future[None]) -> None:
        self._closing = True
        _fail_all(self._next_waiters, self._shutting_down())
        self._next_waiters = []
        run = self._run
        if run is None:
            _resolve_all([future])
            return
        if self._state is State.STARTING:
            run.start_failure = "aborted"
        self._stop_waiters.append(future)
        self._begin_stop(run, run.spec.unload_timeout, why="for shutdown")

    # -- start ------------------------------------------------------------------------------------

    async def _start(self) -> None:
        spec = self._spec
        self._gen += 1
        self._started_at = self._now()
        self._ready_at = None
        self._set_state(State.STARTING)
        try:
            argv = spec.argv()
        except ValueError as exc:
            self._fail_start(StartFailed(
                spec.model_id, "spawn", f"could not start: {exc} (cmd: {_clip(spec.cmd, 200)})",
                cmd=spec.cmd, remedy="check the model's cmd"))
            return
        cmd = shlex.join(argv)
        shown = _clip(cmd, 200)
        env = {**os.environ, **spec.env}
        try:
            _check_executable(argv[0], env.get("PATH"))
            proc = await asyncio.create_subprocess_exec(
                *pdeathsig_argv(argv), env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, limit=STREAM_LIMIT)
        except FileNotFoundError:
            detail = f"could not start: executable {argv[0]!r} not found (cmd: {shown})"
        except PermissionError:
            detail = (f"could not start: executable {argv[0]!r} is not executable "
                      f"(permission denied) (cmd: {shown})")
        except OSError as exc:
            detail = f"could not start: {exc.strerror or exc} (cmd: {shown})"
        else:
            detail = ""
        if detail:
            self._fail_start(StartFailed(spec.model_id, "spawn", detail, cmd=cmd,
                                         remedy="check the model's cmd"))
            return

        run = self._run = _Run(gen=self._gen, spec=spec, cmd=cmd, proc=proc)
        if self._records is not None:
            self._records.add(spec.model_id, proc.pid, cmd)
        logger.info('model "%s" starting: pid %d, proxy %s, cmd %s', spec.model_id, proc.pid,
                    spec.proxy, shown)
        run.reader = self._spawn(self._pump_output(run), f"upstream {spec.model_id} output")
        run.watcher = self._spawn(self._watch_exit(run), f"upstream {spec.model_id} exit")
        url = spec.health_url()
        if url is None:  # checkEndpoint: none → ready as soon as it runs
            self._become_ready(run)
        else:
            deadline = self._started_at + spec.health_check_timeout
            run.health = self._spawn(self._poll_health(run.gen, url, deadline),
                                     f"upstream {spec.model_id} health")

    def _on_healthy(self, gen: int) -> None:
        run = self._run
        if run is not None and run.gen == gen and self._state is State.STARTING:
            self._become_ready(run)

    def _become_ready(self, run: _Run) -> None:
        now = self._now()
        self._ready_at = now
        self._last_error = None
        self._set_state(State.READY)
        assert self._started_at is not None
        logger.info('model "%s" ready in %.2f s at %s (pid %d)', self._model_id,
                    now - self._started_at, run.spec.proxy, run.pid)
        _resolve_all(self._waiters)
        self._waiters = []
        self._schedule_ttl()

    def _on_health_timed_out(self, gen: int, last_probe: str) -> None:
        run = self._run
        if run is None or run.gen != gen or self._state is not State.STARTING:
            return
        run.start_failure = "timeout"
        run.health_detail = last_probe
        logger.warning('model "%s" (pid %d) not ready after %g s (%s); stopping it',
                       self._model_id, run.pid, run.spec.health_check_timeout, last_probe)
        self._begin_stop(run, FAILED_START_GRACE, why="after a failed start")

    def _fail_start(self, error: StartFailed) -> None:
        self._last_error = error
        self._set_state(State.FAILED)
        logger.error("%s", error)
        _fail_all(self._waiters, error)
        self._waiters = []

    def _start_error(self, run: _Run, reason: str, code: int) -> StartFailed:
        spec, shown, tail = run.spec, _clip(run.cmd, 200), list(run.tail)
        if reason == "exited":
            return StartFailed(
                spec.model_id, "exited",
                f"failed to start: command exited with {_describe_exit(code)} during start "
                f"(cmd: {shown})", cmd=run.cmd, exit_code=code, output_tail=tail)
        if reason == "timeout":
            return StartFailed(
                spec.model_id, "timeout",
                f"did not become ready within {spec.health_check_timeout:g} s "
                f"(GET {spec.health_url()} never answered 200; {run.health_detail})",
                cmd=run.cmd, exit_code=code, output_tail=tail,
                remedy="raise healthCheckTimeout or check the command")
        if self._closing:
            return StartFailed(spec.model_id, "aborted",
                               f"start aborted: the proxy is shutting down (pid {run.pid})",
                               cmd=run.cmd, exit_code=code, output_tail=tail)
        return self._aborted(run, code, tail)

    def _aborted(self, run: _Run | None, code: int | None = None,
                 tail: Iterable[str] = ()) -> StartFailed:
        pid = f" (pid {run.pid})" if run is not None else ""
        return StartFailed(self._model_id, "aborted", f"start aborted: stopped while starting{pid}",
                           cmd=run.cmd if run is not None else "", exit_code=code,
                           output_tail=tail)

    # -- stop -------------------------------------------------------------------------------------

    def _begin_stop(self, run: _Run, timeout: float, why: str) -> None:
        """Graceful now, SIGKILL to the group at `timeout`; an earlier deadline always wins."""
        now = self._now()
        kill_at = now + max(0.0, timeout)
        if self._state is not State.STOPPING:
            self._cancel_ttl()
            if run.health is not None:
                run.health.cancel()
            run.stop_began = now
            self._set_state(State.STOPPING)
            how = "cmd_stop" if run.spec.cmd_stop.strip() else "SIGTERM to its process group"
            logger.info('model "%s" stopping %s: pid %d, %s, SIGKILL after %g s', self._model_id,
                        why, run.pid, how, timeout)
            self._spawn(self._stop_gracefully(run), f"upstream {self._model_id} stop")
        elif run.kill_at is not None and run.kill_at <= kill_at:
            return
        if run.kill_timer is not None:
            run.kill_timer.cancel()
        assert self._loop is not None
        run.kill_at = kill_at
        run.kill_timer = self._loop.call_at(kill_at, self._post, _KillDue(run.gen))

    def _on_kill_due(self, gen: int) -> None:
        run = self._run
        if run is None or run.gen != gen or run.proc.returncode is not None:
            return
        waited = self._now() - (run.stop_began or self._now())
        logger.warning('model "%s" (pid %d) did not exit %.1f s after %s; sending SIGKILL to its '
                       "process group", self._model_id, run.pid, waited,
                       "cmd_stop" if run.spec.cmd_stop.strip() else "SIGTERM")
        _signal_group(run.pid, signal.SIGKILL)

    async def _on_exited(self, gen: int, code: int) -> None:
        run = self._run
        if run is None or run.gen != gen:
            return
        self._run = None
        # Whatever the server started and left in its group (a wrapper script's children)
        # goes with it: nothing may keep holding the GPU.
        _signal_group(run.pid, signal.SIGKILL)
        if self._records is not None:
            self._records.remove(run.pid)
        self._cancel_ttl()
        if run.health is not None:
            run.health.cancel()
        if run.kill_timer is not None:
            run.kill_timer.cancel()
        previous = self._state
        if previous is State.STARTING:
            self._fail_start(self._start_error(run, "exited", code))
        elif previous is State.READY:
            last = [line for line in run.tail if line.strip()][-1:]
            logger.warning('model "%s" (pid %d, %s) exited unexpectedly with %s%s; it restarts '
                           "on the next request", self._model_id, run.pid, run.spec.proxy,
                           _describe_exit(code),
                           f" (last output: {_clip(last[0], 300)})" if last else "")
            self._set_state(State.STOPPED)
        else:  # STOPPING
            took = self._now() - (run.stop_began or self._now())
            logger.info('model "%s" stopped (pid %d, exit %s) in %.2f s', self._model_id,
                        run.pid, _describe_exit(code), took)
            if run.start_failure == "timeout":
                self._fail_start(self._start_error(run, "timeout", code))
            else:
                if run.start_failure is not None:
                    _fail_all(self._waiters, self._start_error(run, "aborted", code))
                    self._waiters = []
                self._set_state(State.STOPPED)
            _resolve_all(self._stop_waiters)
            self._stop_waiters = []
        if self._next_waiters and not self._closing:
            self._waiters, self._next_waiters = self._next_waiters, []
            await self._start()

    # -- TTL --------------------------------------------------------------------------------------

    def _cancel_ttl(self) -> None:
        if self._ttl_timer is not None:
            self._ttl_timer.cancel()
            self._ttl_timer = None

    def _ttl_due(self, run: _Run) -> float | None:
        """When the idle unload is due, or None when it must not happen now."""
        if (self._state is not State.READY or run.spec.ttl <= 0 or self._in_flight > 0
                or self._ready_at is None):
            return None
        return max(self._last_done, self._ready_at, self._last_ensure) + run.spec.ttl

    def _schedule_ttl(self) -> None:
        """One timer at the exact due time, rescheduled on activity: no once-a-second polling."""
        self._cancel_ttl()
        run = self._run
        due = self._ttl_due(run) if run is not None else None
        if run is None or due is None:
            return
        assert self._loop is not None
        self._ttl_timer = self._loop.call_at(due, self._post, _TtlDue(run.gen))

    def _on_ttl_due(self, gen: int) -> None:
        self._ttl_timer = None
        run = self._run
        if run is None or run.gen != gen:
            return
        due = self._ttl_due(run)
        if due is None:
            return  # busy or no longer ready; request_finished reschedules
        now = self._now()
        if now + 0.001 < due:  # activity moved the deadline on
            self._schedule_ttl()
            return
        logger.info('model "%s" (pid %d) idle for %.1f s (ttl %g s); unloading', self._model_id,
                    run.pid, now - (due - run.spec.ttl), run.spec.ttl)
        self._begin_stop(run, run.spec.unload_timeout, why="after its ttl")

    # -- helper tasks (side effects only; they report back through the queue) ---------------------

    async def _pump_output(self, run: _Run) -> None:
        """Copy the upstream's stdout+stderr, line by line, into its log for its whole life."""
        stream = run.proc.stdout
        assert stream is not None
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than STREAM_LIMIT: its bytes were dropped
                line = "[gpuproxy: an output line longer than 1 MiB was dropped]"
            else:
                if not raw:
                    return
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            run.tail.append(line)
            self._log.publish(line)

    async def _watch_exit(self, run: _Run) -> None:
        """Wait for the leader's exit (asyncio reaps it), sweep its group, then report it."""
        code = await run.proc.wait()
        if _signal_group(run.pid, signal.SIGKILL):
            logger.warning('model "%s": processes of group %d outlived pid %d; sent SIGKILL',
                           self._model_id, run.pid, run.pid)
            deadline = self._now() + GROUP_SWEEP_WAIT
            # Orphans are reaped by init, not us, and nothing signals their end: poll briefly.
            while _signal_group(run.pid, 0) and self._now() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        if run.reader is not None:  # the last lines often explain the exit; let them land
            await asyncio.wait({run.reader}, timeout=READER_DRAIN)
        self._post(_Exited(run.gen, code))

    async def _poll_health(self, gen: int, url: str, deadline: float) -> None:
        last = "no answer yet"
        timeout = httpx.Timeout(HEALTH_TRY_TIMEOUT)
        async with httpx.AsyncClient(trust_env=False, timeout=timeout) as client:
            while True:
                try:
                    response = await client.get(url)
                except httpx.ConnectError:
                    last = "connection refused"
                except httpx.TimeoutException:
                    last = f"no answer within {HEALTH_TRY_TIMEOUT:g} s"
                except httpx.HTTPError as exc:
                    last = f"last error: {type(exc).__name__}"
                else:
                    if response.status_code == 200:
                        self._post(_Healthy(gen))
                        return
                    last = f"last answer: HTTP {response.status_code}"
                remaining = deadline - self._now()
                if remaining <= 0:
                    self._post(_HealthTimedOut(gen, last))
                    return
                await asyncio.sleep(min(HEALTH_POLL_INTERVAL, remaining))

    async def _stop_gracefully(self, run: _Run) -> None:
        """`cmd_stop` with ${PID} filled in (never through a shell), else SIGTERM to the group."""
        template = run.spec.cmd_stop.strip()
        if not template:
            _signal_group(run.pid, signal.SIGTERM)
            return
        try:
            argv = split_command(template.replace("${PID}", str(run.pid)))
        except ValueError as exc:
            logger.warning('model "%s": cmd_stop unusable (%s); sending SIGTERM to pid %d instead',
                           self._model_id, exc, run.pid)
            _signal_group(run.pid, signal.SIGTERM)
            return
        try:
            stopper = await asyncio.create_subprocess_exec(
                *argv, env={**os.environ, **run.spec.env}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            logger.warning('model "%s": cmd_stop %r could not run (%s); sending SIGTERM to pid '
                           "%d instead", self._model_id, argv[0], exc.strerror or exc, run.pid)
            _signal_group(run.pid, signal.SIGTERM)
            return
        limit = max(run.spec.unload_timeout, FAILED_START_GRACE) + 5.0
        try:
            output, _ = await asyncio.wait_for(stopper.communicate(), limit)
        except TimeoutError:
            logger.warning('model "%s": cmd_stop still running after %g s; killed it (pid %d is '
                           "SIGKILLed by its own deadline)", self._model_id, limit, run.pid)
            output = b""
        finally:
            if stopper.returncode is None:  # timed out or cancelled: don't leave it behind
                with contextlib.suppress(ProcessLookupError):
                    stopper.kill()
                await stopper.wait()
        for line in output.decode("utf-8", errors="replace").splitlines():
            self._log.publish(line)
        if stopper.returncode:
            logger.warning('model "%s": cmd_stop exited with %s; waiting for pid %d to exit',
                           self._model_id, _describe_exit(stopper.returncode), run.pid)


def _resolve_all(futures: Iterable[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():  # a cancelled caller left; the others still get their answer
            future.set_result(None)


def _fail_all(futures: Iterable[asyncio.Future[None]], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)


async def stop_all(processes: Iterable[UpstreamProcess],
                   timeout: float | None = None) -> None:  # noqa: ASYNC109 (a grace period)
    """Stop many upstreams in parallel and wait for all; one failing stop does not skip others."""
    procs = list(processes)
    results = await asyncio.gather(*(p.stop(timeout) for p in procs), return_exceptions=True)
    for proc, result in zip(procs, results, strict=True):
        if isinstance(result, BaseException):
            logger.error('model "%s": stop failed: %r', proc.spec.model_id, result)


async def close_all(processes: Iterable[UpstreamProcess]) -> None:
    """Close many upstreams in parallel (proxy shutdown)."""
    procs = list(processes)
    results = await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)
    for proc, result in zip(procs, results, strict=True):
        if isinstance(result, BaseException):
            logger.error('model "%s": close failed: %r', proc.spec.model_id, result)
