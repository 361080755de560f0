"""The scheduler process's side of `serve --workers N`: a Unix-socket server that puts this
process's `Runtime` (the run loop, the upstreams) behind every request process's
`RemoteRuntime` (gpuproxy/shell/remote.py).

Each request process holds one link. Its requests' waits become ordinary `acquire` calls
here, so the run loop and its pure core do not know there are other processes: a wait the
request process cancels is withdrawn like a client that left, and a link that closes (its
process died) withdraws its waits and releases its grants. What the hub pushes down a link:
the catalog at connect and after every reload, each upstream's state at every change, the
database's health, and, while a dashboard is open there, that the books changed.

What the whole proxy observed is gathered here on demand, never per request: `/metrics`
merges every process's registry (gpuproxy/observe/exposition.py), and the dashboard's request
lists are each request process's own, asked for when a dashboard refreshes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from gpuproxy.observe import exposition, published
from gpuproxy.observe.history import HISTORY, RECENT
from gpuproxy.shell import local, runtime, wire
from gpuproxy.shell.runtime import Runtime
from gpuproxy.upstream.logbuffer import PROXY
from gpuproxy.upstream.logbuffer import registry as log_registry
from scheduling.catalog import Catalog
from scheduling.core.errors import SchedulingError

logger = logging.getLogger("gpuproxy.shell.hub")

ASK_WITHIN = 5.0  # seconds a gather waits for a request process before leaving it out
CHANGES_EVERY = 0.1  # seconds between "changed" pushes to a link with a dashboard open


class _Link:
    """One request process, as the hub serves it."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.channel = wire.Channel(self.dispatch, on_lost=self.close)
        self.pid = 0
        self.waits: dict[int, asyncio.Task[None]] = {}
        self.grants: dict[int, Any] = {}
        self.feeds: dict[int, asyncio.Task[None]] = {}
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.watching = False
        self._ids = 0
        self.send = self.channel.send
        self.metrics = ""  # its exposition at the last scrape (`Hub.rpc_metrics`)
        self.closed_feeds: set[int] = set()  # closed before their feed_open was served

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def ask(self, name: str, *args: Any) -> Any:
        """Ask the request process (its metrics, its requests); its exception is raised."""
        self._ids += 1
        cid = self._ids
        async with asyncio.timeout(ASK_WITHIN):
            return await wire.call(self.send, self.calls, cid, name, args)

    def dispatch(self, frame: tuple[Any, ...]) -> None:
        """One frame from the request process (`wire.Channel` calls it, in order)."""
        kind = frame[0]
        if kind == "acquire":
            _, rid, model, priority, deadline, watched, age, request_id = frame
            self.waits[rid] = self.spawn(self._acquire(rid, model, priority, deadline, watched,
                                                       age, request_id))
        elif kind == "release":
            grant = self.grants.pop(frame[1], None)
            if grant is not None:
                grant.release()
        elif kind == "cancel":
            task = self.waits.pop(frame[1], None)
            if task is not None:
                task.cancel()
            grant = self.grants.pop(frame[1], None)
            if grant is not None:
                grant.release()
        elif kind == "call":
            self.spawn(self._answer(frame[1], frame[2], frame[3]))
        elif kind == "reply":
            wire.answer(self.calls, frame)
        elif kind == "feed_close":
            feed = self.feeds.pop(frame[1], None)
            if feed is not None:
                feed.cancel()
            else:
                self.closed_feeds.add(frame[1])
        elif kind == "log":
            log_registry.get(PROXY).publish(frame[1])
        elif kind == "watch":
            self.watching = bool(frame[1])
        elif kind == "reload":
            self.hub.rt.request_reload()
        elif kind == "hello":
            _, self.pid, self.watching = frame
            self.send(("catalog", self.hub.rt.catalog))
            self.send(self.hub.upstreams_frame())
            self.send(("database", runtime.database_status()))
        else:
            logger.error("unknown frame %r from request process %d", kind, self.pid)

    def close(self) -> None:
        """The request process is gone: its waits are withdrawn, its grants released (the
        scheduler sees clients that left), its feeds closed."""
        for task in self.waits.values():
            task.cancel()
        for grant in self.grants.values():
            grant.release()
        for feed in self.feeds.values():
            feed.cancel()
        for future in self.calls.values():
            if not future.done():
                future.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.metrics and self in self.hub.links:
            self.hub.departed.append(self.metrics)  # its counts stay counted
        self.waits.clear()
        self.grants.clear()
        self.feeds.clear()
        self.channel.close()
        self.hub.links.discard(self)
        if not self.hub.links:
            self.hub.all_gone.set()

    async def _acquire(self, rid: int, model: str, priority: int, deadline: float | None,
                       watched: bool, age: float, request_id: str = "") -> None:
        reporter: asyncio.Task[None] | None = None

        def watch(waiting: Any) -> None:
            nonlocal reporter
            reporter = self.spawn(self._report(rid, waiting))

        try:
            grant = await self.hub.rt.acquire(model, priority, deadline,
                                              watch=watch if watched else None, age=age,
                                              request_id=request_id)
        except SchedulingError as exc:
            self.send(("refused", rid, wire.error_state(exc)))
            return
        finally:
            self.waits.pop(rid, None)
            if reporter is not None:
                reporter.cancel()
        self.grants[rid] = grant
        self.send(("granted", rid, grant.model, grant.dispatch, grant.swap_wait))

    async def _report(self, rid: int, waiting: Any) -> None:
        """Tell the request process that its request waits, and each new position."""
        await waiting.waits.wait()
        self.send(("waits", rid, waiting.position))
        while True:
            await waiting.position_changed.wait()
            waiting.position_changed.clear()
            self.send(("position", rid, waiting.position))

    async def _answer(self, cid: int, name: str, args: tuple[Any, ...]) -> None:
        handler: Callable[..., Coroutine[Any, Any, Any]] | None = getattr(
            self.hub, f"rpc_{name}", None)
        try:
            if handler is None:
                raise ValueError(f"no such call: {name}")
            value = await handler(self, *args)
            self.send(("reply", cid, True, value))
        except Exception as exc:
            self.send(("reply", cid, False, wire.error_state(exc)))


class Hub:
    """The scheduler process's server for its request processes (see the module)."""

    def __init__(self, rt: Runtime, path: Path) -> None:
        self.rt = rt
        self.path = path
        self.links: set[_Link] = set()
        # The last exposition of each request process gone: its counters and histograms stay
        # in the sums, so a merged counter never goes down (Prometheus would read a reset).
        self.departed: list[str] = []
        self._server: asyncio.Server | None = None
        self._changes: asyncio.TimerHandle | None = None
        self._db_task: asyncio.Task[None] | None = None
        self.all_gone = asyncio.Event()  # set when the last link closes

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o177)  # the socket is this user's alone
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                self._accept, path=str(self.path))
        finally:
            os.umask(old)
        self.rt.on_catalog.append(self._catalog_changed)
        self.rt.upstreams.on_state.append(self._states_changed)
        published.on_change(self._books_changed)
        self._db_task = asyncio.get_running_loop().create_task(self._watch_database())

    def _accept(self) -> wire.Channel:
        link = _Link(self)
        self.links.add(link)
        self.all_gone.clear()
        return link.channel

    def broadcast(self, frame: tuple[Any, ...]) -> None:
        data = wire.encode(frame)
        for link in list(self.links):
            link.channel.send_encoded(data)

    def upstreams_frame(self) -> tuple[Any, ...]:
        ups = self.rt.upstreams
        states = {}
        for model in list(ups.catalog.models):
            proc = ups.existing(model)
            if proc is not None:
                error = proc.last_error
                states[model] = (proc.state, proc.pid, proc.spec,
                                 wire.error_state(error) if error is not None else None)
        return ("upstreams", states, ups.running())

    def _catalog_changed(self, catalog: Catalog) -> None:
        self.broadcast(("catalog", catalog))
        self.broadcast(self.upstreams_frame())

    def _states_changed(self) -> None:
        self.broadcast(self.upstreams_frame())

    def _books_changed(self) -> None:
        """The run loop published: tell the links with a dashboard open, at most every
        CHANGES_EVERY seconds (a burst of events is one push)."""
        if self._changes is None and any(link.watching for link in self.links):
            self._changes = asyncio.get_running_loop().call_later(CHANGES_EVERY,
                                                                  self._push_changes)

    def _push_changes(self) -> None:
        self._changes = None
        for link in list(self.links):
            if link.watching:
                link.send(("changed",))

    async def _watch_database(self) -> None:
        """Push the database's health when it changes (the instance lock checks it)."""
        last = None
        while True:
            status = runtime.database_status()
            if status != last:
                last = status
                self.broadcast(("database", status))
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._db_task is not None:
            self._db_task.cancel()
        for link in list(self.links):
            link.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def gather(self, name: str, *args: Any) -> list[tuple[_Link, Any]]:
        """Every request process that answered `name`, with its answer; one that does not
        answer within ASK_WITHIN seconds is left out (and logged)."""
        links = list(self.links)
        answers = await asyncio.gather(*(link.ask(name, *args) for link in links),
                                       return_exceptions=True)
        out = []
        for link, answer in zip(links, answers, strict=True):
            if isinstance(answer, BaseException):
                logger.warning("request process %d did not answer %r within %g s: %s",
                               link.pid, name, ASK_WITHIN, answer or type(answer).__name__)
            else:
                out.append((link, answer))
        return out

    # ---- calls from a request process -----------------------------------------------------

    async def rpc_load(self, link: _Link, model: str) -> str:
        return await self.rt.load(model)

    async def rpc_unload(self, link: _Link, models: list[str]) -> None:
        await self.rt.unload(models)

    async def rpc_unload_all(self, link: _Link) -> None:
        await self.rt.unload_all()

    async def rpc_restart(self, link: _Link, models: list[str]) -> None:
        self.rt.restart(models)

    async def rpc_inspect(self, link: _Link, read: Callable[..., Any]) -> Any:
        return await self.rt.inspect(read)

    async def rpc_exit_reported(self, link: _Link, model: str, pid: int | None,
                                within: float) -> bool:
        proc = self.rt.upstream(model)
        return True if proc is None else await proc.exit_reported(pid, within)

    async def rpc_live_models(self, link: _Link) -> Any:
        return self.rt.control.live_models() if self.rt.control is not None else {}

    async def rpc_feed_open(self, link: _Link, fid: int, sources: list[str],
                            history: bool) -> list[str]:
        if fid in link.closed_feeds:  # its reader left before we got here
            link.closed_feeds.discard(fid)
            return []
        opened: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

        async def pump() -> None:
            try:
                async with self.rt.log_feed(sources, history) as (past, queue):
                    opened.set_result(past)
                    while True:
                        link.send(("line", fid, await queue.get()))
            except BaseException as exc:
                if not opened.done():  # the asker hears why, instead of waiting forever
                    opened.set_exception(exc if isinstance(exc, Exception)
                                         else RuntimeError("the log feed was closed"))
                raise

        link.feeds[fid] = link.spawn(pump())
        return await opened

    async def rpc_metrics(self, link: _Link, accept: str) -> tuple[bytes, str]:
        text, _ = await local.local_metrics_text("")
        for answered, (_, body) in await self.gather("metrics"):
            answered.metrics = body.decode()
        # One that did not answer counts with its last answer: no sum goes down for a slow
        # scrape.
        theirs = [(str(ln.pid), ln.metrics) for ln in list(self.links) if ln.metrics]
        return exposition.merge(text.decode(), theirs, accept, departed=self.departed)

    async def rpc_requests_view(self, link: _Link) -> dict[str, Any]:
        views = [view for _, view in await self.gather("requests")]
        in_flight = sorted((r for v in views for r in v["in_flight"]),
                           key=lambda r: -r["elapsed_s"])
        recent = sorted((r for v in views for r in v["recent"]), key=lambda r: r["time"],
                        reverse=True)[:RECENT]
        return {"in_flight": in_flight, "recent": recent, "history": HISTORY.view()}

    async def rpc_performance(self, link: _Link, after: dt.datetime | None
                              ) -> dict[str, Any] | None:
        return local.local_performance(after)

    async def rpc_cancel_request(self, link: _Link, request_id: str) -> bool:
        return any(done for _, done in await self.gather("cancel_request", request_id))
