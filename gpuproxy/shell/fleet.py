"""This node's heartbeat in the fleet view (issue 24, item 3; activity/fleet.py has the table).

Only a `serve` publishes, and of `serve --workers N` only the scheduler process (the one with
the run loop, which the request processes ask for everything): `serving_at` is said by the
serve command, and the runtime starts the publisher where it starts the run loop. About once a
second (GPUPROXY_FLEET_SECONDS) the publisher reads the books between two of the run loop's
events (`RunLoop.inspect`: per model and band, which the published snapshot does not split) and
hands one UPSERT to the runtime's database thread, so the event loop never waits for the
database. A database outage is logged once and the write retried every tick, never raised
into the loop: the node keeps serving and shows down in the view until it can write again. A
clean stop writes `stopped`, so a reader can tell a node stopped on purpose from one that died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import connections
from django.utils import timezone

from activity import fleet
from gpuproxy.observe import published
from gpuproxy.upstream.states import State
from gpuproxy.version import version_info
from scheduling.core.effects import Scheduler
from scheduling.core.priority import band

T = TypeVar("T")
logger = logging.getLogger("gpuproxy.shell.fleet")

RunDb = Callable[[Callable[[], T]], Awaitable[T]]

_listen: str | None = None
_url = ""
# Addresses that say "every interface": another node cannot reach this one by them.
_ANY = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def serving_at(host: str, port: int) -> None:
    """Said by `serve` (a single process, or the scheduler process of `--workers N`): this
    process publishes its node, serving at host:port."""
    global _listen, _url
    _listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    _url = advertised(host, port)


def advertised(host: str, port: int, hostname: str | None = None) -> str:
    """The URL the other nodes forward to: GPUPROXY_ADVERTISE, else the --listen address when
    it names one interface, else this machine's host name (a wildcard address reaches
    nothing from another box). Plain http: a serve with TLS must set GPUPROXY_ADVERTISE."""
    if settings.GPUPROXY_ADVERTISE:
        return str(settings.GPUPROXY_ADVERTISE)
    if host in _ANY:
        host = socket.gethostname() if hostname is None else hostname
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen() -> str | None:
    """Where this serve listens; None outside a serve (tests, shells, management commands)."""
    return _listen


def books(scheduler: Scheduler, now: float) -> tuple[dict[str, dict[str, dict[str, float]]],
                                                     dict[str, int]]:
    """(queue, in flight) from the scheduler's books, on the run loop's task: per model, per
    band, the requests admitted and not yet granted (queued, or waiting on their model's
    load) and the oldest one's wait in seconds; per model, the requests being served."""
    waiting = list(scheduler.queued())
    for waiters in scheduler.active_swaps().values():
        waiting.extend(waiters)
    queue: dict[str, dict[str, dict[str, float]]] = {}
    for req in waiting:
        cell = queue.setdefault(req.model, {}).setdefault(
            band(req.priority), {"depth": 0, "oldest_wait_s": 0.0})
        cell["depth"] += 1
        cell["oldest_wait_s"] = max(cell["oldest_wait_s"], round(max(0.0, now - req.arrived), 3))
    in_flight = {m: n for m in scheduler.config.models if (n := scheduler.in_flight(m))}
    return queue, in_flight


class FleetPublisher:
    """Writes this node's row every `every` seconds from what `read` returns."""

    def __init__(self, node: str, listen: str, read: Callable[[], Awaitable[tuple[Any, Any]]],
                 run_db: RunDb[Any], every: float | None = None,
                 write: Callable[..., None] = fleet.write) -> None:
        self.node, self.listen = node, listen
        self._read, self._run_db, self._write = read, run_db, write
        self.every = settings.GPUPROXY_FLEET_SECONDS if every is None else every
        self.started_at = timezone.now()
        self.pid = os.getpid()
        self.version = version_info()["version"]
        self.failing = False  # the last write failed: said once, until one works again
        self.written = 0
        self.state = fleet.RUNNING  # what each heartbeat says: running, then draining
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-publisher")

    async def report(self) -> fleet.NodeReport:
        queue, in_flight = await self._read()
        loaded = sorted(m for m, state in published.model_states().items()
                        if state == State.READY)
        return fleet.NodeReport(node=self.node, pid=self.pid, started_at=self.started_at,
                                version=self.version, listen=self.listen, url=_url,
                                loaded=loaded,
                                queue=queue, in_flight=in_flight)

    async def publish(self, state: str = fleet.RUNNING) -> bool:
        """One heartbeat; False (logged the first time in a row) if it could not be written."""
        try:
            report = await self.report()
            await self._run_db(lambda: self._write(report, None, state))  # the db's clock
        except Exception as exc:  # an outage must not end the heartbeat
            if not self.failing:
                logger.warning("fleet view: node %s's heartbeat could not be written (%s); the "
                               "fleet shows it down until it can. Retrying every %g s; said "
                               "once until it works", self.node, exc, self.every)
            self.failing = True
            return False
        if self.failing:
            logger.info("fleet view: node %s's heartbeat is written again", self.node)
        self.failing = False
        self.written += 1
        return True

    async def _run(self) -> None:
        while True:
            await self.publish(self.state)
            await asyncio.sleep(self.every)

    async def drain(self) -> None:
        """The graceful stop began: every heartbeat from now on says `draining` (the other
        nodes forward nothing here; a reader sees why the queue empties), the first at once."""
        self.state = fleet.DRAINING
        if self._task is not None:
            await self.publish(self.state)

    async def stop(self, within: float = 5.0) -> None:
        """End the heartbeat and write `stopped`: a clean stop, not a death. Bounded, so that
        a database that does not answer cannot hold the process's exit."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await asyncio.wait_for(self.publish(fleet.STOPPED), timeout=within)
        except TimeoutError:
            logger.error("fleet view: node %s's stop could not be written within %g s; it "
                         "will show down instead of stopped", self.node, within)


def start(run_loop: Any, run_db: RunDb[Any]) -> FleetPublisher | None:
    """The publisher for this serve's run loop, started; None outside a serve, when
    GPUPROXY_FLEET_SECONDS is 0 (off), and on SQLite: a fleet shares one PostgreSQL database,
    and on SQLite each UPSERT would queue the runtime's one database thread behind the file's
    write lock, ahead of the activity rows, for a view that has nothing to compare."""
    if _listen is None or settings.GPUPROXY_FLEET_SECONDS == 0:
        return None
    if connections["default"].vendor == "sqlite":
        return None
    if not settings.GPUPROXY_FLEET_KEY:  # said once, where the serve starts its run loop
        logger.info("fleet: forwarding between nodes is off: GPUPROXY_FLEET_KEY is not set "
                    "(set the same secret on every node to turn it on; docs/fleet.md)")
    publisher = FleetPublisher(settings.GPUPROXY_NODE, _listen,
                               partial(run_loop.inspect, books), run_db)
    publisher.start()
    return publisher

