"""`serve --workers N` (N > 1): a supervisor, one scheduler process, N request processes.

The supervisor (`Supervisor`) takes the listening socket, starts the scheduler process and
then N request processes on that socket (Daphne adopts it: `fd:fileno=…`), and restarts any
that dies. It owns nothing a request needs. The scheduler process (`run_scheduler`) holds
the instance lock, the run loop and every upstream; its hub (gpuproxy/shell/hub.py) serves
the request processes. Design and protocol: docs/scheduler-design.md §8.

Stopping: SIGTERM or SIGINT to the supervisor reaches every process. The request processes
drain as a one-process `serve` does (503 `shutting_down` for new requests, the grace period
for those in flight); the scheduler process answers every queued request 503 at once, waits
for the request processes to leave, then stops the upstreams. A second signal cuts the drain
short, as it does with one process. SIGHUP to the supervisor reaches the scheduler process
(once it is ready: one that arrives while it starts is passed on when it is), which re-imports
the config file (`-config`, `-config-dir`) or, without one, re-reads the definitions; it also
owns `-watch-config`. The request processes ignore SIGHUP: their catalog is the scheduler
process's. With TLS, each request process wraps the inherited socket itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from gpuproxy.management.config_watch import ConfigSource, Reimporter, on_sighup

logger = logging.getLogger("gpuproxy.serve")

LOCK_EXIT = 3  # the scheduler process could not hold the instance lock: do not restart it
CUT = signal.SIGUSR2  # the supervisor's second signal to its children: end the drain now
RESTART_DELAY = 1.0  # seconds before a process that died is started again
STOP_MARGIN = 15.0  # seconds past the grace period before a process that does not stop is killed


def default_workers(cpus: int | None, sqlite: bool) -> int:
    """One process on a box of at most 2 cores (client, upstream and proxy share them, and
    a second process adds a hop without adding CPU) and on SQLite (one writer); else one
    request process per core, at most 8."""
    if sqlite or cpus is None or cpus <= 2:
        return 1
    return min(cpus, 8)


def listening_socket(host: str, port: int) -> socket.socket:
    """The one socket every request process accepts on; OSError names the cause."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    sock.set_inheritable(True)
    return sock


def _command(*args: str) -> list[str]:
    from gpuproxy.upstream.orphans import pdeathsig_argv

    # Killed with the supervisor, whatever kills it (the upstreams go with the scheduler).
    return pdeathsig_argv([sys.executable, "-m", "gpuproxy.cli", "serve", *args])


class _Process:
    """One child of the supervisor: how to start it, and its current run."""

    def __init__(self, name: str, args: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.args = args
        self.pass_fds = pass_fds
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = False  # this run said it was ready (its signal handlers are in place)

    async def start(self, within: float = 120.0) -> bool:
        """Start it and wait until it says it is ready (a byte on its ready pipe); False,
        with the process killed, when it exits or hangs first."""
        loop = asyncio.get_running_loop()
        self.ready = False
        read_end, write_end = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *_command(*self.args, "--ready-fd", str(write_end)),
                pass_fds=(*self.pass_fds, write_end))
        finally:
            os.close(write_end)
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_end, "rb", 0))
        try:
            async with asyncio.timeout(within):
                said = await reader.read(1)  # b"" once it exits: its end of the pipe closes
        except TimeoutError:
            said = b""
        finally:
            transport.close()
        if said != b"1" and self.proc.returncode is None:
            logger.error("%s (pid %d) did not say it was ready within %g s; killing it",
                         self.name, self.proc.pid, within)
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        self.ready = said == b"1"
        return self.ready

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)


class Supervisor:
    def __init__(self, host: str, port: int, sock: socket.socket, workers: int,
                 hub: Path, grace: float, tls: tuple[str, str] | None = None,
                 config: Path | None = None, watch: bool = False) -> None:
        self.host, self.port = host, port
        self.sock = sock
        self.grace = grace
        self.scheme = "https" if tls else "http"
        family = "INET6" if sock.family == socket.AF_INET6 else "INET"
        # --listen only names the node's address in the fleet view (gpuproxy/shell/fleet.py).
        scheduler_args = ["--role", "scheduler", "--hub", str(hub), "--listen", f"{host}:{port}"]
        if config is not None:
            # What SIGHUP and -watch-config re-import; the start's import is done already.
            scheduler_args += ["--config-dir" if config.is_dir() else "--config", str(config)]
            if watch:
                scheduler_args.append("--watch-config")
        self.scheduler = _Process("the scheduler process", scheduler_args)
        worker_args = ["--role", "worker", "--hub", str(hub), "--listen", f"{host}:{port}",
                       "--fd", f"{sock.fileno()}:{family}"]
        if tls is not None:
            worker_args += ["--tls-cert-file", tls[0], "--tls-key-file", tls[1]]
        self.workers = [
            _Process(f"request process {i}", worker_args, pass_fds=(sock.fileno(),))
            for i in range(1, workers + 1)]
        self.hangup_waiting = False  # a SIGHUP came while the scheduler process was starting
        self.signals = 0
        self.failure: str | None = None
        self._stop = asyncio.Event()
        # Kept open while the supervisor runs: a request process started again gets it too.

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop, signal.Signals(signum).name)
        loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
        try:
            await self._serve(loop)
        finally:
            self.sock.close()

    def _on_hangup(self) -> None:
        """Pass SIGHUP on once the scheduler process handles it: before, it would end it
        (the default), or be ignored and lost."""
        if self.scheduler.ready:
            self.scheduler.signal(signal.SIGHUP)
        else:
            self.hangup_waiting = True

    async def _start_scheduler(self) -> bool:
        ok = await self.scheduler.start()
        if ok and self.hangup_waiting:
            self.hangup_waiting = False
            self.scheduler.signal(signal.SIGHUP)
        return ok

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        if not await self._start_scheduler():
            if not self._stop.is_set():
                self.failure = self._exit_reason(self.scheduler)
            await self._stop_all()
            return
        # Together: each spends its start importing Django, not waiting for the others.
        ready = await asyncio.gather(*(worker.start() for worker in self.workers))
        if self._stop.is_set():  # a stop asked for while they started
            await self._stop_all()
            return
        for worker, ok in zip(self.workers, ready, strict=True):
            if not ok:
                self.failure = self._exit_reason(worker)
                await self._stop_all()
                return
        logger.info("gpuproxy listening on %s://%s:%d (%d request processes, one "
                    "scheduler process)", self.scheme, self.host, self.port, len(self.workers))
        watchers = {loop.create_task(self._watch(p)) for p in (self.scheduler, *self.workers)}
        await self._stop.wait()
        for task in watchers:
            task.cancel()
        await self._stop_all()

    def _on_stop(self, name: str) -> None:
        """The first signal starts every process's drain (SIGTERM); a second cuts it short
        (SIGUSR2). A child treats any number of SIGTERM or SIGINT as one drain: a Ctrl-C on
        a terminal, or a service manager's SIGTERM to the whole group, reaches it directly
        too, and must not count as the second signal."""
        self.signals += 1
        if self.signals == 1:
            logger.info("%s: stopping the request processes (they drain) and the scheduler "
                        "process", name)
        else:
            logger.warning("%s again: cutting the drain short", name)
        self._signal_all(signal.SIGTERM if self.signals == 1 else CUT)
        self._stop.set()

    def _signal_all(self, signum: int) -> None:
        for process in (*self.workers, self.scheduler):
            process.signal(signum)

    @staticmethod
    def _exit_reason(process: _Process) -> str:
        code = process.proc.returncode if process.proc is not None else None
        return (f"{process.name} did not start (exit status {code}); its error is in the log "
                "above")

    async def _watch(self, process: _Process) -> None:
        """Restart `process` whenever it dies unasked, unless it is the scheduler process
        refusing to run (the instance lock): then everything stops with its error."""
        while True:
            assert process.proc is not None
            code = await process.proc.wait()
            if self._stop.is_set():
                return
            if process is self.scheduler and code == LOCK_EXIT:
                self.failure = ("the scheduler process lost the instance lock (see the log "
                                "above); stopping")
                self._on_stop("lock lost")
                return
            logger.error("%s (pid %d) exited with status %s; starting it again", process.name,
                         process.proc.pid, code)
            process.ready = False
            await asyncio.sleep(RESTART_DELAY)
            if self._stop.is_set():
                return
            if process is self.scheduler:
                await self._start_scheduler()
            else:
                await process.start()
            if self._stop.is_set():  # the stop came while it started: it drains too
                process.signal(signal.SIGTERM)
                return

    async def _stop_all(self) -> None:
        """Wait for the request processes, then the scheduler process (it stops the
        upstreams once they are gone); kill what overstays the grace period. SIGTERM again
        to each: a drain hears it once, and one started meanwhile had not heard it."""
        self._signal_all(signal.SIGTERM)
        for group in (self.workers, [self.scheduler]):
            deadline = time.monotonic() + self.grace + STOP_MARGIN
            for process in group:
                if process.proc is None:
                    continue
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                        await process.proc.wait()
                except TimeoutError:
                    logger.error("%s (pid %d) did not stop within %g s; killing it",
                                 process.name, process.proc.pid, self.grace + STOP_MARGIN)
                    process.signal(signal.SIGKILL)
                    await process.proc.wait()


# ---- the scheduler process ----------------------------------------------------------------

def run_scheduler(hub: Path, ready_fd: int, lock: Any,
                  preload: Callable[[], Coroutine[Any, Any, None]],
                  source: ConfigSource | None = None, watch: bool = False) -> int:
    """The scheduler process: the run loop, the upstreams and the hub, until SIGTERM.
    `preload` runs once it is ready (serve's `hooks.on_startup.preload`); `source` is the
    config SIGHUP re-imports, and polls with `watch`."""
    from gpuproxy.shell import runtime

    # The supervisor passes SIGHUP on at any time; before the handler is in place, it must
    # not end the process (its default).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    left = runtime.upstream_records().sweep()
    if left:
        logger.warning("stopped %d upstream(s) left running by an earlier crash: %s",
                       len(left), ", ".join(left))
    return asyncio.run(_scheduler(hub, ready_fd, lock, preload, source, watch))


async def _scheduler(hub_path: Path, ready_fd: int, lock: Any,
                     preload: Callable[[], Coroutine[Any, Any, None]],
                     source: ConfigSource | None, watch: bool) -> int:
    from django.conf import settings

    from gpuproxy.shell import runtime
    from gpuproxy.shell.hub import Hub

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    cut = asyncio.Event()
    failure: list[str] = []

    def on_cut() -> None:
        stop.set()
        cut.set()

    def lost(message: str) -> None:
        failure.append(message)
        loop.call_soon_threadsafe(stop.set)
        loop.call_soon_threadsafe(cut.set)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)  # once or many times: one drain
    loop.add_signal_handler(CUT, on_cut)
    rt = await runtime.get()
    rt.start_watcher()
    reimporter = (Reimporter(source, runtime.run_db, rt.request_reload)
                  if source is not None else None)

    loop.add_signal_handler(signal.SIGHUP, on_sighup, reimporter, rt.request_reload)
    if reimporter is not None and watch:
        reimporter.watch()
    hub = Hub(rt, hub_path)
    await hub.start()
    lock.watch(lost)
    gc.collect()
    gc.freeze()
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    preloading = loop.create_task(preload())
    await stop.wait()
    preloading.cancel()
    if reimporter is not None:
        reimporter.stop()
    logger.info("scheduler process: draining; queued requests get 503 shutting_down")
    await runtime.drain()
    if hub.links and not cut.is_set():
        # The request processes finish what is in flight (their grace period), then leave.
        waits = {loop.create_task(hub.all_gone.wait()), loop.create_task(cut.wait())}
        await asyncio.wait(waits, timeout=settings.GPUPROXY_SHUTDOWN_GRACE + STOP_MARGIN,
                           return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
    await hub.close()
    await runtime.shutdown()
    lock.release()
    if failure:
        logger.error("%s", failure[0])
        return LOCK_EXIT
    return 0
