"""Counters kept by every scheduler; `/metrics` exports them (gpuproxy/observe/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.core.priority import BANDS


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
