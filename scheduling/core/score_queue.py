"""The serial scheduler's queue: per-model heaps in score order, and the cached order of the
whole queue that position reports are kept by.

Split out of serial.py because it is a job of its own: a data structure that answers "who is
best now, in what order is everyone, whose position changed" cheaply (lazy deletion, one
merge per re-rank, bisection), whereas serial.py decides what to do with the answer (the
walk, its claims, grants and swaps). Only `Serial` inherits `ScoreQueue`; the rank needs one
thing from it, `_affine()` (the models whose requests get the affinity bonus now).

    rank = (key - affinity x aging_divisor, seq), lower first,
    key  = arrived - priority x aging_divisor

which is aging_divisor times -(score at `now`), minus a constant shared by every request: the
same order as the score, at any `now`. Pure: standard library only.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable

from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import Effects
from scheduling.core.events import Request
from scheduling.core.ledger import Ledger

DEFAULT_AGING_DIVISOR = 60.0
MAX_AFFINITY_BONUS = 99  # below the 100 between bands: affinity never crosses a band


def aging_divisor_of(config: SchedulerConfig) -> float:
    """Seconds of waiting per point of score; a non-positive or non-finite value (which the
    config importer refuses) falls back to the default rather than dividing by zero."""
    d = config.aging_divisor
    return float(d) if isinstance(d, int | float) and math.isfinite(d) and d > 0 \
        else DEFAULT_AGING_DIVISOR


def affinity_bonus_of(config: SchedulerConfig) -> int:
    """The swap-affinity bonus, clamped to 0..99 whatever the config says."""
    return int(min(max(config.swap_affinity_bonus, 0), MAX_AFFINITY_BONUS))


# A heap entry: (key, seq, token, request). `token` tells a live entry from a stale one (the
# request was cancelled, granted or moved since): live iff `_live[request] == token`.
_Entry = tuple[float, int, int, Request]
# The same on (-priority, seq), for the "winner without aging" counter.
_PEntry = tuple[int, int, int, Request]


class ScoreQueue(Ledger):
    """Serial's queued requests (not swap waiters), in score order.

    Books:
      - `_heaps[m]`: min-heap of model m's queued requests on (key, seq). Linear aging adds
        the same now/aging_divisor to every score, so this order never changes while
        requests wait, and affinity is the same for every request of a model; so a model's
        head is its best request at any `now`, and the box's best is the best of the heads
        once each head's affinity is added: O(models + log n) per pick;
      - `_pheaps[m]`: the same requests on (-priority, seq), only for the "winner without
        aging" counter;
      - `_live`: queued request → the token of its current entries (lazy deletion);
      - `_count[m]`: model m's live queued requests;
      - `_order` / `_order_ranks` / `_pending` / `_report_from`: the position cache.
    """

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        super().__init__(config, fx)
        self._div = aging_divisor_of(config)
        self._bonus = affinity_bonus_of(config)
        self._heaps: dict[str, list[_Entry]] = {}  # only models with queued requests
        self._pheaps: dict[str, list[_PEntry]] = {}
        self._live: dict[Request, int] = {}
        self._count: dict[str, int] = {}  # model → live queued requests
        self._tokens = itertools.count()
        # The queue in score order, kept up to date by bisection on push and removal (for
        # position reports), valid for the affinity set `_order_affine`; None when stale.
        self._order: list[Request] | None = None
        self._order_ranks: list[tuple[float, int]] = []
        self._order_affine: set[str] = set()
        self._report_from = 0  # positions from this index on may have changed
        # Pushed since the last report and not yet placed in `_order` (placed at the report,
        # so a request granted in the handler that queued it costs no position work).
        self._pending: dict[Request, None] = {}

    def queued(self) -> list[Request]:
        """The queued requests (not those waiting on a swap), best score first. The order
        does not depend on `now` (linear aging), only on the queue and on which models are
        loaded. O(n) (O(n log n) if the loaded set changed since the last event)."""
        affine = self._affine()
        if self._order is not None and not self._pending and affine == self._order_affine:
            return list(self._order)
        return [r for _, r in self._ranked(affine)]

    def _affine(self) -> set[str]:
        """The models whose requests get the affinity bonus now (serial decides)."""
        raise NotImplementedError

    # ---- Ledger's queue hooks ---------------------------------------------------------------

    def _dequeue(self, req: Request) -> bool:
        if req not in self._live:
            return False
        self._forget(req)
        return True

    def _take_queue(self) -> list[Request]:
        queued = self.queued()
        self._heaps, self._pheaps, self._live, self._count = {}, {}, {}, {}
        self._invalidate_order()
        return queued

    def _restore_queue(self, queued: Iterable[Request]) -> None:
        for r in queued:
            self._push(r)

    # ---- the heaps --------------------------------------------------------------------------

    def _key(self, req: Request) -> float:
        return req.arrived - req.priority * self._div

    def _push(self, req: Request) -> None:
        token = next(self._tokens)
        self._live[req] = token
        m = req.model
        if m not in self._heaps:
            self._heaps[m], self._pheaps[m], self._count[m] = [], [], 0
        heapq.heappush(self._heaps[m], (self._key(req), req.seq, token, req))
        heapq.heappush(self._pheaps[m], (-req.priority, req.seq, token, req))
        self._count[m] += 1
        if self._order is not None:
            self._pending[req] = None

    def _is_live(self, entry: _Entry | _PEntry) -> bool:
        return self._live.get(entry[3]) == entry[2]

    def _head(self, m: str) -> _Entry:
        heap = self._heaps[m]
        while not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0]

    def _phead(self, m: str) -> _PEntry:
        heap = self._pheaps[m]
        while not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0]

    def _forget(self, req: Request) -> None:
        """`req` leaves the queue: its entries go stale; drop the model's heaps when empty."""
        del self._live[req]
        self._positions.pop(req, None)
        if req in self._pending:
            del self._pending[req]
        elif self._order is not None:
            i = bisect.bisect_left(self._order_ranks, self._cached_rank(req))
            if i < len(self._order) and self._order[i] is req:
                del self._order_ranks[i], self._order[i]
                self._report_from = min(self._report_from, i)
            else:  # cannot happen while ranks are consistent; never guess
                self._invalidate_order()
        m = req.model
        left = self._count[m] - 1
        if left == 0:
            del self._heaps[m], self._pheaps[m], self._count[m]
            return
        self._count[m] = left
        if len(self._heaps[m]) + len(self._pheaps[m]) > 4 * left + 64:
            self._rebuild(m)  # too many stale entries: O(n) now, amortised O(1)

    def _pop_head(self, m: str) -> None:
        self._head(m)  # drop stale entries above the live head
        entry = heapq.heappop(self._heaps[m])
        self._forget(entry[3])

    def _take_all(self, m: str) -> list[Request]:
        """Remove and return every queued request of `m`, best first."""
        entries = sorted(e for e in self._heaps[m] if self._is_live(e))
        for e in entries:
            del self._live[e[3]]
            self._positions.pop(e[3], None)
            self._pending.pop(e[3], None)
        del self._heaps[m], self._pheaps[m], self._count[m]
        if self._order is not None:
            first = next((i for i, r in enumerate(self._order) if r.model == m), None)
            if first is not None:
                kept = [i for i in range(first, len(self._order)) if self._order[i].model != m]
                self._order[first:] = [self._order[i] for i in kept]
                self._order_ranks[first:] = [self._order_ranks[i] for i in kept]
                self._report_from = min(self._report_from, first)
        return [e[3] for e in entries]

    def _rebuild(self, m: str) -> None:
        """Rebuild `m`'s heaps from its live requests with fresh keys (after a divisor
        change, or to shed stale entries)."""
        live = [e[3] for e in self._heaps[m] if self._is_live(e)]
        heap = [(self._key(r), r.seq, self._live[r], r) for r in live]
        pheap = [(-r.priority, r.seq, self._live[r], r) for r in live]
        heapq.heapify(heap)
        heapq.heapify(pheap)
        self._heaps[m], self._pheaps[m] = heap, pheap

    def _invalidate_order(self) -> None:
        self._order, self._order_ranks = None, []
        self._pending.clear()

    def _cached_rank(self, req: Request) -> tuple[float, int]:
        """`req`'s place in `_order`: (key - affinity x divisor, seq), lower first, with the
        affinity set the cached order was built on."""
        shift = (self._bonus if req.model in self._order_affine else 0) * self._div
        return (self._key(req) - shift, req.seq)

    def _ranked(self, affine: set[str]) -> list[tuple[tuple[float, int], Request]]:
        """Every queued request with its rank for `affine`, best first. Built from the cached
        order when there is one: its per-model subsequences are already sorted, so the sort
        only merges one run per model (O(n log models)); else a full sort of the heaps."""
        def rank(r: Request) -> tuple[float, int]:
            return (self._key(r) - (self._bonus if r.model in affine else 0) * self._div, r.seq)

        if self._order is not None:
            runs: dict[str, list[Request]] = {}
            for r in self._order:
                runs.setdefault(r.model, []).append(r)
            ranked = [(rank(r), r) for run in runs.values() for r in run]
            ranked.extend((rank(r), r) for r in self._pending)
        else:
            ranked = [(rank(e[3]), e[3]) for heap in self._heaps.values() for e in heap
                      if self._is_live(e)]
        ranked.sort(key=lambda x: x[0])
        return ranked

    # ---- positions --------------------------------------------------------------------------

    def _report_positions(self) -> None:
        """Tell each queued request its 1-based position in score order when it is new or
        has changed. Pushes and removals keep the cached order by bisection, so only the
        positions from the first changed index on are looked at; it is re-ranked only when
        the set of loaded models or the settings changed."""
        if not self._config.report_positions:
            return
        if not self._live:  # nothing to report; the next queue is ranked afresh
            self._invalidate_order()
            return
        affine = self._affine()
        if self._order is None or affine != self._order_affine:
            ranked = self._ranked(affine)
            self._pending.clear()
            self._order_affine = affine
            self._order_ranks = [k for k, _ in ranked]
            self._order = [r for _, r in ranked]
            start = 0
        else:
            for r in self._pending:
                rank = self._cached_rank(r)
                i = bisect.bisect_left(self._order_ranks, rank)
                self._order_ranks.insert(i, rank)
                self._order.insert(i, r)
                self._report_from = min(self._report_from, i)
            self._pending.clear()
            start = self._report_from
        order = self._order
        self._report_from = len(order)
        for i in range(start, len(order)):
            r = order[i]
            if self._positions.get(r) != i + 1:
                self._positions[r] = i + 1
                self._fx.position_changed(r, i + 1)
