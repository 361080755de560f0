"""The base of `UpstreamProcess`: the owner's fields and the side effects it starts.

`UpstreamProcess` is built in three layers, a module each, so that each can be read whole:
this one (the fields, the queue plumbing, the signals to the process group and its members,
and the helper tasks that copy output, watch the exit, finish a run, poll health and run
`cmd_stop`), `lifecycle.Lifecycle` (the transitions: start, ready, stop, exit, idle unload)
and `processes.UpstreamProcess` (the public methods, the owner task and the requests it
handles). Nothing here decides a transition (`_set_state` only carries one out): helper
tasks report back, as events on the owner's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from gpuproxy.upstream.logbuffer import LogBuffer, registry
from gpuproxy.upstream.messages import (
    Exited,
    GiveUp,
    HealthTimedOut,
    Healthy,
    KillDue,
    LeaderExited,
    Message,
)
from gpuproxy.upstream.orphans import ProcessRecords, find_members, signal_members, start_time
from gpuproxy.upstream.process_group import (
    FAILED_START_GRACE,
    GROUP_SWEEP_WAIT,
    KILL_GIVE_UP,
    MEMBER_POLL,
    READER_DRAIN,
    Run,
    pid_list,
    proc_state,
    signal_group,
)
from gpuproxy.upstream.readiness import poll_health
from gpuproxy.upstream.states import StartFailed, State, describe_exit
from scheduling.spec import UpstreamSpec, split_command, upstream_env

# The lifecycle's log lines all go under one name, whichever module writes them: it is
# what operators (and the tests) filter on.
logger = logging.getLogger("gpuproxy.upstream.processes")

#: on_event's signature: (model, kind, pid, seconds, detail); kinds are `activity.events`'.
EventSink = Callable[[str, str, int | None, float | None, str], None]


class RunHelpers:
    """`UpstreamProcess`'s fields and side effects (see the module's docstring); not used on
    its own."""

    def __init__(self, spec: UpstreamSpec, log: LogBuffer | None = None,
                 on_state: Callable[[str, State], None] | None = None,
                 records: ProcessRecords | None = None,
                 on_exit: Callable[[str], None] | None = None,
                 on_event: EventSink | None = None) -> None:
        self._model_id = spec.model_id
        self._spec = spec  # written by update_spec; read by the owner at the next start
        self._log = log if log is not None else registry.get(spec.model_id)
        self._on_state = on_state
        # Told the moment a leader exits, for whatever reason, before the owner has handled
        # it: the scheduler must not hand out a model whose process is gone.
        self._on_exit = on_exit
        # Told each model event (`activity.events` kinds) as plain data, for the events table:
        # (model, kind, pid, seconds, detail). The shell adds the reason and writes the row.
        self._on_event = on_event
        self._records = records  # process groups on disk, for the sweep after a crash
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Message] | None = None
        self._owner: asyncio.Task[None] | None = None
        self._closed = False  # set by the owner when it has ended; later calls get no owner
        # Written only by the owner task (_run_owner and the _on_* handlers it calls):
        self._state = State.STOPPED
        self._run: Run | None = None
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
        # Written by `serving()` on the loop thread (the run loop's word: the scheduler counts
        # requests in flight, we do not); the owner reads it when a TTL timer fires, so an
        # in-flight request is always seen (no queue lag).
        self._busy = False
        self._last_done = 0.0

    # -- plumbing ---------------------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        assert self._queue is not None
        self._queue.put_nowait(message)

    def _report(self, kind: str, pid: int | None, seconds: float | None,
                detail: str = "") -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(self._model_id, kind, pid, seconds, detail)
        except Exception:  # a record must never break the lifecycle
            logger.exception('model "%s": on_event callback failed', self._model_id)

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

    def _set_state(self, state: State) -> None:
        self._state = state
        if self._on_state is not None:
            try:
                self._on_state(self._model_id, state)
            except Exception:
                logger.exception('model "%s": on_state callback failed for %s', self._model_id,
                                 state)

    # -- the process group ------------------------------------------------------------------------

    def _members(self, run: Run) -> dict[int, str]:
        """The run's live members now (see orphans.find_members); new ones are recorded on
        disk, so a sweep after a crash of the proxy finds them even without the run mark."""
        found = find_members(run.pid, run.leader_start, run.mark, run.members)
        new = {p: t for p, t in found.items() if p not in run.members}
        if new:
            run.members.update(new)
            if self._records is not None:
                self._records.note_members(run.pid, new)
        return found

    def _kill(self, run: Run, members: dict[int, str]) -> None:
        """SIGKILL to the leader's group and to every member, wherever it went."""
        if not run.leader_gone or start_time(run.pid) in (None, run.leader_start):
            signal_group(run.pid, signal.SIGKILL)  # the group id is still ours
        signal_members(members, signal.SIGKILL)
        run.killed_at = self._now()
        if run.kill_timer is not None:
            run.kill_timer.cancel()
            run.kill_timer = None
        if not run.leader_gone and run.give_up_timer is None:
            assert self._loop is not None
            run.give_up_timer = self._loop.call_at(run.killed_at + KILL_GIVE_UP, self._post,
                                                   GiveUp(run.gen))

    # -- helper tasks (side effects only; they report back through the queue) ---------------------

    async def _pump_output(self, run: Run) -> None:
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

    async def _watch_exit(self, run: Run) -> None:
        """Report the leader's exit the moment the child watcher sees it (asyncio reaps it),
        whatever its pipes do; tell `on_exit` at once, before the owner handles it. The owner
        hears first (its queue is FIFO): an `ensure_ready` that the scheduler sends because of
        `on_exit` is handled after the exit, never answered "ready" by the dead run."""
        code = await run.exited
        if run.leader_gone:  # given up on after SIGKILL, and long forgotten
            return
        self._post(LeaderExited(run.gen, code))
        if self._on_exit is not None:
            try:
                self._on_exit(self._model_id)
            except Exception:
                logger.exception('model "%s": on_exit callback failed', self._model_id)

    async def _finish_run(self, run: Run, code: int | None) -> None:
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
                self._post(KillDue(run.gen))  # no stop deadline to wait for: SIGKILL now
            elif run.killed_at is not None and self._now() - run.killed_at >= GROUP_SWEEP_WAIT:
                run.survivors.update(left)
                logger.error('model "%s": pids %s did not exit %g s after SIGKILL (states %s); '
                             "giving up on them", self._model_id, pid_list(left),
                             GROUP_SWEEP_WAIT, ", ".join(proc_state(p) for p in left))
                break
            await asyncio.sleep(MEMBER_POLL)
        if run.reader is not None:  # the last lines often explain the exit; let them land
            await asyncio.wait({run.reader}, timeout=READER_DRAIN)
        run.transport.close()  # a pipe a survivor still holds: stop reading it
        self._post(Exited(run.gen, code))

    async def _poll_health(self, gen: int, url: str, deadline: float) -> None:
        """Poll the health endpoint (`readiness.poll_health`); report the answer to the owner."""
        await poll_health(url, deadline, self._now, healthy=lambda: self._post(Healthy(gen)),
                          timed_out=lambda last: self._post(HealthTimedOut(gen, last)))

    def _terminate(self, run: Run) -> None:
        """SIGTERM to the group and to every member outside it (a daemon in a session of its
        own gets no signal sent to its launcher's group)."""
        members = self._members(run)
        if not run.leader_gone:
            signal_group(run.pid, signal.SIGTERM)
        signal_members(members, signal.SIGTERM)

    async def _stop_gracefully(self, run: Run) -> None:
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
                           self._model_id, describe_exit(stopper.returncode), run.pid)
