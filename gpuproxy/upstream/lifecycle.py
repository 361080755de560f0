"""The transitions of one upstream's lifecycle: start, ready, stop, exit and idle unload.

The middle layer of `UpstreamProcess` (the three are described in `run_helpers`): the handlers
the owner task calls for the events on its queue, and the start and stop its requests begin.
Only the owner runs them, one message at a time, so they alone (with the requests' handlers
in `processes`) write the state, the run and the waiter lists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shlex
from collections.abc import Iterable

from activity import events
from gpuproxy.upstream.messages import KillDue, TtlDue, fail_all, resolve_all
from gpuproxy.upstream.orphans import RUN_MARK, command_of, pdeathsig_argv, start_time
from gpuproxy.upstream.process_group import (
    FAILED_START_GRACE,
    KILL_GIVE_UP,
    STREAM_LIMIT,
    LeaderProtocol,
    Run,
    check_executable,
    leader_alive,
    pid_list,
    proc_state,
)
from gpuproxy.upstream.readiness import port_holder, port_of
from gpuproxy.upstream.run_helpers import RunHelpers
from gpuproxy.upstream.states import StartFailed, State, clip, describe_exit
from scheduling.spec import upstream_env

# The lifecycle's log lines all go under one name, whichever module writes them: it is
# what operators (and the tests) filter on.
logger = logging.getLogger("gpuproxy.upstream.processes")


class Lifecycle(RunHelpers):
    """`UpstreamProcess`'s transitions (see the module's docstring); not used on its own."""

    # -- start ------------------------------------------------------------------------------------

    async def _start(self) -> None:
        spec = self._spec
        self._gen += 1
        self._started_at = self._now()
        self._ready_at = None
        self._set_state(State.STARTING)
        port = port_of(spec.proxy)
        try:
            argv = spec.argv()
        except ValueError as exc:
            self._fail_start(StartFailed(
                spec.model_id, "spawn", f"could not start: {exc} (cmd: {clip(spec.cmd, 200)})",
                summary="could not be started: its command is not valid", port=port,
                cmd=spec.cmd, remedy="check the model's cmd"))
            return
        cmd = shlex.join(argv)
        shown = clip(cmd, 200)
        held = await port_holder(spec)
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
            check_executable(argv[0], env.get("PATH"))
            transport, protocol = await loop.subprocess_exec(
                lambda: LeaderProtocol(STREAM_LIMIT, loop), *pdeathsig_argv(argv), env=env,
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
        run = self._run = Run(gen=self._gen, spec=spec, cmd=cmd, proc=proc,
                               transport=transport, exited=protocol.exited, mark=mark,
                               leader_start=start_time(proc.pid), port=port)
        if self._records is not None:
            self._records.add(spec.model_id, proc.pid, cmd, mark)
        logger.info('model "%s" starting: pid %d, proxy %s, cmd %s', spec.model_id, proc.pid,
                    spec.proxy, shown)
        self._report(events.LOAD, proc.pid, None)
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
        if run is None or run.gen != gen or self._state is not State.STARTING:
            return
        if not leader_alive(run):
            # Something answered, but not a process of ours: the exit, already under way,
            # fails the start (a launcher that daemonised its server ends up here).
            return
        self._become_ready(run)

    def _become_ready(self, run: Run) -> None:
        now = self._now()
        self._ready_at = now
        self._last_error = None
        self._set_state(State.READY)
        assert self._started_at is not None
        logger.info('model "%s" ready in %.2f s at %s (pid %d)', self._model_id,
                    now - self._started_at, run.spec.proxy, run.pid)
        self._report(events.READY, run.pid, now - self._started_at)
        self._members(run)  # recorded now, so a crash of the proxy reaches them too
        resolve_all(self._waiters)
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

    def _fail_start(self, error: StartFailed, pid: int | None = None) -> None:
        took = None if self._started_at is None else self._now() - self._started_at
        code = "" if error.exit_code is None else f", {describe_exit(error.exit_code)}"
        self._report(events.START_FAILED, pid, took, f"{error.reason}{code}")
        self._last_error = error
        self._set_state(State.FAILED)
        logger.error("%s", error)
        fail_all(self._waiters, error)
        self._waiters = []

    def _start_error(self, run: Run, reason: str, code: int | None) -> StartFailed:
        spec, shown, tail = run.spec, clip(run.cmd, 200), list(run.tail)
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
                f"failed to start: command exited with {describe_exit(code)} during start "
                f"(cmd: {shown}){left}",
                summary=f"failed to start: its command exited with {describe_exit(code)} "
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

    def _aborted(self, run: Run | None, code: int | None = None,
                 tail: Iterable[str] = ()) -> StartFailed:
        pid = f" (pid {run.pid})" if run is not None else ""
        return StartFailed(self._model_id, "aborted", f"start aborted: stopped while starting{pid}",
                           summary="start aborted: stopped while starting",
                           port=run.port if run is not None else None,
                           cmd=run.cmd if run is not None else "", exit_code=code,
                           output_tail=tail)

    # -- stop -------------------------------------------------------------------------------------

    def _begin_stop(self, run: Run, timeout: float, why: str) -> None:
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
        run.kill_timer = self._loop.call_at(kill_at, self._post, KillDue(run.gen))


    def _on_kill_due(self, gen: int) -> None:
        run = self._run
        if run is None or run.gen != gen:
            return
        run.kill_timer = None
        members = self._members(run)
        if run.leader_gone and not members:
            return
        waited = self._now() - (run.stop_began or self._now())
        what = "its process group" + (f" and pids {pid_list(members)}" if members else "")
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
                     "up on it", self._model_id, run.pid, KILL_GIVE_UP, proc_state(run.pid))
        run.survivors[run.pid] = run.leader_start or ""
        self._on_leader_exited(gen, None)

    def _on_leader_exited(self, gen: int, code: int | None) -> None:
        """The leader is gone; the run ends (`Exited`) once its members are too. An exit
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
                           describe_exit(code),
                           f" (last output: {clip(last[0], 300)})" if last else "")
            up = None if self._ready_at is None else self._now() - self._ready_at
            self._report(events.CRASH, run.pid, up, describe_exit(code))
            self._set_state(State.STOPPED)
        elif previous is State.STARTING:
            run.start_failure = "exited"
        if previous is not State.STOPPING and members:
            run.left_at_exit = [f"pid {p} ({clip(command_of(p), 120)})" for p in members]
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
            self._fail_start(self._start_error(run, "exited", code), run.pid)
        elif previous is State.STOPPING:
            took = self._now() - (run.stop_began or self._now())
            logger.info('model "%s" stopped (pid %d, exit %s) in %.2f s', self._model_id,
                        run.pid, describe_exit(code), took)
            if run.start_failure == "timeout":
                self._fail_start(self._start_error(run, "timeout", code), run.pid)
            else:
                self._report(events.IDLE_UNLOAD if run.idle_stop else events.UNLOAD, run.pid,
                             took, describe_exit(code))
                if run.start_failure is not None:
                    fail_all(self._waiters, self._start_error(run, "aborted", code))
                    self._waiters = []
                self._set_state(State.STOPPED)
        resolve_all(self._stop_waiters)
        self._stop_waiters = []
        if self._next_waiters and not self._closing:
            self._waiters, self._next_waiters = self._next_waiters, []
            await self._start()

    # -- TTL --------------------------------------------------------------------------------------

    def _cancel_ttl(self) -> None:
        if self._ttl_timer is not None:
            self._ttl_timer.cancel()
            self._ttl_timer = None

    def _ttl_due(self, run: Run) -> float | None:
        """When the idle unload is due, or None when it must not happen now."""
        if (self._state is not State.READY or run.spec.ttl <= 0 or self._busy
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
        self._ttl_timer = self._loop.call_at(due, self._post, TtlDue(run.gen))

    def _on_ttl_due(self, gen: int) -> None:
        self._ttl_timer = None
        run = self._run
        if run is None or run.gen != gen:
            return
        due = self._ttl_due(run)
        if due is None:
            return  # busy or no longer ready; serving(False) reschedules
        now = self._now()
        if now + 0.001 < due:  # activity moved the deadline on
            self._schedule_ttl()
            return
        logger.info('model "%s" (pid %d) idle for %.1f s (ttl %g s); unloading', self._model_id,
                    run.pid, now - (due - run.spec.ttl), run.spec.ttl)
        run.idle_stop = True
        self._begin_stop(run, run.spec.unload_timeout, why="after its ttl")
