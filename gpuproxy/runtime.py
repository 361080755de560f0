"""The process-wide objects of a running proxy, bound to the server's event loop.

`await runtime.get()` returns the one `Runtime` (catalog loaded, run loop running), creating it
on first use in whichever loop Daphne runs. Database work from async code runs on one
dedicated thread, never on asgiref's shared thread-sensitive executor: a hung query there
stalls every Channels consumer (`django-stack-notes.md` §6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from django.db import close_old_connections

from activity.writer import writer as activity_writer
from gpuproxy import metrics, relay
from gpuproxy.perfmon import PerfMonitor
from gpuproxy.run_loop import RunLoop
from gpuproxy.upstreams import Upstreams
from scheduling.catalog import Catalog
from scheduling.core.policies import make_scheduler

T = TypeVar("T")
logger = logging.getLogger("gpuproxy.runtime")

_db_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuproxy-db")


async def run_db(fn: Callable[[], T]) -> T:
    """Run ORM code on the dedicated database thread and return its result."""

    def call() -> T:
        close_old_connections()
        try:
            return fn()
        finally:
            close_old_connections()

    return await asyncio.get_running_loop().run_in_executor(_db_executor, call)


async def _load_catalog() -> Catalog:
    from scheduling.catalog import build_catalog

    return await run_db(build_catalog)


RELOAD_SECONDS = float(os.environ.get("GPUPROXY_RELOAD_SECONDS", "2"))


class Runtime:
    def __init__(self, upstreams: Upstreams, run_loop: RunLoop, perf: PerfMonitor) -> None:
        self.upstreams = upstreams
        self.run_loop = run_loop
        self.perf = perf
        self._watcher: asyncio.Task | None = None

    def start_watcher(self, every: float = RELOAD_SECONDS) -> None:
        """Poll the database for definition changes made by another process (a re-import,
        a shell) and apply them without a restart."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(every),
                                                                   name="catalog-watcher")

    async def _watch(self, every: float) -> None:
        from scheduling.catalog import fingerprint

        failing = False
        while True:
            await asyncio.sleep(every)
            try:
                stamp = await run_db(fingerprint)
                if stamp != self.catalog.fingerprint:
                    logger.info("model definitions changed in the database: applying them")
                    await self.reload()
                if failing:
                    logger.info("database reachable again: watching definitions")
                failing = False
            except Exception as exc:
                if not failing:
                    logger.warning("cannot check the database for definition changes (%s); "
                                   "the proxy keeps serving with what it has and retries",
                                   exc)
                failing = True

    @property
    def catalog(self) -> Catalog:
        return self.upstreams.catalog

    async def reload(self) -> None:
        """Re-read the definitions and hand the scheduler its new configuration."""
        catalog, removed = await self.upstreams.refresh()
        self.run_loop.settings_changed(catalog.scheduler_config())
        self.perf.configure(catalog.performance_monitoring, catalog.performance_interval)
        if removed:
            await self.run_loop.unload(removed)

    async def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.perf.stop()
        metrics.publish_perf_monitor(None)
        await self.run_loop.shutdown()
        await self.upstreams.shutdown()
        await relay.close()
        # Every request has been answered by now: write their records before exiting.
        if not await activity_writer().close(timeout=10.0):
            logger.error("activity writer: %d rows could not be written before exit",
                         activity_writer().buffered)


_runtime: Runtime | None = None
_loop: asyncio.AbstractEventLoop | None = None
_starting: asyncio.Future[Runtime] | None = None


async def get() -> Runtime:
    """The running proxy's Runtime, created (catalog read, run loop started) on first use."""
    global _runtime, _loop, _starting
    loop = asyncio.get_running_loop()
    if _runtime is not None and _loop is loop:
        return _runtime
    if _starting is not None and _loop is loop:
        return await asyncio.shield(_starting)
    _loop = loop
    _runtime = None
    _starting = loop.create_future()
    try:
        upstreams = Upstreams(_load_catalog)
        catalog, _ = await upstreams.refresh()
        run_loop = RunLoop(upstreams, catalog.scheduler_config(), make_scheduler)
        run_loop.start()
        activity_writer().start()
        perf = PerfMonitor(catalog.performance_interval, catalog.performance_monitoring)
        perf.start()
        metrics.publish_perf_monitor(perf)
        _runtime = Runtime(upstreams, run_loop, perf)
    except BaseException as exc:
        _starting.set_exception(exc)
        _starting.exception()  # retrieved: the callers below re-raise it
        _starting = None
        raise
    _starting.set_result(_runtime)
    return _runtime


def current() -> Runtime | None:
    """The runtime if one was created in the running loop (for advisory reads)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return _runtime if _loop is loop else None


async def shutdown() -> None:
    """Answer every waiter and stop every upstream; safe when nothing was started."""
    global _runtime, _loop, _starting
    runtime, _runtime, _loop, _starting = _runtime, None, None, None
    if runtime is not None:
        await runtime.shutdown()
