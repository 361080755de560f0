"""The seams between the pure core and the async shell, as Protocols (llama-swap's scheduler.go).

Every method here is called by the core from inside one of its `on_*` handlers, on the run
loop's task; none may block or await. Slow work (a swap, a stop) is started here and reported
back later as an event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from scheduling.core.config import SchedulerConfig
from scheduling.core.errors import SchedulingError
from scheduling.core.events import (
    Cancelled,
    ModelExited,
    Request,
    RequestArrived,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.stats import SchedulerStats

# Process states as the core reads them (advisory snapshots from the shell).
STOPPED = "stopped"
STARTING = "starting"
READY = "ready"
STOPPING = "stopping"
FAILED = "failed"


class Effects(Protocol):
    def model_state(self, model: str) -> str:
        """The process state of `model` now: one of the constants above."""

    def running_models(self) -> list[str]:
        """Every model whose process is not stopped or failed."""

    def start_swap(self, model: str, evict: list[str]) -> None:
        """Stop `evict` (in parallel), then make `model` ready; post SwapDone when finished.

        Fire-and-forget: the core records the swap before calling this.
        """

    def grant_serve(self, req: Request, model: str) -> bool:
        """Let `req` go to `model`'s upstream. False when its client already left: then no
        ServeDone will ever come and the core must not count it in flight."""

    def grant_error(self, req: Request, error: SchedulingError) -> None:
        """Answer `req` with `error`. Its client may already be gone; that is fine."""

    def stop_processes(self, models: Iterable[str], handle: object) -> None:
        """Stop these models' processes; post UnloadDone(models) when they are gone and answer
        `handle` (the caller of an explicit unload)."""

    def position_changed(self, req: Request, position: int) -> None:
        """`req` is now at 1-based `position` in the queue (for loading-state streams)."""


class Scheduler(Protocol):
    """A scheduling policy. Methods run on the run loop's task only: no locks, no awaits.

    Every RequestArrived ends in exactly one of: granted, errored, queued, joined a swap,
    or started a swap; a queued or waiting request later ends granted, errored or cancelled.
    """

    def on_request(self, ev: RequestArrived) -> None: ...
    def on_cancel(self, ev: Cancelled) -> None: ...
    def on_swap_done(self, ev: SwapDone) -> None: ...
    def on_serve_done(self, ev: ServeDone) -> None: ...
    def on_unload(self, ev: UnloadRequested) -> None: ...
    def on_unload_done(self, ev: UnloadDone) -> None: ...
    def on_restart(self, ev: RestartRequested) -> None: ...
    def on_settings_changed(self, ev: SettingsChanged) -> None: ...
    def on_model_exited(self, ev: ModelExited) -> None: ...
    def on_shutdown(self, ev: Shutdown) -> None: ...

    @property
    def config(self) -> SchedulerConfig: ...

    # Read-only introspection for the shell's views and metrics (run loop's task only).
    def queued(self) -> list[Request]: ...
    def active_swaps(self) -> dict[str, list[Request]]: ...
    def in_flight(self, model: str) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def waiting_by_band(self) -> dict[str, tuple[int, float | None]]: ...
    def restart_pending(self) -> frozenset[str]: ...
    def selector_pick(self, selector_id: str) -> str | None: ...
