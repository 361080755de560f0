"""What goes on an upstream owner's queue, and how the futures it carries are answered.

Requests come from callers, events from the helper tasks and timers; the owner task
(`processes.UpstreamProcess`) takes them one at a time, which is what makes it the only writer
of the lifecycle state. A module of its own because all three layers of `UpstreamProcess`
post or handle them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

# Requests from callers (each carries the future the caller awaits) and events from helper tasks.
# `gen` ties an event to one run, so a late event from an earlier run is ignored.


@dataclass
class EnsureReq:
    future: asyncio.Future[None]


@dataclass
class StopReq:
    timeout: float | None
    future: asyncio.Future[None]


@dataclass
class CloseReq:
    future: asyncio.Future[None]


@dataclass
class Healthy:
    gen: int


@dataclass
class HealthTimedOut:
    gen: int
    last_probe: str


@dataclass
class LeaderExited:
    gen: int
    code: int | None  # None: given up on after SIGKILL (it never exited)


@dataclass
class Exited:
    """The run is over: the leader exited, its members are gone (or were given up on), the
    output is in."""

    gen: int
    code: int | None


@dataclass
class KillDue:
    gen: int


@dataclass
class TtlDue:
    gen: int


@dataclass
class RequestDone:
    pass


@dataclass
class GiveUp:
    gen: int


Message = (EnsureReq | StopReq | CloseReq | Healthy | HealthTimedOut | LeaderExited
           | Exited | KillDue | GiveUp | TtlDue | RequestDone)


def resolve_all(futures: Iterable[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():  # a cancelled caller left; the others still get their answer
            future.set_result(None)


def fail_all(futures: Iterable[asyncio.Future[None]], error: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error)
