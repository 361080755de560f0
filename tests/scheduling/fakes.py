"""Test doubles for the scheduling core (llama-swap's `fakeEffects` / `stubPlanner`, in Python).

Scheduler tests call the `on_*` methods directly and synchronously, exactly as the run loop
would: a swap "finishes" when the test calls `on_swap_done`, a request "finishes" when it calls
`on_serve_done`. `FakeEffects` only records what the scheduler asked for and lets the test set
model states and which clients have left; it never calls back into the scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import FAILED, READY, STOPPED
from scheduling.core.errors import SchedulingError
from scheduling.core.events import Request, RequestArrived, ServeDone, SwapDone
from scheduling.core.fifo import Fifo
from scheduling.core.swapper import Group, GroupSwapper

_seq = itertools.count(1)


def req(model: str, seq: int | None = None, priority: int = 0, now: float = 0.0) -> Request:
    """A request for `model`; seq increases across calls unless given."""
    return Request(next(_seq) if seq is None else seq, model, now, priority)


def arrive(s: Fifo, model: str, priority: int = 0, now: float = 0.0) -> Request:
    """Build a request, deliver its RequestArrived to `s`, return it."""
    r = req(model, priority=priority, now=now)
    s.on_request(RequestArrived(r, now))
    return r


def serve_done(s: Fifo, fx: FakeEffects, r: Request, now: float = 0.0) -> None:
    """Deliver the ServeDone of granted request `r` and note it closed in `fx`."""
    fx.closed.add(r)
    s.on_serve_done(ServeDone(r, now))


def serve_done_all(s: Fifo, fx: FakeEffects, model: str | None = None) -> int:
    """Finish every granted, still open request (of `model`, or all); return how many."""
    open_ = [r for r, m in fx.grants if r not in fx.closed and (model is None or m == model)]
    for r in open_:
        serve_done(s, fx, r)
    return len(open_)


class StubSwapper:
    """A fixed evict list per target, whatever is running (llama-swap's `stubPlanner`)."""

    def __init__(self, evict: Mapping[str, list[str]] | None = None) -> None:
        self.evict = dict(evict or {})

    def eviction_for(self, target: str, running: Iterable[str]) -> list[str]:
        return sorted(self.evict.get(target, []))

    def explain(self, target: str, running: Iterable[str]) -> str:
        return "stub"


def make_config(models: Iterable[str] | Mapping[str, ModelConfig], groups: Iterable[Group] = (),
                swapper: object = None) -> SchedulerConfig:
    """A SchedulerConfig over `models` (names get a default ModelConfig) with a GroupSwapper
    over `groups` (ungrouped models share the exclusive `(default)` group) unless `swapper`."""
    if not isinstance(models, Mapping):
        models = {m: ModelConfig() for m in models}
    models = dict(models)
    if swapper is None:
        swapper = GroupSwapper(list(groups), list(models))
    return SchedulerConfig(models=models, swapper=swapper)  # type: ignore[arg-type]


class FakeEffects:
    """An in-memory `Effects`: programmable states and departures, recorded calls."""

    def __init__(self, states: Mapping[str, str] | None = None) -> None:
        self.states: dict[str, str] = dict(states or {})  # missing → STOPPED
        self.gone: set[Request] = set()  # clients that left: grant_serve returns False
        self.swaps: list[tuple[str, list[str]]] = []  # start_swap(model, evict)
        self.grants: list[tuple[Request, str]] = []  # grant_serve calls the client received
        self.refused: list[tuple[Request, str]] = []  # grant_serve calls to a gone client
        self.errors: list[tuple[Request, SchedulingError]] = []
        self.stops: list[tuple[tuple[str, ...], object]] = []  # stop_processes(models, handle)
        self.positions: list[tuple[Request, int]] = []
        self.closed: set[Request] = set()  # granted requests whose ServeDone was delivered

    # -- Effects --
    def model_state(self, model: str) -> str:
        return self.states.get(model, STOPPED)

    def running_models(self) -> list[str]:
        return sorted(m for m, s in self.states.items() if s not in (STOPPED, FAILED))

    def start_swap(self, model: str, evict: list[str]) -> None:
        self.swaps.append((model, list(evict)))

    def grant_serve(self, req: Request, model: str) -> bool:
        if req in self.gone:
            self.refused.append((req, model))
            return False
        self.grants.append((req, model))
        return True

    def grant_error(self, req: Request, error: SchedulingError) -> None:
        self.errors.append((req, error))

    def stop_processes(self, models: Iterable[str], handle: object) -> None:
        self.stops.append((tuple(models), handle))

    def position_changed(self, req: Request, position: int) -> None:
        self.positions.append((req, position))

    # -- queries --
    def served(self, model: str) -> int:
        """Grants of `model` that reached their client."""
        return sum(1 for _, m in self.grants if m == model)

    def served_order(self) -> list[str]:
        return [m for _, m in self.grants]

    def errored(self, model: str | None = None) -> list[SchedulingError]:
        """The errors answered to requests for `model` (any model when None)."""
        return [e for r, e in self.errors if model is None or r.model == model]

    def error_of(self, r: Request) -> SchedulingError | None:
        found = [e for x, e in self.errors if x is r]
        assert len(found) <= 1, f"{r} answered {len(found)} errors"
        return found[0] if found else None

    def swaps_for(self, model: str) -> int:
        return sum(1 for m, _ in self.swaps if m == model)

    def position(self, r: Request) -> int | None:
        """The last position reported to `r`."""
        found = [p for x, p in self.positions if x is r]
        return found[-1] if found else None

    def clear(self) -> None:
        """Forget recorded calls (states, departures and `closed` stay)."""
        for log in (self.swaps, self.grants, self.refused, self.errors, self.stops,
                    self.positions):
            log.clear()

    # -- driving a swap's outcome into the states --
    def finish_swap(self, model: str, now: float = 0.0, error: str | None = None,
                    timed_out: bool = False) -> SwapDone:
        """Set states as the latest swap to `model` would leave them and return its SwapDone
        (the test delivers it): evicted models STOPPED; the target READY, or FAILED."""
        started = [evict for m, evict in self.swaps if m == model]
        assert started, f"no swap to {model!r} was started"
        for m in started[-1]:
            self.states[m] = STOPPED
        self.states[model] = READY if error is None else FAILED
        return SwapDone(model, now, error, timed_out)


def waiting_by_band_of(holders: Iterable[Request]) -> dict[str, tuple[int, float | None]]:
    """The per-band queue gauges computed the slow way, from the requests held (queued or
    waiting on a swap): the reference the property tests compare `waiting_by_band()` to."""
    bands = {"interactive": lambda p: p >= 50, "batch": lambda p: p <= -50,
             "normal": lambda p: -50 < p < 50}
    out: dict[str, tuple[int, float | None]] = {}
    for name, member in bands.items():
        arrivals = [r.arrived for r in holders if member(r.priority)]
        out[name] = (len(arrivals), min(arrivals) if arrivals else None)
    return out
