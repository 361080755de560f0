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
watcher the moment it happens (`process_group.LeaderProtocol`), never from `Process.wait()`,
which also waits for every pipe to close: a member that keeps stdout (a daemonised server, a
sidecar) would hold it for as long as it lives. A stop signals the group and every member;
SIGKILL at the deadline reaches them whether or not the leader is gone; an exit nobody asked
for takes the members with it; the output reader is closed after a short drain. So nothing an
upstream starts can keep a model in `stopping`, a start `ready`, or the proxy's shutdown
waiting.

The class is three layers, a module each (`run_helpers`: its fields and side effects;
`lifecycle`: the transitions; this one: the public methods and the owner task); around them,
`states` (`State`, `StartFailed`), `messages` (the owner's queue), `process_group` (spawning
and signalling) and `readiness` (port and health checks). Callers import from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from gpuproxy.upstream.lifecycle import Lifecycle
from gpuproxy.upstream.messages import (
    CloseReq,
    EnsureReq,
    Exited,
    GiveUp,
    HealthTimedOut,
    Healthy,
    KillDue,
    LeaderExited,
    Message,
    RequestDone,
    StopReq,
    TtlDue,
    fail_all,
    resolve_all,
)
from gpuproxy.upstream.states import StartFailed, State
from scheduling.spec import UpstreamSpec

__all__ = ["StartFailed", "State", "UpstreamProcess", "close_all", "stop_all"]

logger = logging.getLogger("gpuproxy.upstream.processes")


class UpstreamProcess(Lifecycle):
    """One upstream server process, started on demand and stopped on request or when idle.

    Bound to the event loop it is first used on; its owner task starts lazily there. Built
    as `UpstreamProcess(spec, log=None, on_state=None, records=None, on_exit=None,
    on_event=None)`
    (`RunHelpers.__init__`).
    """

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
    def busy(self) -> bool:
        """Whether the scheduler has a request of this model in flight (see `serving`)."""
        return self._busy

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
        self._post(EnsureReq(future))
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
        self._post(StopReq(timeout, future))
        await future

    async def close(self) -> None:
        """Stop the upstream and end the owner task (proxy shutdown); later starts are refused."""
        if self._closed:
            return
        if self._owner is None:  # never used: nothing runs, nothing to stop
            self._closed = True
            return
        future = self._loop_or_raise().create_future()
        self._post(CloseReq(future))
        await future
        with contextlib.suppress(asyncio.CancelledError):
            await self._owner

    def update_spec(self, spec: UpstreamSpec) -> None:
        """Use `spec` for the next start; a running process keeps the spec it was started with."""
        self._spec = spec

    def serving(self, busy: bool) -> None:
        """The run loop's word on whether a request of this model is in flight. The count is
        the scheduler's (its `Ledger`), not kept twice: this process only needs to know that
        the TTL must not unload it now, and when the idle time starts (the last request's end).
        """
        was, self._busy = self._busy, busy
        if was and not busy:
            if self._loop is not None:
                self._last_done = self._loop.time()
            if self._queue is not None and not self._closed:
                self._queue.put_nowait(RequestDone())

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

    async def _handle(self, message: Message) -> None:
        match message:
            case EnsureReq(future):
                await self._on_ensure(future)
            case StopReq(timeout, future):
                self._on_stop(timeout, future)
            case CloseReq(future):
                self._on_close(future)
            case Healthy(gen):
                self._on_healthy(gen)
            case HealthTimedOut(gen, last_probe):
                self._on_health_timed_out(gen, last_probe)
            case LeaderExited(gen, code):
                self._on_leader_exited(gen, code)
            case Exited(gen, code):
                await self._on_exited(gen, code)
            case KillDue(gen):
                self._on_kill_due(gen)
            case GiveUp(gen):
                self._on_give_up(gen)
            case TtlDue(gen):
                self._on_ttl_due(gen)
            case RequestDone():
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
        fail_all(self._waiters, error)
        fail_all(self._next_waiters, error)
        resolve_all(self._stop_waiters)
        assert self._queue is not None
        while not self._queue.empty():
            match self._queue.get_nowait():
                case EnsureReq(future):
                    fail_all([future], error)
                case StopReq(_, future) | CloseReq(future):
                    resolve_all([future])
                case _:
                    pass
        for task in list(self._background):
            task.cancel()

    async def _on_ensure(self, future: asyncio.Future[None]) -> None:
        if self._closing:
            fail_all([future], self._shutting_down())
            return
        if self._state is State.STOPPED and self._run is not None:
            self._next_waiters.append(future)  # a crash is being cleaned up: start after it
            return
        match self._state:
            case State.READY:
                self._last_ensure = self._now()  # a caller is about to use it: not idle now
                self._schedule_ttl()
                resolve_all([future])
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
            fail_all(self._next_waiters, self._aborted(run))
            self._next_waiters = []
            self._stop_waiters.append(future)
            if self._state is State.STOPPING:
                self._begin_stop(run, timeout if timeout is not None else
                                 run.spec.unload_timeout, why="on request")
            return
        match self._state:
            case State.STOPPED | State.FAILED:
                resolve_all([future])
                return
            case State.STOPPING:
                # The later command wins: a stop cancels a start queued behind the current stop.
                fail_all(self._next_waiters, self._aborted(run))
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
        fail_all(self._next_waiters, self._shutting_down())
        self._next_waiters = []
        run = self._run
        if run is None:
            resolve_all([future])
            return
        self._stop_waiters.append(future)
        if run.leader_gone:
            return  # exited already; the run ends when what it left is gone
        if self._state is State.STARTING:
            run.start_failure = "aborted"
        self._begin_stop(run, run.spec.unload_timeout, why="for shutdown")


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
