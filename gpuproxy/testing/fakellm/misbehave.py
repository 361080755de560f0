"""The fake upstream's misbehaviour on purpose, so the proxy's failure handling meets a real
process instead of mocks.

Knobs for the whole process come from the command line: a slow load (`--load-seconds`, 503
"Loading model" meanwhile), death at start (`--exit-on-start CODE`), a server stuck on SIGTERM
(`--ignore-sigterm`) and a crash in the middle of a response (`--crash-after N`). Knobs for one
request come with it: `X-Fake-Hold` / `fake_hold` sits before the status line, `X-Fake-Gate:
NAME` holds the response until `POST /fake/gates/open {"gate": NAME}`, so a test decides when a
request finishes instead of guessing a hold time. Every wait notices a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from typing import Any

from gpuproxy.testing.fakellm.server import (
    POLL_SLICE,
    ClientGone,
    HttpError,
    Request,
    out,
    pause,
)

CRASH_EXIT_CODE = 3


def hold_seconds(req: Request, body: dict[str, Any] | None) -> float:
    """`X-Fake-Hold` header or `fake_hold` body field: how long to sit before the status line."""
    raw: Any = req.headers.get("x-fake-hold")
    if raw is None and body is not None:
        raw = body.get("fake_hold")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise HttpError(400, "X-Fake-Hold / fake_hold must be a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise HttpError(400, "X-Fake-Hold / fake_hold must be a non-negative number of seconds")
    return seconds


class Misbehaviour:
    """The knobs, the gates and the count of model requests that `--crash-after` watches."""

    def __init__(
        self,
        *,
        load_seconds: float = 0.0,
        ignore_sigterm: bool = False,
        crash_after: int | None = None,
        exit_on_start: int | None = None,
    ) -> None:
        self.load_seconds = load_seconds
        self.ignore_sigterm = ignore_sigterm
        self.crash_after = crash_after
        self.exit_on_start = exit_on_start
        self.completion_requests = 0
        self._gates: dict[str, asyncio.Event] = {}

    def install_signals(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """SIGTERM/SIGINT stop cleanly (exit 0); `--ignore-sigterm` mimics a stuck server."""

        def stopping(name: str) -> None:
            out(f"fakellm: {name}, exiting")
            stop.set()

        if self.ignore_sigterm:
            loop.add_signal_handler(
                signal.SIGTERM, out, "fakellm: SIGTERM ignored (--ignore-sigterm)"
            )
        else:
            loop.add_signal_handler(signal.SIGTERM, stopping, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, stopping, "SIGINT")

    # ----------------------------------------------------------------- holds and gates

    async def hold(
        self, req: Request, body: dict[str, Any] | None, reader: asyncio.StreamReader
    ) -> None:
        """The request's hold, then its gate, if it asked for either."""
        await pause(reader, hold_seconds(req, body))
        gate = req.headers.get("x-fake-gate")
        if gate:
            await self.wait_gate(reader, gate)

    def gate(self, name: str) -> asyncio.Event:
        event = self._gates.get(name)
        if event is None:
            event = self._gates[name] = asyncio.Event()
        return event

    async def wait_gate(self, reader: asyncio.StreamReader, name: str) -> None:
        """Wait until gate `name` is opened, noticing a client that left meanwhile."""
        event = self.gate(name)
        while not event.is_set():
            if reader.at_eof():
                raise ClientGone
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), POLL_SLICE)

    # ----------------------------------------------------------------- crashes

    def count_completion_request(self) -> bool:
        """Count a request to a model endpoint; True if `--crash-after` says this one dies."""
        self.completion_requests += 1
        return self.crash_after is not None and self.completion_requests == self.crash_after

    async def crash(self, writer: asyncio.StreamWriter, what: str) -> None:
        """Make sure what was written reaches the socket, then die like a segfaulting server."""
        with contextlib.suppress(Exception):
            await writer.drain()
        out(f"fakellm: simulated crash (--crash-after {self.crash_after}) {what}")
        os._exit(CRASH_EXIT_CODE)
