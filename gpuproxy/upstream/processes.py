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
manager is tested against a real fake upstream (`gpuproxy.testing.fakellm`) without a database.

An upstream is its leader (the process we started) and its members (what the leader started:
`orphans.find_members`). The leader's exit is the upstream's exit, learnt from the child
watcher the moment it happens (`_Protocol`), never from `Process.wait()`, which also waits
for every pipe to close: a member that keeps stdout (a daemonised server, a sidecar) would
hold it for as long as it lives. A stop signals the group and every member; SIGKILL at the
deadline reaches them whether or not the leader is gone; an exit nobody asked for takes the
members with it; the output reader is closed after a short drain. So nothing an upstream
starts can keep a model in `stopping`, a start `ready`, or the proxy's shutdown waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpuproxy.upstream.logbuffer import LogBuffer, registry
from gpuproxy.upstream.orphans import (
    RUN_MARK,
    ProcessRecords,
    command_of,
    find_members,
    pdeathsig_argv,
    signal_members,
    start_time,
)
from scheduling.spec import UpstreamSpec, split_command, upstream_env

logger = logging.getLogger("gpuproxy.upstream.processes")

HEALTH_POLL_INTERVAL = 0.05  # llama-swap polls once a second; readiness must show within 100 ms
HEALTH_TRY_TIMEOUT = 1.0  # one health GET; a wedged upstream must not stall the poll for long
FAILED_START_GRACE = 5.0  # SIGTERM → SIGKILL grace when a start times out (llama-swap: 5 s)
OUTPUT_TAIL_LINES = 20  # lines of upstream output kept on a StartFailed
MESSAGE_TAIL_LINES = 3  # of those, shown in str(StartFailed)
READER_DRAIN = 0.5  # after the exit, how long to wait for the last output before reporting it
GROUP_SWEEP_WAIT = 2.0  # after SIGKILL to leftovers of a group, how long to wait for them to go
KILL_GIVE_UP = 5.0  # after SIGKILL, how long a leader that does not exit is waited for
MEMBER_POLL = 0.05  # members are not our children: nothing signals their end, so poll
PORT_PROBE_TIMEOUT = 0.5  # connecting to the model's port before a start
STREAM_LIMIT = 1 << 20  # longest upstream output line read whole (asyncio's default is 64 KiB)


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class StartFailed(Exception):
    """A start that did not reach `ready`.

    `reason` is `"spawn"` (the command could not be run at all), `"port_in_use"` (something
    else already listens on the model's port), `"exited"` (it exited during the start),
    `"timeout"` (no 200 from the health endpoint in time) or `"aborted"` (a stop or the
    proxy's shutdown ended the start).

    Two messages, because they go to different people: `str()` is the one line an operator
    acts on, with the command, the last output and the remedy, for the log and the admin;
    `public` is what any API client may read: the model, what happened, the port. A command
    line carries `--api-key ...`, and output carries whatever the server prints.
    """

    def __init__(self, model_id: str, reason: str, detail: str, *, summary: str = "",
                 port: int | None = None, cmd: str = "", exit_code: int | None = None,
                 output_tail: Iterable[str] = (), remedy: str = "") -> None:
        self.model_id = model_id
        self.reason = reason
        self.exit_code = exit_code
        self.output_tail = list(output_tail)
        self.cmd = cmd
        self.port = port
        message = f'model "{model_id}" {detail}'
        shown = [_clip(line, 300) for line in self.output_tail if line.strip()]
        if shown:
            message += "; last output: " + " | ".join(shown[-MESSAGE_TAIL_LINES:])
        if remedy:
            message += "; " + remedy
        # Never the detail: it may hold the command line. Every caller gives a summary.
        public = f'model "{model_id}" {summary or f"could not be started ({reason})"}'
        if port is not None:
            public += f" (port {port})"
        if reason in ("spawn", "port_in_use", "exited", "timeout"):
            public += "; the proxy's log has the details"
        self.public = public
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


def _port_of(proxy: str) -> int | None:
    try:
        parts = urlsplit(proxy)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _local_addresses(proxy: str) -> list[str]:
    """Where to probe the model's port from here: its proxy URL's host when that is this
    machine (localhost, a loopback or unspecified address, one of our interfaces' addresses);
    empty for anything else (a remote server, a name we would have to resolve)."""
    try:
        host = urlsplit(proxy).hostname
    except ValueError:
        return []
    if host is None:
        return []
    if host == "localhost":
        return ["127.0.0.1", "::1"]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return []
    if ip.is_unspecified:
        return ["127.0.0.1" if ip.version == 4 else "::1"]
    if ip.is_loopback:
        return [str(ip)]
    import psutil

    ours = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return [str(ip)] if str(ip) in ours else []


def _listener_of(port: int) -> str:
    """Who listens on `port`, for a person: pid and command (psutil maps the socket to its
    process), or a sentence saying it cannot be seen (another user's, another namespace)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        conns = []
    pids = sorted({c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr
                   and c.laddr.port == port and c.pid})
    if not pids:
        return "a process this proxy cannot see (another user's, or a container's)"
    return ", ".join(f"pid {pid} ({_clip(command_of(pid), 200)})" for pid in pids)


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus the leader's exit as it happens.

    The transport hears of the exit from the child watcher and calls `process_exited`
    (base_subprocess._process_exited) whatever its pipes do; `Process.wait()` resolves only
    in `_call_connection_lost`, once every pipe has closed too. `exited` carries the exit
    code (negative: the signal), as `Process.returncode` would."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()

    def process_exited(self) -> None:
        transport = self._transport
        code = transport.get_returncode() if transport is not None else None
        if not self.exited.done():
            self.exited.set_result(code if code is not None else 255)
        super().process_exited()


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
class _LeaderExited:
    gen: int
    code: int | None  # None: given up on after SIGKILL (it never exited)


@dataclass
class _Exited:
    """The run is over: the leader exited, its members are gone (or were given up on), the
    output is in."""

    gen: int
    code: int | None


@dataclass
class _KillDue:
    gen: int


@dataclass
class _TtlDue:
    gen: int


@dataclass
class _RequestDone:
    pass


@dataclass
class _GiveUp:
    gen: int


_Message = (_EnsureReq | _StopReq | _CloseReq | _Healthy | _HealthTimedOut | _LeaderExited
            | _Exited | _KillDue | _GiveUp | _TtlDue | _RequestDone)


@dataclass
class _Run:
    """One spawned process and its helpers; created and dropped only by the owner."""

    gen: int
    spec: UpstreamSpec  # the spec it was started with (update_spec affects only the next run)
    cmd: str
    proc: asyncio.subprocess.Process
    transport: asyncio.SubprocessTransport
    exited: asyncio.Future[int]  # the leader's exit code, the moment it exits
    mark: str  # the value of RUN_MARK in its environment, inherited by all it starts
    leader_start: str | None  # the leader's start time (with its pid, it names the process)
    port: int | None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    reader: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    health: asyncio.Task[None] | None = None
    kill_timer: asyncio.TimerHandle | None = None
    give_up_timer: asyncio.TimerHandle | None = None
    kill_at: float | None = None
    killed_at: float | None = None  # when SIGKILL went to the group and the members
    # Set when a stop ends a start, or the leader exits during it: the start's waiters get
    # this StartFailed reason when the run is over.
    start_failure: str | None = None
    health_detail: str = ""
    stop_began: float | None = None
    leader_gone: bool = False  # the leader exited (or was given up on); members may remain
    members: dict[int, str] = field(default_factory=dict)  # every member seen: pid -> start
    left_at_exit: list[str] = field(default_factory=list)  # members alive when it exited
    survivors: dict[int, str] = field(default_factory=dict)  # members SIGKILL did not end

    @property
    def pid(self) -> int:
        return self.proc.pid


class UpstreamProcess:
    """One upstream server process, started on demand and stopped on request or when idle.

    Bound to the event loop it is first used on; its owner task starts lazily there.
    """

    def __init__(self, spec: UpstreamSpec, log: LogBuffer | None = None,
                 on_state: Callable[[str, State], None] | None = None,
                 records: ProcessRecords | None = None,
                 on_exit: Callable[[str], None] | None = None) -> None:
        self._model_id = spec.model_id
        self._spec = spec  # written by update_spec; read by the owner at the next start
        self._log = log if log is not None else registry.get(spec.model_id)
        self._on_state = on_state
        # Told the moment a leader exits, for whatever reason, before the owner has handled
        # it: the scheduler must not hand out a model whose process is gone.
        self._on_exit = on_exit
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

    async def exit_reported(self, pid: int | None, within: float) -> bool:
        """Whether the run of `pid` has exited and `on_exit` was told (so the scheduler
        counts the model as unloaded), waiting up to `within` seconds for it. A run that is
        no longer the current one has been reported."""
        run = self._run
        if run is None or run.pid != pid:
            return True
        try:
            async with asyncio.timeout(within):
                await asyncio.shield(run.exited)
        except TimeoutError:
            return False
        # `_watch_exit` awaits the same future and was waiting first: its report (a post
        # and a call, no await) ran before this line; one more turn makes sure of it.
        await asyncio.sleep(0)
        return True

    @property
    def pid(self) -> int | None:
        run = self._run
        if run is None or run.leader_gone or run.proc.returncode is not None:
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
                           "cannot start: the proxy is shutting down",
                           summary="cannot start: the proxy is shutting down")

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
            case _LeaderExited(gen, code):
                self._on_leader_exited(gen, code)
            case _Exited(gen, code):
                await self._on_exited(gen, code)
            case _KillDue(gen):
                self._on_kill_due(gen)
            case _GiveUp(gen):
                self._on_give_up(gen)
            case _TtlDue(gen):
                self._on_ttl_due(gen)
            case _RequestDone():
                self._schedule_ttl()

    def _finish_owner(self) -> None:
        """Closed (or the loop is going away): answer everything still waiting, kill leftovers."""
        self._closed = True
        self._cancel_ttl()
        run = self._run
        if run is not None:
            # Only reached if the owner is cancelled mid-life (loop shutdown without close()):
            # never leave an upstream holding a GPU behind us.
            members = self._members(run)
            if not run.leader_gone or members:
                logger.warning('model "%s": owner ended with pid %d still running; SIGKILL to '
                               "its process group and members", self._model_id, run.pid)
                self._kill(run, members)
            run.transport.close()
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
        if self._state is State.STOPPED and self._run is not None:
            self._next_waiters.append(future)  # a crash is being cleaned up: start after it
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
        if run is not None and run.leader_gone:
            # Exited already; what it left is going (SIGKILLed, or under the stop's deadline,
            # which a shorter timeout moves up).
            _fail_all(self._next_waiters, self._aborted(run))
            self._next_waiters = []
            self._stop_waiters.append(future)
            if self._state is State.STOPPING:
                self._begin_stop(run, timeout if timeout is not None else
                                 run.spec.unload_timeout, why="on request")
            return
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
        self._stop_waiters.append(future)
        if run.leader_gone:
            return  # exited already; the run ends when what it left is gone
        if self._state is State.STARTING:
            run.start_failure = "aborted"
        self._begin_stop(run, run.spec.unload_timeout, why="for shutdown")

    # -- start ------------------------------------------------------------------------------------

    async def _start(self) -> None:
        spec = self._spec
        self._gen += 1
        self._started_at = self._now()
        self._ready_at = None
        self._set_state(State.STARTING)
        port = _port_of(spec.proxy)
        try:
            argv = spec.argv()
        except ValueError as exc:
            self._fail_start(StartFailed(
                spec.model_id, "spawn", f"could not start: {exc} (cmd: {_clip(spec.cmd, 200)})",
                summary="could not be started: its command is not valid", port=port,
                cmd=spec.cmd, remedy="check the model's cmd"))
            return
        cmd = shlex.join(argv)
        shown = _clip(cmd, 200)
        held = await self._port_holder(spec)
        if held is not None:
            at, holder = held
            self._fail_start(StartFailed(
                spec.model_id, "port_in_use",
                f"cannot start: port {at} ({spec.proxy}) is already in use by {holder}",
                summary="cannot start: its port is already in use by another process",
                port=at, cmd=cmd, remedy="stop that process, or give the model another port "
                "(a leftover of a crash is stopped when the proxy restarts)"))
            return
        mark = f"{os.getpid()}-{self._gen}-{secrets.token_hex(6)}"
        env = {**upstream_env(spec.env), RUN_MARK: mark}
        loop = asyncio.get_running_loop()
        try:
            _check_executable(argv[0], env.get("PATH"))
            transport, protocol = await loop.subprocess_exec(
                lambda: _Protocol(STREAM_LIMIT, loop), *pdeathsig_argv(argv), env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        except FileNotFoundError:
            why = "its executable was not found"
            detail = f"could not start: executable {argv[0]!r} not found (cmd: {shown})"
        except PermissionError:
            why = "its executable is not executable (permission denied)"
            detail = (f"could not start: executable {argv[0]!r} is not executable "
                      f"(permission denied) (cmd: {shown})")
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in an argument
            strerror = getattr(exc, "strerror", None)
            why = f"its command could not be run ({strerror or type(exc).__name__})"
            detail = f"could not start: {strerror or exc} (cmd: {shown})"
        else:
            why = detail = ""
        if detail:
            self._fail_start(StartFailed(
                spec.model_id, "spawn", detail, summary=f"could not be started: {why}",
                port=port, cmd=cmd, remedy="check the model's cmd"))
            return

        proc = asyncio.subprocess.Process(transport, protocol, loop)
        run = self._run = _Run(gen=self._gen, spec=spec, cmd=cmd, proc=proc,
                               transport=transport, exited=protocol.exited, mark=mark,
                               leader_start=start_time(proc.pid), port=port)
        if self._records is not None:
            self._records.add(spec.model_id, proc.pid, cmd, mark)
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

    async def _port_holder(self, spec: UpstreamSpec) -> tuple[int, str] | None:
        """(port, who holds it) when something already listens on the model's local port.

        Its server would exit with "address already in use" while the health check passed,
        answered by the stranger, which would then serve the model's traffic. Only a
        connection that is accepted counts (a port in TIME_WAIT after our own stop is free)."""
        port = _port_of(spec.proxy)
        if port is None:
            return None
        for address in await asyncio.to_thread(_local_addresses, spec.proxy):
            try:
                async with asyncio.timeout(PORT_PROBE_TIMEOUT):
                    _, writer = await asyncio.open_connection(address, port)
            except (OSError, TimeoutError):
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return port, await asyncio.to_thread(_listener_of, port)
        return None

    def _on_healthy(self, gen: int) -> None:
        run = self._run
        if run is None or run.gen != gen or self._state is not State.STARTING:
            return
        if not _leader_alive(run):
            # Something answered, but not a process of ours: the exit, already under way,
            # fails the start (a launcher that daemonised its server ends up here).
            return
        self._become_ready(run)

    def _become_ready(self, run: _Run) -> None:
        now = self._now()
        self._ready_at = now
        self._last_error = None
        self._set_state(State.READY)
        assert self._started_at is not None
        logger.info('model "%s" ready in %.2f s at %s (pid %d)', self._model_id,
                    now - self._started_at, run.spec.proxy, run.pid)
        self._members(run)  # recorded now, so a crash of the proxy reaches them too
        _resolve_all(self._waiters)
        self._waiters = []
        self._schedule_ttl()

    def _on_health_timed_out(self, gen: int, last_probe: str) -> None:
        run = self._run
        if (run is None or run.gen != gen or self._state is not State.STARTING
                or run.leader_gone):
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

    def _start_error(self, run: _Run, reason: str, code: int | None) -> StartFailed:
        spec, shown, tail = run.spec, _clip(run.cmd, 200), list(run.tail)
        if reason == "exited":
            left = ""
            remedy = ""
            if run.left_at_exit:
                left = (f"; it left {len(run.left_at_exit)} process(es) running, now stopped: "
                        + "; ".join(run.left_at_exit[:3]))
                remedy = ("cmd must run the server in the foreground (no `&`, no daemon mode, "
                          "no `docker run -d`): the proxy watches the process it starts")
            return StartFailed(
                spec.model_id, "exited",
                f"failed to start: command exited with {_describe_exit(code)} during start "
                f"(cmd: {shown}){left}",
                summary=f"failed to start: its command exited with {_describe_exit(code)} "
                "during start", port=run.port, cmd=run.cmd, exit_code=code, output_tail=tail,
                remedy=remedy)
        if reason == "timeout":
            return StartFailed(
                spec.model_id, "timeout",
                f"did not become ready within {spec.health_check_timeout:g} s "
                f"(GET {spec.health_url()} never answered 200; {run.health_detail})",
                summary=f"did not become ready within {spec.health_check_timeout:g} s",
                port=run.port, cmd=run.cmd, exit_code=code, output_tail=tail,
                remedy="raise healthCheckTimeout or check the command")
        if self._closing:
            return StartFailed(spec.model_id, "aborted",
                               f"start aborted: the proxy is shutting down (pid {run.pid})",
                               summary="start aborted: the proxy is shutting down",
                               port=run.port, cmd=run.cmd, exit_code=code, output_tail=tail)
        return self._aborted(run, code, tail)

    def _aborted(self, run: _Run | None, code: int | None = None,
                 tail: Iterable[str] = ()) -> StartFailed:
        pid = f" (pid {run.pid})" if run is not None else ""
        return StartFailed(self._model_id, "aborted", f"start aborted: stopped while starting{pid}",
                           summary="start aborted: stopped while starting",
                           port=run.port if run is not None else None,
                           cmd=run.cmd if run is not None else "", exit_code=code,
                           output_tail=tail)

    # -- stop -------------------------------------------------------------------------------------

    def _begin_stop(self, run: _Run, timeout: float, why: str) -> None:
        """Graceful now, SIGKILL to the group and the members at `timeout`; an earlier
        deadline always wins."""
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
        if run.killed_at is not None:
            return  # SIGKILL went out already
        if run.kill_timer is not None:
            run.kill_timer.cancel()
        assert self._loop is not None
        run.kill_at = kill_at
        run.kill_timer = self._loop.call_at(kill_at, self._post, _KillDue(run.gen))

    def _members(self, run: _Run) -> dict[int, str]:
        """The run's live members now (see orphans.find_members); new ones are recorded on
        disk, so a sweep after a crash of the proxy finds them even without the run mark."""
        found = find_members(run.pid, run.leader_start, run.mark, run.members)
        new = {p: t for p, t in found.items() if p not in run.members}
        if new:
            run.members.update(new)
            if self._records is not None:
                self._records.note_members(run.pid, new)
        return found

    def _kill(self, run: _Run, members: dict[int, str]) -> None:
        """SIGKILL to the leader's group and to every member, wherever it went."""
        if not run.leader_gone or start_time(run.pid) in (None, run.leader_start):
            _signal_group(run.pid, signal.SIGKILL)  # the group id is still ours
        signal_members(members, signal.SIGKILL)
        run.killed_at = self._now()
        if run.kill_timer is not None:
            run.kill_timer.cancel()
            run.kill_timer = None
        if not run.leader_gone and run.give_up_timer is None:
            assert self._loop is not None
            run.give_up_timer = self._loop.call_at(run.killed_at + KILL_GIVE_UP, self._post,
                                                   _GiveUp(run.gen))

    def _on_kill_due(self, gen: int) -> None:
        run = self._run
        if run is None or run.gen != gen:
            return
        run.kill_timer = None
        members = self._members(run)
        if run.leader_gone and not members:
            return
        waited = self._now() - (run.stop_began or self._now())
        what = "its process group" + (f" and pids {_pid_list(members)}" if members else "")
        logger.warning('model "%s" (pid %d) did not exit %.1f s after %s; sending SIGKILL to %s',
                       self._model_id, run.pid, waited,
                       "cmd_stop" if run.spec.cmd_stop.strip() else "SIGTERM", what)
        self._kill(run, members)

    def _on_give_up(self, gen: int) -> None:
        """A leader SIGKILL did not end (stuck in the kernel, say a GPU driver call): stop
        waiting for it, so the model, the scheduler and shutdown go on; the parent-death
        signal still ends it with the proxy, and its record stays for the next start."""
        run = self._run
        if run is None or run.gen != gen or run.leader_gone:
            return
        logger.error('model "%s" (pid %d) did not exit %.0f s after SIGKILL (state %s); giving '
                     "up on it", self._model_id, run.pid, KILL_GIVE_UP, _proc_state(run.pid))
        run.survivors[run.pid] = run.leader_start or ""
        self._on_leader_exited(gen, None)

    def _on_leader_exited(self, gen: int, code: int | None) -> None:
        """The leader is gone; the run ends (`_Exited`) once its members are too. An exit
        nobody asked for takes the members with it at once; during a stop they keep the
        rest of its grace period (a wrapper's child shutting down cleanly)."""
        run = self._run
        if run is None or run.gen != gen or run.leader_gone:
            return
        run.leader_gone = True
        if run.give_up_timer is not None and code is not None:
            run.give_up_timer.cancel()
        if run.health is not None:
            run.health.cancel()
        self._cancel_ttl()
        members = self._members(run)
        previous = self._state
        if previous is State.READY:
            last = [line for line in run.tail if line.strip()][-1:]
            logger.warning('model "%s" (pid %d, %s) exited unexpectedly with %s%s; it restarts '
                           "on the next request", self._model_id, run.pid, run.spec.proxy,
                           _describe_exit(code),
                           f" (last output: {_clip(last[0], 300)})" if last else "")
            self._set_state(State.STOPPED)
        elif previous is State.STARTING:
            run.start_failure = "exited"
        if previous is not State.STOPPING and members:
            run.left_at_exit = [f"pid {p} ({_clip(command_of(p), 120)})" for p in members]
            logger.warning('model "%s": pid %d exited and left %s; sending them SIGKILL',
                           self._model_id, run.pid, ", ".join(run.left_at_exit))
            self._kill(run, members)
        self._spawn(self._finish_run(run, code), f"upstream {self._model_id} finish")

    async def _on_exited(self, gen: int, code: int | None) -> None:
        run = self._run
        if run is None or run.gen != gen:
            return
        self._run = None
        if self._records is not None and not run.survivors:
            self._records.remove(run.pid)  # (kept for the next start's sweep otherwise)
        self._cancel_ttl()
        for timer in (run.kill_timer, run.give_up_timer):
            if timer is not None:
                timer.cancel()
        previous = self._state
        if run.start_failure == "exited":
            self._fail_start(self._start_error(run, "exited", code))
        elif previous is State.STOPPING:
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
        """Report the leader's exit the moment the child watcher sees it (asyncio reaps it),
        whatever its pipes do; tell `on_exit` at once, before the owner handles it. The owner
        hears first (its queue is FIFO): an `ensure_ready` that the scheduler sends because of
        `on_exit` is handled after the exit, never answered "ready" by the dead run."""
        code = await run.exited
        if run.leader_gone:  # given up on after SIGKILL, and long forgotten
            return
        self._post(_LeaderExited(run.gen, code))
        if self._on_exit is not None:
            try:
                self._on_exit(self._model_id)
            except Exception:
                logger.exception('model "%s": on_exit callback failed', self._model_id)

    async def _finish_run(self, run: _Run, code: int | None) -> None:
        """After the leader's exit: wait for the members to go (bounded: GROUP_SWEEP_WAIT
        after SIGKILL, which the owner sends at once for an exit nobody asked for, or at the
        stop's deadline), let the last output land, stop reading the pipe whoever still
        holds it, then end the run."""
        while True:
            left = await asyncio.to_thread(
                find_members, run.pid, run.leader_start, run.mark, dict(run.members))
            if not left:
                break
            new = {p: t for p, t in left.items() if p not in run.members}
            if new:
                run.members.update(new)
                if self._records is not None:
                    self._records.note_members(run.pid, new)
            if run.killed_at is None and run.kill_timer is None:
                self._post(_KillDue(run.gen))  # no stop deadline to wait for: SIGKILL now
            elif run.killed_at is not None and self._now() - run.killed_at >= GROUP_SWEEP_WAIT:
                run.survivors.update(left)
                logger.error('model "%s": pids %s did not exit %g s after SIGKILL (states %s); '
                             "giving up on them", self._model_id, _pid_list(left),
                             GROUP_SWEEP_WAIT, ", ".join(_proc_state(p) for p in left))
                break
            await asyncio.sleep(MEMBER_POLL)
        if run.reader is not None:  # the last lines often explain the exit; let them land
            await asyncio.wait({run.reader}, timeout=READER_DRAIN)
        run.transport.close()  # a pipe a survivor still holds: stop reading it
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

    def _terminate(self, run: _Run) -> None:
        """SIGTERM to the group and to every member outside it (a daemon in a session of its
        own gets no signal sent to its launcher's group)."""
        members = self._members(run)
        if not run.leader_gone:
            _signal_group(run.pid, signal.SIGTERM)
        signal_members(members, signal.SIGTERM)

    async def _stop_gracefully(self, run: _Run) -> None:
        """`cmd_stop` with ${PID} filled in (never through a shell), else SIGTERM to the group
        and the members. `cmd_stop` gets the upstream's environment (without its run mark:
        it is not one of its processes)."""
        template = run.spec.cmd_stop.strip()
        if not template:
            self._terminate(run)
            return
        try:
            argv = split_command(template.replace("${PID}", str(run.pid)))
        except ValueError as exc:
            logger.warning('model "%s": cmd_stop unusable (%s); sending SIGTERM to pid %d instead',
                           self._model_id, exc, run.pid)
            self._terminate(run)
            return
        try:
            stopper = await asyncio.create_subprocess_exec(
                *argv, env=upstream_env(run.spec.env), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            logger.warning('model "%s": cmd_stop %r could not run (%s); sending SIGTERM to pid '
                           "%d instead", self._model_id, argv[0], exc.strerror or exc, run.pid)
            self._terminate(run)
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


def _leader_alive(run: _Run) -> bool:
    """Whether the leader still runs, asked of the kernel without reaping it (WNOWAIT leaves
    its exit status to asyncio's child watcher): the exit notice may still be on its way."""
    if run.leader_gone or run.exited.done() or run.proc.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, run.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already
        return False


def _pid_list(members: Iterable[int]) -> str:
    return ", ".join(str(p) for p in sorted(members))


def _proc_state(pid: int) -> str:
    """A process's state letter (D: stuck in the kernel), for an error a person reads."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "gone"


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
