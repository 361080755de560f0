"""A scheduler's books as plain data, so a live policy switch (fifo <-> serial) loses nothing.

`Fifo.export_state()` / `Serial.export_state()` move everything a scheduler holds into a
`SchedulerState` and leave the old instance empty and refusing (ShuttingDown to any late
request), and `Fifo.from_state(...)` / `Serial.from_state(...)` build the other policy from it.
`scheduling.core.policies.make_scheduler` chooses between them. Pure: no Django, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.core.config import ModelConfig
from scheduling.core.events import Request
from scheduling.core.stats import SchedulerStats


class HandoverError(AssertionError):
    """A state that cannot be adopted (one request in two places): a bug, never guessed."""


@dataclass
class Swap:
    """A swap started with `Effects.start_swap` and not yet reported by `SwapDone`: the one
    record of it, in a scheduler's books (`Ledger._active`) and in a handed-over state."""

    target: str
    evict: list[str]
    waiters: list[Request] = field(default_factory=list)  # admitted, waiting for this swap
    # serial's cache of the best (key, seq) among the waiters; None: stale. fifo never reads
    # it; whoever changes `waiters` outside serial sets it to None.
    best: tuple[float, int] | None = None


@dataclass
class SchedulerState:
    """Everything a scheduler holds. Every admitted request is in exactly one of `queued`,
    a swap's `waiters` or `serving`; each of them holds one admission slot of its model (a
    selector request not yet bound to a target: of its selector, and it stays unbound)."""

    queued: list[Request] = field(default_factory=list)  # admitted, not granted, in any order
    swaps: list[Swap] = field(default_factory=list)
    serving: dict[Request, str] = field(default_factory=dict)  # granted → model, until ServeDone
    unloading: dict[str, int] = field(default_factory=dict)  # model → unloads not yet done
    shut_down: bool = False
    now: float = 0.0  # the `now` of the last event the exporter saw
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    positions: dict[Request, int] = field(default_factory=dict)  # last position reported
    pending_stop: dict[str, str] = field(default_factory=dict)  # model → "restart" | "removed"
    models: dict[str, ModelConfig] = field(default_factory=dict)  # the exporter's config
    turns: dict[str, int] = field(default_factory=dict)  # selector -> spillover's round robin

    def holders(self) -> list[Request]:
        """Every request holding a slot; raises HandoverError if one appears twice."""
        out = [*self.queued, *(w for s in self.swaps for w in s.waiters), *self.serving]
        if len(set(out)) != len(out):
            raise HandoverError("a request is in two places in the handed-over state")
        targets = [s.target for s in self.swaps]
        if len(set(targets)) != len(targets):
            raise HandoverError("two active swaps to one target in the handed-over state")
        return out
