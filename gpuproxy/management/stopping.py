"""How `serve` ends (`Stopping`): a drain on the first SIGTERM/SIGINT, at once on the second,
at once and with an error when the instance lock is lost.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from gpuproxy.proxy import edge

logger = logging.getLogger("gpuproxy.serve")


def _described(requests: list[tuple[float, str]], most: int = 10) -> str:
    text = ", ".join(f"{what} ({seconds:.0f} s)" for seconds, what in requests[:most])
    return text + (f" and {len(requests) - most} more" if len(requests) > most else "")


class Stopping:
    """How `serve` ends: a drain on the first SIGTERM/SIGINT, at once on the second, at once
    and with an error when the instance lock is lost (`fail`)."""

    PROGRESS_EVERY = 5.0  # seconds between "still waiting for ..." lines

    def __init__(self, grace: float, child: bool = False) -> None:
        self.grace = grace
        # A request process of `--workers N`: SIGTERM and SIGINT, however many, mean one
        # drain; the supervisor's second signal arrives as SIGUSR2 (workers.CUT).
        self.child = child
        self.signals = 0
        self.failure: str | None = None
        self._cut: asyncio.Event | None = None
        self._task: asyncio.Future | None = None

    def install(self) -> None:
        """Replace Twisted's handlers (they stop the reactor at once and ignore a second
        signal). Called once the reactor runs."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        if self.child:
            from gpuproxy.management.workers import CUT

            signal.signal(CUT, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        from twisted.internet import reactor

        reactor.callFromThread(self._signalled, signal.Signals(signum).name)

    def _signalled(self, name: str) -> None:
        if self.child and self.signals and name != "SIGUSR2":
            return  # the same stop, heard directly and from the supervisor
        self.signals += 1
        if self.signals == 1:
            self._cut = asyncio.Event()
            self._task = asyncio.ensure_future(self._drain(name))
        elif self.signals == 2 and self._task is not None and not self._task.done():
            left = edge.in_flight()
            logger.warning("%s again (a second signal): ending the drain now; %d request(s) "
                           "still in flight are cut: %s", name, len(left), _described(left))
            assert self._cut is not None
            self._cut.set()
        else:
            logger.warning("%s: already stopping the upstreams (each within its unloadTimeout, "
                           "then SIGKILL)", name)

    def fail(self, message: str) -> None:
        """Stop now with an error (any thread): this instance must not go on."""
        from twisted.internet import reactor

        reactor.callFromThread(self._fail, message)

    def _fail(self, message: str) -> None:
        logger.error(message)
        if self.failure is None:
            self.failure = message
        edge.start_draining()
        self._stop_reactor()

    async def _drain(self, name: str) -> None:
        from gpuproxy.shell import runtime

        edge.start_draining()
        logger.info("%s: draining; new requests get 503 shutting_down, and so do queued ones",
                    name)
        try:
            await runtime.drain()
            left = edge.in_flight()
            if not left:
                logger.info("drained: no request in flight")
            elif self.grace <= 0:
                logger.warning("no grace period (GPUPROXY_SHUTDOWN_GRACE_SECONDS=0): cutting "
                               "%d request(s) in flight: %s", len(left), _described(left))
            else:
                logger.info("waiting up to %g s for %d request(s) in flight to finish: %s "
                            "(GPUPROXY_SHUTDOWN_GRACE_SECONDS; a second SIGTERM or SIGINT "
                            "stops at once)", self.grace, len(left), _described(left))
                await self._wait()
        except Exception:
            logger.exception("the drain failed; stopping now")
        self._stop_reactor()

    async def _wait(self) -> None:
        assert self._cut is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        idle = asyncio.ensure_future(edge.wait_idle())
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    left = edge.in_flight()
                    logger.warning("the grace period of %g s is over: cutting %d request(s) "
                                   "still in flight: %s", self.grace, len(left),
                                   _described(left))
                    return
                done, _ = await asyncio.wait({idle, cut}, timeout=min(remaining,
                                                                      self.PROGRESS_EVERY),
                                             return_when=asyncio.FIRST_COMPLETED)
                if idle in done:
                    logger.info("drained: every request in flight has finished")
                    return
                if cut in done:
                    return
                left = edge.in_flight()
                logger.info("still waiting (%.0f s left) for %d request(s): %s",
                            deadline - loop.time(), len(left), _described(left))
        finally:
            idle.cancel()
            cut.cancel()

    @staticmethod
    def _stop_reactor() -> None:
        from twisted.internet import error
        from twisted.internet import reactor as _reactor

        reactor: Any = _reactor  # Twisted types the reactor as its interfaces, methods without self
        try:
            reactor.stop()
        except error.ReactorNotRunning:
            pass
