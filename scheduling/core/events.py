"""What happened, as facts: the only inputs of a scheduler.

Every event carries `now` (seconds on the shell's monotonic clock) so the core never reads a
clock and tests drive time by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduling.core.config import SchedulerConfig


@dataclass(frozen=True)
class Dispatch:
    """Why a request was granted when it was: written by the scheduler at the grant, read by
    the shell for the activity log and metrics."""

    band: str  # "interactive" | "normal" | "batch", from the request's priority
    score: float  # the score it won with (fifo: its effective priority)
    priority: int  # the priority term (fifo: model fifo priority + the request's)
    affinity: float  # the swap-affinity term (0 under fifo)
    aging: float  # the aging term, seconds waited / agingDivisor (0 under fifo)
    seq: int  # arrival sequence, the tie-breaker
    queue_wait: float  # seconds from arrival to grant
    # serial: the affinity budget decided this model's affinity at the grant: a request of
    # it had lost picks to affinity for the budget and was still waiting, so the model
    # ranked as loaded (scheduling/core/budget.py)
    budget_override: bool = False


@dataclass(eq=False)
class Request:
    """One client waiting for a model, as the core sees it.

    Identity is the object itself (eq=False): two requests with equal fields are different
    clients. `handle` belongs to the shell (a future, a consumer); the core never looks in it.
    """

    seq: int  # arrival order, unique and increasing; ties in priority go to the smaller seq
    # resolved model id, a selector id until the core binds it to a target (then the
    # target), or the unknown name as requested (the core answers 404)
    model: str
    # `now` of its RequestArrived, less the age a trusted peer said it already waited
    # (X-LlamaSwap-Arrived), so that aging counts from its first arrival, not every hop.
    arrived: float
    priority: int = 0  # the request's own priority (X-LlamaSwap-Priority); 0 when absent
    handle: Any = field(default=None, repr=False)
    dispatch: Dispatch | None = None  # set by the scheduler when it grants the request
    selector: str = ""  # the selector id it asked for, once bound to a target (`model`)


@dataclass(frozen=True)
class RequestArrived:
    req: Request
    now: float


@dataclass(frozen=True)
class Cancelled:
    """The client left before being granted (queued, or waiting on a swap)."""

    req: Request
    now: float


@dataclass(frozen=True)
class SwapDone:
    """A swap started with `Effects.start_swap` finished; `error` is None on success."""

    model: str
    now: float
    # The start failure as any client may read it (model, what happened, port); the command
    # line and the output tail are for the log and the admin only (StartFailed.public).
    error: str | None = None
    timed_out: bool = False  # the model did not become ready within healthCheckTimeout


@dataclass(frozen=True)
class ModelExited:
    """`model`'s process exited, for whatever reason (a crash, a stop, its TTL), posted the
    moment the shell notices, before the process's state says so. Until a later load
    succeeds (its SwapDone), the model is not loaded, whatever a state read says: a request
    for it starts a load instead of being granted to a process that is gone."""

    model: str
    now: float


@dataclass(frozen=True)
class ServeDone:
    """A granted request finished (completed, failed or its client left)."""

    req: Request
    now: float


@dataclass(frozen=True)
class UnloadRequested:
    """An explicit unload (API, admin); `handle` is answered by the shell once stopped.

    `everything=True` also stops every model loaded or loading when the scheduler handles
    the event (a running process, or the target of a swap in progress), resolved there and
    not by the sender, so no earlier read decides it: `UnloadRequested((), now, handle,
    everything=True)` is "unload all". The UnloadDone that follows names the resolved list.
    """

    models: tuple[str, ...]
    now: float
    handle: Any = field(default=None, repr=False)
    everything: bool = False


@dataclass(frozen=True)
class UnloadDone:
    """The processes of an UnloadRequested are stopped."""

    models: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class RestartRequested:
    """Restart these models once each is idle (admin action), never cutting off work."""

    models: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class SettingsChanged:
    config: SchedulerConfig
    now: float


@dataclass(frozen=True)
class Shutdown:
    now: float


Event = (RequestArrived | Cancelled | SwapDone | ServeDone | UnloadRequested | UnloadDone
         | RestartRequested | SettingsChanged | Shutdown | ModelExited)
