"""What the running proxy publishes for any thread to read: the run loop's
`SchedulerSnapshot` after every event, each model's process state, the configured models, the
perf monitor, and the change bus the dashboard wakes on.

One mutable cell, rebound whole (atomic under the GIL): the scrape thread, the admin's worker
threads and the dashboard read it without a lock and without touching the scheduler, which
belongs to the run loop's task alone. The Prometheus series over it are metrics.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuproxy.observe.perf import PerfMonitor
from gpuproxy.upstream.states import State
from scheduling.core.priority import BANDS
from scheduling.core.stats import SchedulerStats


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What the run loop publishes after each event. `waiting` maps each band to (depth,
    `arrived` of its oldest request in the loop's clock, or None); `clock_offset` turns the
    loop's clock into `time.monotonic()` so a scrape can age the oldest wait itself."""

    waiting: Mapping[str, tuple[int, float | None]]
    stats: SchedulerStats
    in_flight: Mapping[str, int]
    clock_offset: float = 0.0
    scheduler: str = ""
    restart_pending: frozenset[str] = frozenset()  # changed definitions, restarted when idle


EMPTY = SchedulerSnapshot(waiting={b: (0, None) for b in BANDS}, stats=SchedulerStats(),
                          in_flight={})


@dataclass
class _Published:
    """The one mutable cell: an attribute rebinding, atomic under the GIL."""

    scheduler: SchedulerSnapshot = EMPTY
    models: tuple[str, ...] = ()
    model_states: dict[str, str] = field(default_factory=dict)
    perf: PerfMonitor | None = None
    loop_tasks: int = 0  # asyncio tasks on the server's loop, counted on the loop itself


_cell = _Published()


_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` (on the event loop) whenever the scheduler or a model changed: the
    dashboard's cue to refresh."""
    _listeners.append(listener)


def changed() -> None:
    for listener in list(_listeners):
        listener()


def publish_scheduler(snapshot: SchedulerSnapshot) -> None:
    """Called by the run loop (its task only) after every event."""
    _cell.scheduler = snapshot
    changed()


def scheduler_snapshot() -> SchedulerSnapshot:
    return _cell.scheduler


def model_states() -> dict[str, str]:
    """A copy of each model's last process state (any thread)."""
    return dict(_cell.model_states)


def publish_loop_tasks(count: int) -> None:
    """The number of asyncio tasks on the server's loop (a leak shows as steady growth)."""
    _cell.loop_tasks = count


def configured_models() -> tuple[str, ...]:
    return _cell.models


def publish_perf_monitor(monitor: PerfMonitor | None) -> None:
    """The running proxy's performance monitor (one per runtime, bound to its loop)."""
    _cell.perf = monitor


def perf_monitor() -> PerfMonitor | None:
    return _cell.perf


def loop_tasks() -> int:
    return _cell.loop_tasks


def set_model_state(model: str, state: str) -> str:
    """Record a process's new state (its owner's on_state hook, via metrics); returns the
    previous one. The caller wakes the listeners (`changed()`) once it has counted it."""
    previous = _cell.model_states.get(model, State.STOPPED)
    _cell.model_states[model] = state
    return previous


def set_models(ids: tuple[str, ...]) -> None:
    _cell.models = ids
