"""Counters kept by every scheduler, for metrics (a later issue exports them to Prometheus)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduling.core.events import Request
from scheduling.core.priority import BANDS, band


def _zero_per_band() -> dict[str, int]:
    return dict.fromkeys(BANDS, 0)


@dataclass
class SchedulerStats:
    """Monotonic counters since the scheduler started (handed over on a policy switch).

    - `dispatched`: requests granted to an upstream (the client received the grant), per
      band of the request's own priority; every band is always present.
    - `pick_changed_by_aging`: picks where the winner without the aging term would have been
      another request (serial only; fifo has no aging, so 0).
    - `pick_changed_by_affinity`: picks where the winner without the swap-affinity term would
      have been another request (serial only; 0 under fifo).

    A *pick* is one decision to serve a request or start a swap for it; the "changed by"
    counters count only picks with more than one candidate.
    """

    dispatched: dict[str, int] = field(default_factory=_zero_per_band)
    pick_changed_by_aging: int = 0
    pick_changed_by_affinity: int = 0

    def copy(self) -> SchedulerStats:
        return SchedulerStats(dict(self.dispatched), self.pick_changed_by_aging,
                              self.pick_changed_by_affinity)


def queue_snapshot(waiting: Iterable[Request], now: float) -> dict[str, tuple[int, float]]:
    """Per band: (how many requests wait, seconds the oldest has waited at `now`).

    Every band is present; an empty band is (0, 0.0). `waiting` is everything admitted and not
    yet granted: queued, and waiting on a swap.
    """
    depth = _zero_per_band()
    oldest: dict[str, float] = {}
    for r in waiting:
        b = band(r.priority)
        depth[b] += 1
        if b not in oldest or r.arrived < oldest[b]:
            oldest[b] = r.arrived
    return {b: (depth[b], max(0.0, now - oldest[b]) if b in oldest else 0.0) for b in BANDS}
