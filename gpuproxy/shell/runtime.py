"""The process-wide objects of a running proxy, bound to the server's event loop.

`await runtime.get()` returns the one `Runtime` (catalog loaded, run loop running), creating it
on first use in whichever loop Daphne runs. Database work from async code runs on one
dedicated thread, never on asgiref's shared thread-sensitive executor: a hung query there
stalls every Channels consumer (`django-stack-notes.md` §6).

During a database outage that thread would wait the pool timeout (10 s) for every call, and
the calls queue behind each other: the activity API hung. So `run_db` refuses at once, with
`DatabaseUnavailable`, while the instance lock's own check (gpuproxy/shell/instance.py, every
GPUPROXY_LOCK_CHECK_SECONDS on a connection outside the pool) says the database does not
answer; a normal call pays one attribute read for it. `database_problem()` says the same in
words for `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.db import OperationalError, close_old_connections

from activity.writer import event_writer
from activity.writer import writer as activity_writer
from gpuproxy.observe import inflight, published
from gpuproxy.observe.history import HISTORY
from gpuproxy.observe.perf import PerfMonitor
from gpuproxy.shell import fleet, instance
from gpuproxy.shell.control import Control
from gpuproxy.shell.local import (
    describe_database,
    local_log_feed,
    local_metrics_text,
    local_performance,
    local_requests,
)
from gpuproxy.shell.port import ProxyPort
from gpuproxy.shell.run_loop import Grant, RunLoop, Waiting
from gpuproxy.shell.upstreams import Upstreams
from gpuproxy.upstream import relay
from gpuproxy.upstream.orphans import ProcessRecords
from gpuproxy.upstream.processes import UpstreamProcess
from scheduling import live
from scheduling.catalog import Catalog
from scheduling.core.effects import Scheduler
from scheduling.core.policies import make_scheduler

T = TypeVar("T")
logger = logging.getLogger("gpuproxy.shell.runtime")

_db_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuproxy-db")


class DatabaseUnavailable(OperationalError):
    """The database is known to be unreachable: refused without waiting for the pool."""


def database_status() -> instance.DatabaseStatus | None:
    """What the instance lock's check last saw of the database (None: it answers), or, in a
    request process, what the scheduler process last said of it."""
    if _hub is not None:
        from gpuproxy.shell import remote

        rt = remote.current()
        return rt.db_status if rt is not None else None
    lock = instance.current()
    return lock.database_status() if lock is not None else None


def database_problem() -> str | None:
    """None while the database answers; else what is wrong, since when, and what that means
    for requests, in words for a person (`/health`, the activity API's 503)."""
    return describe_database(database_status())


async def run_db(fn: Callable[[], T]) -> T:
    """Run ORM code on the dedicated database thread and return its result; raise
    DatabaseUnavailable at once during a known outage."""
    if (problem := database_problem()) is not None:
        raise DatabaseUnavailable(problem)

    def call() -> T:
        close_old_connections()
        try:
            return fn()
        finally:
            close_old_connections()

    return await asyncio.get_running_loop().run_in_executor(_db_executor, call)


async def _load_catalog() -> Catalog:
    from scheduling.catalog_db import build_catalog

    return await run_db(build_catalog)


def own_connection_params() -> dict[str, Any]:
    """psycopg keyword arguments for a PostgreSQL connection of our own, outside Django's
    pool (the LISTEN connection, the instance lock), from the default database settings."""
    from django.db import connections

    db = connections["default"].settings_dict
    params = {"dbname": db["NAME"], "user": db["USER"], "password": db["PASSWORD"],
              "host": db["HOST"], "port": db["PORT"], "connect_timeout": 10}
    return {k: v for k, v in params.items() if v}


def upstream_records() -> ProcessRecords:
    """Where the running upstreams' process groups are written (swept after a crash)."""
    from django.conf import settings

    return ProcessRecords(settings.DATA_DIR / "upstreams")


class Runtime:
    def __init__(self, upstreams: Upstreams, run_loop: RunLoop, perf: PerfMonitor) -> None:
        self.upstreams = upstreams
        self.run_loop = run_loop
        self.perf = perf
        self._watcher: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self._reload_wanted = asyncio.Event()
        self.control: Control | None = None  # attached to scheduling.live while running
        self.fleet: fleet.FleetPublisher | None = None  # this node's heartbeat, in a serve
        # Called after every reload with the new catalog (the scheduler process's hub sends
        # it to the request processes).
        self.on_catalog: list[Callable[[Catalog], None]] = []

    def request_reload(self) -> None:
        """Re-read the definitions now: a save was committed (in this process, or announced
        by PostgreSQL). Many calls in a row fold into one reload."""
        self._reload_wanted.set()

    def start_watcher(self, every: float | None = None) -> None:
        """Apply definition changes without a restart: at once when told (`request_reload`,
        fed by scheduling/signals.py and, on PostgreSQL, by LISTEN), and by a periodic check
        of the tables' fingerprint for anything else (SQLite written by another process, a
        notification lost while the database was away)."""
        if every is None:
            from django.conf import settings

            every = float(settings.GPUPROXY_RELOAD_SECONDS)
        if self._watcher is None:
            loop = asyncio.get_running_loop()
            self._watcher = loop.create_task(self._watch(every), name="catalog-watcher")
            from django.db import connections

            if connections["default"].vendor == "postgresql":
                self._listener = loop.create_task(self._listen(every), name="catalog-listener")

    async def _watch(self, every: float) -> None:
        from scheduling.catalog_db import fingerprint

        failing = False
        owed = False  # told to reload, but the database was away: retry at the next turn
        while True:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as the event
            # is set (a NOTIFY at shutdown), and shutdown() then waited for this task forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await self._reload_wanted.wait()
            told = self._reload_wanted.is_set() or owed
            self._reload_wanted.clear()
            published.publish_loop_tasks(len(asyncio.all_tasks()))
            try:
                if told:
                    await self.reload()
                else:
                    stamp = await run_db(fingerprint)
                    if stamp != self.catalog.fingerprint:
                        logger.info("model definitions changed in the database: applying them")
                        await self.reload()
                owed = False
                if failing:
                    logger.info("database reachable again: watching definitions")
                failing = False
            except Exception as exc:
                owed = owed or told
                if not failing:
                    logger.warning("cannot read the definitions from the database (%s); the "
                                   "proxy keeps serving with what it has and retries every "
                                   "%g s", exc, every)
                failing = True

    async def _listen(self, every: float) -> None:
        """LISTEN on PostgreSQL for `scheduling.signals.CHANNEL`, reconnecting with backoff.
        A connection of its own, on the event loop (psycopg's async API): no thread."""
        import psycopg

        from scheduling.signals import CHANNEL

        params = own_connection_params()
        delay, warned = 1.0, False
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(**params, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    # Saves made while we were not listening (also between the catalog's
                    # first load and this LISTEN) sent notifications nobody heard.
                    self.request_reload()
                    if warned:
                        logger.info("listening for definition changes again")
                    warned, delay = False, 1.0
                    async for _ in conn.notifies():
                        self.request_reload()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not warned:
                    logger.warning("cannot LISTEN for definition changes on PostgreSQL (%s); "
                                   "saves from other processes apply at the next periodic "
                                   "check (every %g s) until it reconnects", exc, every)
                    warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    # ---- ProxyPort (gpuproxy/shell/port.py): what the edge may ask -------------------------

    @property
    def catalog(self) -> Catalog:
        return self.upstreams.catalog

    async def acquire(self, model: str, priority: int = 0, deadline: float | None = None,
                      watch: Callable[[Waiting], None] | None = None, *,
                      age: float = 0.0, request_id: str = "") -> Grant:
        return await self.run_loop.acquire(model, priority, deadline, watch=watch, age=age,
                                           request_id=request_id)

    async def load(self, model: str) -> str:
        return await self.run_loop.load(model)

    async def unload(self, models: Iterable[str]) -> None:
        await self.run_loop.unload(models)

    async def unload_all(self) -> None:
        await self.run_loop.unload_all()

    def restart(self, models: Iterable[str]) -> None:
        self.run_loop.restart(models)

    async def inspect(self, read: Callable[[Scheduler, float], T]) -> T:
        return await self.run_loop.inspect(read)

    def upstream(self, model: str) -> UpstreamProcess | None:
        return self.upstreams.existing(model)

    def upstream_process(self, model: str) -> UpstreamProcess:
        return self.upstreams.process(model)

    def running(self) -> list[dict[str, Any]]:
        return self.upstreams.running()

    def log_feed(self, sources: list[str], history: bool) -> contextlib.AbstractAsyncContextManager[
            tuple[list[str], asyncio.Queue[str]]]:
        return local_log_feed(sources, history)

    async def metrics_text(self, accept: str) -> tuple[bytes, str]:
        return await local_metrics_text(accept)

    async def requests_view(self) -> dict[str, Any]:
        return {**local_requests(), "history": HISTORY.view()}

    async def cancel_request(self, request_id: str) -> bool:
        return inflight.cancel(request_id)

    async def performance(self, after: dt.datetime | None) -> dict[str, Any] | None:
        return local_performance(after)

    def watch_changes(self, on: bool) -> None:
        pass  # the run loop publishes in this very process

    def database_problem(self) -> str | None:
        return database_problem()

    # ---- the rest is the shell's own ------------------------------------------------------

    async def reload(self) -> None:
        """Re-read the definitions and hand the scheduler its new configuration."""
        catalog, _ = await self.upstreams.refresh()
        # Removed, disabled and changed models are the scheduler's to stop or restart once
        # idle: nothing in flight is cut off.
        self.run_loop.settings_changed(catalog.scheduler_config())
        self.perf.configure(catalog.performance_monitoring, catalog.performance_interval)
        for listener in self.on_catalog:
            listener(catalog)

    async def drain(self) -> None:
        """The start of a graceful stop: every queued or loading request is answered 503
        `shutting_down` by the scheduler (and any that comes later); requests in flight go
        on, and their upstreams keep running until `shutdown()`. The fleet view says
        `draining` from now on."""
        await self.run_loop.shutdown()
        if self.fleet is not None:
            await self.fleet.drain()

    async def shutdown(self) -> None:
        helpers = [t for t in (self._watcher, self._listener) if t is not None]
        for task in helpers:
            task.cancel()
        if helpers:
            # Bounded: a helper that does not end must not keep the upstreams running.
            _, stuck = await asyncio.wait(helpers, timeout=5)
            for task in stuck:
                logger.error("shutdown: %s did not stop within 5 s of its cancel; going on",
                             task.get_name())
        await self.perf.stop()
        published.publish_perf_monitor(None)
        await self.run_loop.shutdown()
        await self.upstreams.shutdown()
        await relay.close()
        # Every request has been answered by now: write their records before exiting.
        for rows, w in (("activity", activity_writer()), ("model event", event_writer())):
            if not await w.close(timeout=10.0):
                logger.error("%s writer: %d rows could not be written before exit", rows,
                             w.buffered)
        if self.fleet is not None:
            await self.fleet.stop()  # last: the node shows up until it has stopped


_runtime: Runtime | None = None
_loop: asyncio.AbstractEventLoop | None = None
_starting: asyncio.Future[Runtime] | None = None
# Set in a request process of `serve --workers N`: the scheduler process's socket. The edge's
# `port()` is then a RemoteRuntime (gpuproxy/shell/remote.py), and no run loop lives here.
_hub: str | None = None


def use_scheduler_process(path: str) -> None:
    """Make this a request process: the scheduler lives in another process, at `path`."""
    global _hub
    _hub = path


async def get() -> Runtime:
    """The running proxy's Runtime, created (catalog read, run loop started) on first use."""
    global _runtime, _loop, _starting
    loop = asyncio.get_running_loop()
    if _runtime is not None and _loop is loop:
        return _runtime
    if _starting is not None and _loop is loop:
        return await asyncio.shield(_starting)
    if _runtime is not None and _runtime.control is not None:  # one made on a loop now gone
        live.detach(_runtime.control)
    _loop = loop
    _runtime = None
    _starting = loop.create_future()
    try:
        upstreams = Upstreams(_load_catalog, records=upstream_records())
        upstreams.on_event = event_writer().submit  # only this process runs upstreams
        event_writer().start()
        catalog, _ = await upstreams.refresh()
        run_loop = RunLoop(upstreams, catalog.scheduler_config(), make_scheduler)
        run_loop.start()
        activity_writer().start()
        fleet_publisher = fleet.start(run_loop, run_db)
        perf = PerfMonitor(catalog.performance_interval, catalog.performance_monitoring)
        perf.start()
        published.publish_perf_monitor(perf)
        _runtime = Runtime(upstreams, run_loop, perf)
        _runtime.fleet = fleet_publisher
        _runtime.control = Control(_runtime, _runtime.request_reload, loop)
        live.attach(_runtime.control)
    except BaseException as exc:
        _starting.set_exception(exc)
        _starting.exception()  # retrieved: the callers below re-raise it
        _starting = None
        raise
    _starting.set_result(_runtime)
    return _runtime


async def port() -> ProxyPort:
    """The running proxy as the edge sees it: `get()`, held to the ProxyPort protocol, or in
    a request process the scheduler process's client."""
    if _hub is not None:
        from gpuproxy.shell import remote

        return await remote.get(_hub)
    return await get()


async def profile_in_force(rt: ProxyPort, name: str, version: int, *, within: float,
                           poll: float) -> bool:
    """Wait until the catalog `rt` routes by has the profile `name` active ("" for none), or
    shows settings `version` or later (a racing switch that came after this one won: this one
    was applied and replaced); False after `within` seconds. The catalog is replaced, not
    announced, in a request process (the hub's push to every one at once): hence a poll. The
    profiles API and the dashboard's profile action both answer once this is true."""
    deadline = time.monotonic() + within

    def shown() -> bool:
        catalog = rt.catalog
        seen = catalog.fingerprint[0] if catalog.fingerprint else None
        active = catalog.active_profile if catalog.active_profile in catalog.profiles else ""
        return active == name or (isinstance(seen, int) and seen >= version)

    while not shown():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll)
    return True


def current() -> ProxyPort | None:
    """The running proxy if one was created in the running loop (for advisory reads)."""
    if _hub is not None:
        from gpuproxy.shell import remote

        return remote.current()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return _runtime if _loop is loop else None


async def _finish_starting(within: float = 30.0) -> None:
    """A stop that lands while `get()` is building the runtime (a SIGTERM right after start)
    waits for it, so what it starts is stopped too."""
    starting = _starting
    if _runtime is None and starting is not None and not starting.done():
        await asyncio.wait({starting}, timeout=within)


async def drain() -> None:
    """Answer every waiter, let work in flight go on (see `Runtime.drain`); safe when nothing
    was started. A request process has no waiters of its own: the scheduler process drains
    them (the supervisor signals both)."""
    if _hub is not None:
        return
    await _finish_starting()
    if _runtime is not None:
        await _runtime.drain()


async def shutdown() -> None:
    """Answer every waiter and stop every upstream; safe when nothing was started. A request
    process closes its link to the scheduler process and writes its activity rows."""
    global _runtime, _loop, _starting
    if _hub is not None:
        from gpuproxy.shell import remote

        await remote.shutdown()
        return
    await _finish_starting()
    runtime, _runtime, _loop, _starting = _runtime, None, None, None
    if runtime is not None:
        if runtime.control is not None:
            live.detach(runtime.control)
        await runtime.shutdown()
