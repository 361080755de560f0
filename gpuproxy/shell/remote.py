"""A request process's view of the running proxy under `serve --workers N`: `ProxyPort`,
answered by the scheduler process over its Unix socket (the hub, gpuproxy/shell/hub.py).

This process parses, authenticates and relays its own requests; the scheduler process owns
the run loop and the upstream processes. What this side keeps is only what the hub pushed:
the catalog, each upstream's state, pid and address, `/running`, and the database's health;
everything else (a grant, a load, a read of the books, logs, metrics) is a frame and its
answer. Frames are `gpuproxy/shell/wire.py`'s.

When the scheduler process is gone, every request waiting for a grant gets
`503 scheduler_unavailable` (never a replay: its body may not be idempotent), new ones get
the same at once, and the link reconnects to the scheduler the supervisor restarts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from gpuproxy.shell import local, wire
from gpuproxy.shell.instance import DatabaseStatus
from gpuproxy.shell.run_loop import Waiting
from gpuproxy.upstream import relay
from gpuproxy.upstream.logbuffer import PROXY
from gpuproxy.upstream.logbuffer import registry as log_registry
from gpuproxy.upstream.states import State
from scheduling import live
from scheduling.catalog import Catalog
from scheduling.core.effects import Scheduler
from scheduling.core.errors import SchedulerUnavailable
from scheduling.core.events import Dispatch
from scheduling.live import ModelLive, ProxyNotRunning
from scheduling.spec import UpstreamSpec

logger = logging.getLogger("gpuproxy.shell.remote")
T = TypeVar("T")

RECONNECT_MAX = 1.0  # seconds between attempts to reach a restarted scheduler process
CONNECT_WITHIN = 30.0  # a request process that cannot reach the scheduler at start fails
EXIT_REPORT_WITHIN = 5.0  # seconds to wait for the scheduler to hear of an exit seen here


class RemoteUpstream:
    """One model's process as the scheduler process last described it (`UpstreamView`)."""

    __slots__ = ("_link", "last_error", "model", "pid", "spec", "state")

    def __init__(self, link: RemoteRuntime, model: str, state: State, pid: int | None,
                 spec: UpstreamSpec, last_error: BaseException | None) -> None:
        self._link = link
        self.model = model
        self.state = state
        self.pid = pid
        self.spec = spec
        self.last_error = last_error

    async def exit_reported(self, pid: int | None, within: float) -> bool:
        """The kernel says here whether `pid` exited within `within` (a pidfd works on any
        process); once it has, the scheduler process is sure to hear of it, so its report is
        awaited for longer than `within`: that process has other work to do first, and a
        request that gave up too early would fail instead of waiting for the restart."""
        if not await relay.exited(pid, within):
            return False
        try:
            return bool(await self._link.call("exit_reported", self.model, pid,
                                              EXIT_REPORT_WITHIN))
        except SchedulerUnavailable:
            return True  # its upstreams went with it


class RemoteGrant:
    """A grant held in the scheduler process; `release()` tells it, exactly once."""

    __slots__ = ("_id", "_link", "_released", "dispatch", "model", "swap_wait")

    def __init__(self, link: RemoteRuntime, rid: int, model: str, dispatch: Dispatch | None,
                 swap_wait: float | None) -> None:
        self._link = link
        self._id = rid
        self.model = model
        self.dispatch = dispatch
        self.swap_wait = swap_wait
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._link.send(("release", self._id))


class _Acquire:
    __slots__ = ("done", "waiting")

    def __init__(self, done: asyncio.Future[RemoteGrant], waiting: Waiting) -> None:
        self.done = done
        self.waiting = waiting


class RemoteRuntime:
    """`ProxyPort` for a request process (see the module's docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.catalog = Catalog()
        self.db_status: DatabaseStatus | None = None
        self._upstreams: dict[str, RemoteUpstream] = {}
        self._running: list[dict[str, Any]] = []
        self._channel: wire.Channel | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._acquires: dict[int, _Acquire] = {}
        self._feeds: dict[int, asyncio.Queue[str]] = {}
        self._watchers = 0  # dashboards open here: the hub tells us of changes while > 0
        self._connected = asyncio.Event()
        self.ever_connected = False
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.control: RemoteControl | None = None

    # ---- the link -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler-link")
        self.control = RemoteControl(self, asyncio.get_running_loop())
        live.attach(self.control)
        from activity.writer import writer as activity_writer

        activity_writer().start()
        self._spawn(self._forward_proxy_log())

    async def wait_connected(self, within: float = CONNECT_WITHIN) -> None:
        async with asyncio.timeout(within):
            await self._connected.wait()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay, warned = 0.05, False
        while not self._closing:
            try:
                _, channel = await loop.create_unix_connection(
                    lambda: wire.Channel(self._on_frame), self.path)
            except OSError as exc:
                if not warned:
                    logger.warning("cannot reach the scheduler process at %s (%s); requests "
                                   "get 503 scheduler_unavailable until it is back", self.path,
                                   exc)
                    warned = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX)
                continue
            self._channel = channel
            self.send(("hello", os.getpid(), self._watchers > 0))
            try:
                await channel.closed
            finally:
                self._lost(channel)
            if not self._closing:
                logger.warning("lost the scheduler process; reconnecting (requests get 503 "
                               "scheduler_unavailable meanwhile)")
            warned, delay = True, 0.05

    def _lost(self, channel: wire.Channel) -> None:
        """Every wait and call in flight gets its error now: nobody waits for a scheduler
        that is gone (and its upstreams with it)."""
        self._connected.clear()
        self._channel = None
        channel.close()
        gone = SchedulerUnavailable()
        for entry in self._acquires.values():
            if not entry.done.done():
                entry.done.set_exception(gone)
        self._acquires.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(gone)
        self._calls.clear()
        for state in self._upstreams.values():
            state.state, state.pid = State.STOPPED, None
        self._running = []
        for queue in self._feeds.values():  # a log being followed says why it went quiet
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait("gpuproxy: the scheduler process is gone (the supervisor "
                                 "restarts it); open the log again to follow it")

    def send(self, frame: tuple[Any, ...]) -> None:
        channel = self._channel
        if channel is not None:
            channel.send(frame)

    async def call(self, name: str, *args: Any) -> Any:
        """Ask the hub, and wait for its answer (its exception is raised here)."""
        if self._channel is None:
            raise SchedulerUnavailable()
        return await wire.call(self.send, self._calls, next(self._ids), name, args)

    def _on_frame(self, frame: tuple[Any, ...]) -> None:
        """One frame from the hub (`wire.Channel` calls it, in order)."""
        kind = frame[0]
        if kind == "granted":
            _, rid, model, dispatch, swap_wait = frame
            entry = self._acquires.pop(rid, None)
            if entry is None or entry.done.done():
                self.send(("release", rid))  # its asker left meanwhile
            else:
                entry.done.set_result(RemoteGrant(self, rid, model, dispatch, swap_wait))
        elif kind == "refused":
            entry = self._acquires.pop(frame[1], None)
            if entry is not None and not entry.done.done():
                entry.done.set_exception(wire.error_from(frame[2]))
        elif kind == "waits" or kind == "position":
            entry = self._acquires.get(frame[1])
            if entry is not None:
                entry.waiting.position = frame[2]
                (entry.waiting.waits if kind == "waits"
                 else entry.waiting.position_changed).set()
        elif kind == "reply":
            wire.answer(self._calls, frame)
        elif kind == "line":
            queue = self._feeds.get(frame[1])
            if queue is not None:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(frame[2])
        elif kind == "catalog":
            self.catalog = frame[1]
            self._connected.set()
            self.ever_connected = True
        elif kind == "upstreams":
            self._mirror(frame[1], frame[2])
        elif kind == "database":
            self.db_status = frame[1]
        elif kind == "changed":
            from gpuproxy.observe import published

            published.changed()
        elif kind == "call":
            self._spawn(self._answer(frame[1], frame[2], frame[3]))
        else:
            logger.error("unknown frame %r from the scheduler process", kind)

    def _mirror(self, states: dict[str, tuple[State, int | None, UpstreamSpec, Any]],
                running: list[dict[str, Any]]) -> None:
        for model, (state, pid, spec, error_state) in states.items():
            error = wire.error_from(error_state) if error_state is not None else None
            view = self._upstreams.get(model)
            if view is None:
                self._upstreams[model] = RemoteUpstream(self, model, state, pid, spec, error)
            else:
                view.state, view.pid, view.spec, view.last_error = state, pid, spec, error
        self._running = running
        from gpuproxy.observe import published

        published.changed()

    async def _answer(self, cid: int, name: str, args: tuple[Any, ...]) -> None:
        """A question from the hub about this process (its metrics, its requests)."""
        try:
            if name == "metrics":  # text: the hub merges it with the others
                body, _ = await local.local_metrics_text("")
                value: Any = (os.getpid(), body)
            elif name == "requests":
                value = local.local_requests()
            elif name == "cancel_request":
                from gpuproxy.observe import inflight

                value = inflight.cancel(args[0])
            else:
                raise ValueError(f"no such question: {name}")
            self.send(("reply", cid, True, value))
        except Exception as exc:
            self.send(("reply", cid, False, wire.error_state(exc)))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward_proxy_log(self) -> None:
        """This process's own log lines join the scheduler process's proxy log, so that
        `/logs/stream/proxy` is one log whichever process answers it."""
        with log_registry.get(PROXY).subscribe() as queue:
            while True:
                line = await queue.get()
                self.send(("log", line))

    def watch_changes(self, on: bool) -> None:
        """A dashboard opened (or closed) here: ask the hub to say when the books change."""
        self._watchers += 1 if on else -1
        if (self._watchers == 1 and on) or (self._watchers == 0 and not on):
            self.send(("watch", self._watchers > 0))

    async def close(self) -> None:
        self._closing = True
        if self.control is not None:
            live.detach(self.control)
        if self._channel is not None:
            self._channel.close()
        for task in [self._task, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._task, *self._tasks] if t is not None],
                             return_exceptions=True)

    # ---- ProxyPort ------------------------------------------------------------------------

    async def acquire(self, model: str, priority: int = 0, deadline: float | None = None,
                      watch: Callable[[Waiting], None] | None = None, *,
                      age: float = 0.0, request_id: str = "") -> RemoteGrant:
        if self._channel is None:
            raise SchedulerUnavailable()
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        done: asyncio.Future[RemoteGrant] = loop.create_future()
        waiting = Waiting(loop.create_future(), model=model)
        if watch is not None:
            watch(waiting)
        self._acquires[rid] = _Acquire(done, waiting)
        self.send(("acquire", rid, model, priority, deadline, watch is not None, age,
                   request_id))
        try:
            return await done
        except asyncio.CancelledError:
            # Withdrawn; a grant that raced the cancel is released by the hub on this word.
            if self._acquires.pop(rid, None) is not None or not done.cancelled():
                self.send(("cancel", rid))
            if done.done() and not done.cancelled() and done.exception() is None:
                done.result().release()
            raise
        finally:
            self._acquires.pop(rid, None)

    async def load(self, model: str) -> str:
        return str(await self.call("load", model))

    async def unload(self, models: Iterable[str]) -> None:
        await self.call("unload", list(models))

    async def unload_all(self) -> None:
        await self.call("unload_all")

    def restart(self, models: Iterable[str]) -> None:
        self.send(("call", next(self._ids), "restart", (list(models),)))

    async def inspect(self, read: Callable[[Scheduler, float], T]) -> T:
        result: T = await self.call("inspect", read)
        return result

    def upstream(self, model: str) -> RemoteUpstream | None:
        return self._upstreams.get(model)

    def upstream_process(self, model: str) -> RemoteUpstream:
        view = self._upstreams.get(model)
        if view is None:  # granted before any state of it reached us: not yet started here
            view = self._upstreams[model] = RemoteUpstream(
                self, model, State.STOPPED, None, self.catalog.models[model].spec, None)
        return view

    def running(self) -> list[dict[str, Any]]:
        return list(self._running)

    @contextlib.asynccontextmanager
    async def log_feed(self, sources: list[str], history: bool
                       ) -> AsyncIterator[tuple[list[str], asyncio.Queue[str]]]:
        fid = next(self._ids)
        queue: asyncio.Queue[str] = asyncio.Queue(1000)
        self._feeds[fid] = queue
        try:
            past = await self.call("feed_open", fid, sources, history)
            yield past, queue
        finally:
            self._feeds.pop(fid, None)
            self.send(("feed_close", fid))

    async def metrics_text(self, accept: str) -> tuple[bytes, str]:
        body, content_type = await self.call("metrics", accept)
        return body, content_type

    async def requests_view(self) -> dict[str, Any]:
        view: dict[str, Any] = await self.call("requests_view")
        return view

    async def cancel_request(self, request_id: str) -> bool:
        return bool(await self.call("cancel_request", request_id))

    async def performance(self, after: dt.datetime | None) -> dict[str, Any] | None:
        answer: dict[str, Any] | None = await self.call("performance", after)
        return answer

    def database_problem(self) -> str | None:
        return local.describe_database(self.db_status)


class RemoteControl:
    """`scheduling.live.LiveProxy` in a request process: the admin's actions and reads go
    to the scheduler process's own `Control`."""

    def __init__(self, link: RemoteRuntime, loop: asyncio.AbstractEventLoop) -> None:
        self._link = link
        self._loop = loop

    def _submit(self, make: Callable[[], Coroutine[Any, Any, T]]
                ) -> concurrent.futures.Future[T]:
        if self._loop.is_closed():
            raise ProxyNotRunning()
        return asyncio.run_coroutine_threadsafe(make(), self._loop)

    def live_models(self) -> dict[str, ModelLive]:
        try:
            models: dict[str, ModelLive] = self._submit(
                lambda: self._link.call("live_models")).result(timeout=10)
        except (SchedulerUnavailable, ProxyNotRunning, concurrent.futures.TimeoutError):
            return {}
        return models

    def load(self, model: str) -> concurrent.futures.Future[str]:
        return self._submit(lambda: self._link.load(model))

    def unload(self, models: list[str]) -> concurrent.futures.Future[None]:
        return self._submit(lambda: self._link.unload(models))

    def restart(self, models: list[str]) -> concurrent.futures.Future[None]:
        return self._submit(lambda: self._link.call("restart", models))

    def reload(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._link.send, ("reload",))


_remote: RemoteRuntime | None = None


async def get(path: str) -> RemoteRuntime:
    """The link to the scheduler process, made (and its first catalog awaited) on first use."""
    global _remote
    if _remote is None:
        _remote = RemoteRuntime(path)
        _remote.start()
    if not _remote.ever_connected:  # at start; later, a lost link answers 503 at once
        try:
            await _remote.wait_connected()
        except TimeoutError:
            raise SchedulerUnavailable() from None
    return _remote


def current() -> RemoteRuntime | None:
    return _remote


async def shutdown() -> None:
    """Close the link and write this process's activity rows before it exits."""
    global _remote
    from activity.writer import writer as activity_writer
    from gpuproxy.upstream import relay

    link, _remote = _remote, None
    if link is not None:
        await link.close()
    await relay.close()
    if not await activity_writer().close(timeout=10.0):
        logger.error("activity writer: %d rows could not be written before exit",
                     activity_writer().buffered)
