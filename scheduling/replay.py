"""Replay requests through the REAL scheduling core on a virtual clock: what would the
scheduler have done with this traffic?

A discrete-event replay: a heap of future events, no asyncio, no sleeps, no clock reads, so a
run is exact and repeatable and an hour of traffic replays in well under a second. The shell
is `SimEffects`: a swap takes its model's load time (the evicted models stop and the target is
ready at its end), a granted request occupies one of its upstream's `parallel` slots for its
service time. Nothing here decides anything: the decisions are the core's
(`scheduling.core.policies.make_scheduler`), or strict arrival order (`ArrivalOrder`), the
baseline the simulator compares with.

Two users: `bench/simulate.py` (synthetic traces, every policy side by side) and
`gpuproxy whatif` (`scheduling/whatif.py`: the activity log's own requests under other
settings). Pure Python like the core: no Django, no asyncio.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import (
    FAILED,
    READY,
    STARTING,
    STOPPED,
    STOPPING,
    Effects,
    Scheduler,
)
from scheduling.core.errors import SchedulingError
from scheduling.core.events import (
    Cancelled,
    Dispatch,
    ModelExited,
    Request,
    RequestArrived,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.policies import make_scheduler
from scheduling.core.priority import band
from scheduling.core.stats import SchedulerStats


@dataclass(frozen=True)
class Row:
    """One request to replay."""

    arrival: float  # seconds from the start of the trace: its wait and its aging count from here
    model: str
    priority: int
    service: float  # seconds its upstream needs to serve it
    # when it reaches the scheduler, if later than its arrival: a request that was already
    # waiting when a replayed window begins enters at its start, aged from its arrival
    enters: float | None = None


class ArrivalOrder:
    """Strict arrival order, the baseline: one queue, served head first, never reordered.

    The head is granted when its model is ready and has a free slot (`parallel`); otherwise,
    once nothing it would evict has requests in flight, a swap to its model starts. Nothing
    behind the head moves while it waits, so every model change in the arrival sequence costs
    a swap: the thrash the affinity bonus exists to avoid.
    """

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        self._config = config
        self._fx = fx
        self._queue: deque[Request] = deque()
        self._in_flight: dict[str, int] = {}
        self._swapping: str | None = None

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    def on_request(self, ev: RequestArrived) -> None:
        self._queue.append(ev.req)
        self._step()

    def on_swap_done(self, ev: SwapDone) -> None:
        self._swapping = None
        self._step()

    def on_serve_done(self, ev: ServeDone) -> None:
        self._in_flight[ev.req.model] -= 1
        self._step()

    def on_model_exited(self, ev: ModelExited) -> None:
        self._step()  # its head, if for that model, now starts a load

    def _step(self) -> None:
        fx = self._fx
        while self._queue and self._swapping is None:
            head = self._queue[0]
            model = head.model
            if fx.model_state(model) == READY:
                if self._in_flight.get(model, 0) >= self._config.models[model].parallel:
                    return
                self._queue.popleft()
                if fx.grant_serve(head, model):
                    self._in_flight[model] = self._in_flight.get(model, 0) + 1
                continue
            evict = self._config.swapper.eviction_for(model, fx.running_models())
            if any(self._in_flight.get(m, 0) for m in evict):
                return
            self._swapping = model
            fx.start_swap(model, evict)

    # The simulator sends none of these; the protocol asks for them.
    def on_cancel(self, ev: Cancelled) -> None: ...
    def on_unload(self, ev: UnloadRequested) -> None: ...
    def on_unload_done(self, ev: UnloadDone) -> None: ...
    def on_settings_changed(self, ev: SettingsChanged) -> None: ...
    def on_shutdown(self, ev: Shutdown) -> None: ...


@dataclass(eq=False)
class Job:
    """The simulator's side of one request: its trace row and what happened to it."""

    index: int
    row: Row
    granted: float | None = None  # the scheduler called grant_serve
    started: float | None = None  # an upstream slot took it (= granted unless it queued there)
    done: float | None = None
    error: str | None = None
    dispatch: Dispatch | None = None  # the scheduler's record of why it was granted then


class SimEffects:
    """The `Effects` of a virtual shell: instantaneous decisions, slow work on the sim's heap.

    A swap stops its evict set and readies its target `swap_cost` seconds after it starts
    (its own `load` time where the box gives one; STOPPING / STARTING meanwhile). Each model
    has `parallel` upstream slots; a request granted while they are full waits in the
    upstream's own FIFO (only fifo does that). A model with a `ttl` unloads once idle that
    long, as `gpuproxy.upstream.lifecycle` does it: idle since its ready, its last grant or
    its last request's end, nothing in flight; the scheduler hears `ModelExited`.
    """

    def __init__(self, sim: Simulation, config: SchedulerConfig, swap_cost: float,
                 load: dict[str, float] | None = None,
                 ttl: dict[str, float] | None = None) -> None:
        self._sim = sim
        self._config = config
        self._swap_cost = swap_cost
        self._load = load or {}
        self._ttl = ttl or {}
        self._used: dict[str, float] = {}  # model -> when it was last ready, granted or done
        self.idle_unloads = 0
        self.states: dict[str, str] = {}
        self.swaps: list[tuple[float, str, list[str]]] = []  # (now, target, evict)
        self._busy: dict[str, int] = {}
        self._upstream_queue: dict[str, deque[Request]] = {}

    def model_state(self, model: str) -> str:
        return self.states.get(model, STOPPED)

    def running_models(self) -> list[str]:
        return sorted(m for m, s in self.states.items() if s not in (STOPPED, FAILED))

    def start_swap(self, model: str, evict: list[str]) -> None:
        now = self._sim.now
        self.swaps.append((now, model, list(evict)))
        for m in evict:
            if self._busy.get(m):
                raise AssertionError(f"t={now}: swap to {model!r} evicts busy {m!r}")
            self.states[m] = STOPPING
        self.states[model] = STARTING
        self._sim.at(now + self._load.get(model, self._swap_cost), self._swap_done, model,
                     list(evict))

    def _swap_done(self, model: str, evict: list[str]) -> None:
        for m in evict:
            self.states[m] = STOPPED
        self.states[model] = READY
        self._touch(model)
        self._sim.scheduler.on_swap_done(SwapDone(model, self._sim.now))

    def _touch(self, model: str) -> None:
        self.touch_at(model, self._sim.now)

    def touch_at(self, model: str, now: float) -> None:
        """`model` was used at `now`: its idle unload is due `ttl` later, unless used again."""
        self._used[model] = now
        if self._ttl.get(model, 0) > 0:
            self._sim.at(now + self._ttl[model], self._ttl_due, model, now)

    def _ttl_due(self, model: str, since: float) -> None:
        if (self._used.get(model) != since or self.states.get(model) != READY
                or self._busy.get(model) or self._upstream_queue.get(model)):
            return  # used since, gone, or busy: a later check (or none) decides
        self.states[model] = STOPPED
        self.idle_unloads += 1
        self._sim.scheduler.on_model_exited(ModelExited(model, self._sim.now))

    def grant_serve(self, req: Request, model: str) -> bool:
        job: Job = req.handle
        if self.states.get(model) != READY:
            raise AssertionError(f"t={self._sim.now}: grant to {model!r}, which is not ready")
        job.granted = self._sim.now
        job.dispatch = req.dispatch
        self._touch(model)
        self._upstream_queue.setdefault(model, deque()).append(req)
        self._start_next(model)
        return True

    def _start_next(self, model: str) -> None:
        queue = self._upstream_queue.get(model)
        while queue and self._busy.get(model, 0) < self._config.models[model].parallel:
            req = queue.popleft()
            job: Job = req.handle
            job.started = self._sim.now
            self._busy[model] = self._busy.get(model, 0) + 1
            self._sim.at(self._sim.now + job.row.service, self._serve_end, req, model)

    def _serve_end(self, req: Request, model: str) -> None:
        job: Job = req.handle
        job.done = self._sim.now
        self._busy[model] -= 1
        self._touch(model)
        self._start_next(model)  # the upstream's own queue moves first (fifo only)
        self._sim.scheduler.on_serve_done(ServeDone(req, self._sim.now))

    def grant_error(self, req: Request, error: SchedulingError) -> None:
        job: Job = req.handle
        job.error = f"{type(error).__name__}: {error.message}"

    def stop_processes(self, models: Iterable[str], handle: object) -> None:
        models = tuple(models)
        for m in models:
            self.states[m] = STOPPING

        def stopped() -> None:
            for m in models:
                self.states[m] = STOPPED
            self._sim.scheduler.on_unload_done(UnloadDone(models, self._sim.now))

        self._sim.at(self._sim.now + self._swap_cost, stopped)

    def position_changed(self, req: Request, position: int) -> None:
        """Positions feed a loading stream; the simulator has no client to show them to."""


class Simulation:
    """A virtual clock and a heap of future callbacks; ties run in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.scheduler: Scheduler

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn, args))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)


@dataclass
class Replay:
    """What happened to every request of one replay."""

    jobs: list[Job]
    swaps: int
    stats: SchedulerStats | None = None  # the core's counters at the end (serial, fifo)
    swap_log: tuple[tuple[float, str, tuple[str, ...]], ...] = field(default=())
    # (when, target, evicted)
    idle_unloads: int = 0  # models unloaded by their ttl

    def waits(self, band_name: str | None = None) -> list[float]:
        """Arrival → start of service on the upstream, per request of `band_name` (all: None).
        For serial and arrival order that is the grant; fifo forwards everything it grants
        and the upstream queues the surplus in its own slots, so its grant can come earlier."""
        return [j.started - j.row.arrival for j in self.jobs
                if j.started is not None and (band_name is None or band(j.row.priority) ==
                                              band_name)]

    @property
    def makespan(self) -> float:
        return max((j.done for j in self.jobs if j.done is not None), default=0.0)


class _Quiet(logging.Filter):
    """The core logs every swap it starts, for the operator of a live box. A replay starts
    thousands of imaginary ones; this drops the core's records made on a thread while it
    replays (the live scheduler, on the run loop's thread, logs as before)."""

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "replaying", False)


_QUIET = _Quiet()
for _name in ("scheduling.serial", "scheduling.fifo"):
    logging.getLogger(_name).addFilter(_QUIET)


def replay(rows: Sequence[Row], config: SchedulerConfig, swap_cost: float,
           load: dict[str, float] | None = None, preload: Iterable[str] = (),
           arrival_order: bool = False, label: str = "replay",
           ttl: dict[str, float] | None = None) -> Replay:
    """Replay `rows` (sorted by arrival) under `config` and return what happened to each.

    `swap_cost`: seconds a swap takes; `load`: a model's own, where known. `preload`: models
    READY at t = 0 (none by default, so the first request pays a cold load, counted as a swap
    like any other). `ttl`: seconds idle after which a model unloads (none by default).
    `arrival_order`: the baseline instead of the core. Every model of `rows`
    must be in `config.models`, and its limits must admit everything: a request the core
    refuses has no service to replay, and the run raises naming it.
    """
    sim = Simulation()
    fx = SimEffects(sim, config, swap_cost, load, ttl)
    for m in preload:
        fx.states[m] = READY
        fx.touch_at(m, 0.0)  # its ttl counts from the start: its last use before is unknown
    sim.scheduler = (cast(Scheduler, ArrivalOrder(config, fx)) if arrival_order
                     else make_scheduler(config, fx))
    jobs = [Job(i, r) for i, r in enumerate(rows)]
    for i, job in enumerate(jobs):
        req = Request(i + 1, job.row.model, job.row.arrival, job.row.priority, handle=job)
        enters = job.row.arrival if job.row.enters is None else job.row.enters
        sim.at(enters, _arrive, sim, req)
    _QUIET.local.replaying = True
    try:
        sim.run()
    finally:
        _QUIET.local.replaying = False
    unfinished = [j for j in jobs if j.done is None]
    if unfinished:
        j = unfinished[0]
        raise AssertionError(f"{label}: {len(unfinished)} request(s) never served, e.g. "
                             f"#{j.index} {j.row} (error: {j.error})")
    stats = getattr(sim.scheduler, "stats", None)
    return Replay(jobs, len(fx.swaps), stats=stats() if stats is not None else None,
                  swap_log=tuple((t, m, tuple(e)) for t, m, e in fx.swaps),
                  idle_unloads=fx.idle_unloads)


def _arrive(sim: Simulation, req: Request) -> None:
    sim.scheduler.on_request(RequestArrived(req, sim.now))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): a value that occurred, no interpolation."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


