"""Counters and gauges kept by every scheduler; `/metrics` exports them
(gpuproxy/observe/metrics.py), and the queue caps read the gauges."""

from __future__ import annotations

import heapq
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
    - `affinity_budget_overrides`: times the affinity budget switched affinity off because a
      request had lost picks to it for longer than the budget (serial, budget on; else 0).

    A *pick* is one decision to serve a request or start a swap for it; the "changed by"
    counters count only picks with more than one candidate.
    """

    dispatched: dict[str, int] = field(default_factory=_zero_per_band)
    pick_changed_by_aging: int = 0
    pick_changed_by_affinity: int = 0
    affinity_budget_overrides: int = 0

    def copy(self) -> SchedulerStats:
        return SchedulerStats(dict(self.dispatched), self.pick_changed_by_aging,
                              self.pick_changed_by_affinity, self.affinity_budget_overrides)


class WaitGauges:
    """Requests admitted and not yet granted (queued or waiting on a swap), per band of their
    own priority: a count, and a heap on arrival with lazy deletion (an entry is live while
    its request is in `_live`), so the oldest is O(log n) amortised instead of a scan."""

    def __init__(self) -> None:
        self._live: set[Request] = set()
        self.count: dict[str, int] = dict.fromkeys(BANDS, 0)  # read-only outside
        self._heaps: dict[str, list[tuple[float, int, int, Request]]] = {b: [] for b in BANDS}

    def total(self) -> int:
        return sum(self.count.values())

    def add(self, req: Request) -> None:
        b = band(req.priority)
        self._live.add(req)
        self.count[b] += 1
        heapq.heappush(self._heaps[b], (req.arrived, req.seq, id(req), req))

    def discard(self, req: Request) -> None:
        """`req` stops waiting (granted or gone); its heap entry is dropped lazily."""
        if req in self._live:
            self._live.remove(req)
            b = band(req.priority)
            self.count[b] -= 1
            heap = self._heaps[b]
            if len(heap) > 64 + 2 * self.count[b]:
                # Mostly dead entries (an old request holds the top while later ones come and
                # go): rebuild, so memory follows the live queue and no granted request is
                # kept alive by its entry.
                heap[:] = [e for e in heap if e[3] in self._live]
                heapq.heapify(heap)

    def by_band(self) -> dict[str, tuple[int, float | None]]:
        """Per band: (the count, the oldest one's `arrived`, or None when the band is
        empty). Every band is present. O(bands), amortised."""
        out: dict[str, tuple[int, float | None]] = {}
        for b in BANDS:
            heap = self._heaps[b]
            while heap and heap[0][3] not in self._live:
                heapq.heappop(heap)
            out[b] = (self.count[b], heap[0][0] if heap else None)
        return out
