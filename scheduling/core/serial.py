"""The serial scheduler: one dispatch order for the whole box, by score. Pure state machine.

    score = priority + swap affinity + aging
      priority  the request's own X-LlamaSwap-Priority (scheduling/core/priority.py)
      affinity  swap_affinity_bonus (clamped to 0..99) when the request's model is loaded:
                READY (and neither being evicted nor unloading), or the target of a swap in
                progress; else 0
      aging     (now - arrived) / aging_divisor, unbounded
      ties      earlier arrival (smaller seq) first

At every decision (arrival, serve done, swap done, cancel, unload, settings change, tick) the
waiting requests are walked in score order and the highest-scoring one is served first. A
lower-scoring request is dispatched before a higher one only where that cannot delay it; the
llama-swap safety rules of fifo.py all hold (admission, join, never evicting a busy or
unloading model, record-then-start, counting only received grants). `docs/scheduler-design.md`
§7 walks through it.

Unlike fifo, serial grants at most `ModelConfig.parallel` requests at once per model and keeps
the rest here, so the order is decided by the score and not by the upstream's own queue.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from dataclasses import dataclass, field

from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import READY, Effects
from scheduling.core.errors import (
    ModelNotFound,
    ShuttingDown,
    SwapFailed,
)
from scheduling.core.events import (
    Cancelled,
    Dispatch,
    ModelExited,
    Request,
    RequestArrived,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    Tick,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.handover import SchedulerState
from scheduling.core.ledger import Ledger
from scheduling.core.priority import band

logger = logging.getLogger("scheduling.serial")

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


@dataclass
class _Swap:
    """A swap started with `Effects.start_swap` and not yet reported by `SwapDone`."""

    target: str
    evict: list[str]
    waiters: list[Request] = field(default_factory=list)
    best: tuple[float, int] | None = None  # cached best (key, seq) of the waiters; None: stale


# A heap entry: (key, seq, token, request). `token` tells a live entry from a stale one (the
# request was cancelled, granted or moved since): live iff `_live[request] == token`.
_Entry = tuple[float, int, int, Request]


class Serial(Ledger):
    """The `Scheduler` protocol with score order (see the module docstring).

    Books, written only by the `on_*` handlers (all on the run loop's task, so no locks):
      - `_heaps[m]`: min-heap of model m's queued requests on (key, seq), with
        key = arrived - priority * aging_divisor. That is aging_divisor times
        -(priority - arrived/aging_divisor): the same order, exact for whole-second arrivals.
        Linear aging adds the same now/aging_divisor to every score, so this order never
        changes while requests wait, and affinity is the same for every request of a model;
        so a model's head is its best request at any `now`, and the box's best is the best of
        the heads once each head's affinity is added: O(models + log n) per pick;
      - `_pheaps[m]`: the same requests on (-priority, seq), only for the "winner without
        aging" counter;
      - `_live`: queued request → the token of its current entries (lazy deletion);
      - `_active`: target → the swap loading it, with its evict set and waiters;
      - `_in_flight` / `_serving`: granted requests a ServeDone has not yet closed;
      - `_holders` / `_reserved`: admission slots, as in fifo;
      - `_unloading`: models with an explicit unload not yet reported by UnloadDone;
      - `_exited`: models whose process exited (ModelExited) since their last successful
        load: not loaded, whatever `model_state` still says.
    """

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        self._init_books(config, fx)
        self._exited: set[str] = set()
        self._div = aging_divisor_of(config)
        self._bonus = affinity_bonus_of(config)
        self._heaps: dict[str, list[_Entry]] = {}  # only models with queued requests
        self._pheaps: dict[str, list[_Entry]] = {}
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

    # ---- read-only introspection (metrics, tests, bench) ----------------------------------

    def queued(self) -> list[Request]:
        """The queued requests (not those waiting on a swap), best score first. The order
        does not depend on `now` (linear aging), only on the queue and on which models are
        loaded. O(n) (O(n log n) if the loaded set changed since the last event)."""
        affine = self._affine()
        if self._order is not None and not self._pending and affine == self._order_affine:
            return list(self._order)
        return [r for _, r in self._ranked(affine)]

    def active_swaps(self) -> dict[str, list[Request]]:
        """Each swap in progress: target → the requests waiting for it."""
        return {target: list(swap.waiters) for target, swap in self._active.items()}

    def pick(self, now: float) -> Request | None:
        """The current winner: the highest-scoring queued request at `now` (whether or not it
        can run right now), or None when nothing is queued. Swap waiters are not candidates.

        No side effects on the schedule (it may drop stale heap entries of cancelled
        requests). Cost: O(models) effect reads for the affinity set plus O(models) head
        comparisons; `bench/scheduler_pick.py` measures it."""
        if not self._heaps:
            return None
        affine = self._affine()
        best: tuple[float, int] | None = None
        winner = None
        for m in self._heaps:
            key, seq, _, r = self._head(m)
            rank = (key - (self._bonus if m in affine else 0) * self._div, seq)
            if best is None or rank < best:
                best, winner = rank, r
        return winner

    def score(self, req: Request, now: float) -> float:
        """`req`'s score at `now` with the current affinity: priority + affinity + aging."""
        aff = self._bonus if req.model in self._affine() else 0
        return req.priority + aff + (now - req.arrived) / self._div

    # ---- events ---------------------------------------------------------------------------

    def on_request(self, ev: RequestArrived) -> None:
        """Admit and place one arriving request:

        1. the model is not defined → ModelNotFound (404); nothing is reserved;
        2. admission: after shutdown → ShuttingDown; the model already holds
           `concurrency_limit` slots → ConcurrencyLimit (429); otherwise reserve a slot;
        3. a swap to the same model is active (and no unload of it is pending) → join it;
        4. otherwise queue it and walk the queue (`_walk`): it is granted, starts a swap or
           waits, according to its score and what it would delay.
        """
        self._now = ev.now
        req = ev.req
        if not self._admit(req):
            return
        swap = self._active.get(req.model)
        if swap is not None and req.model not in self._unloading:
            swap.waiters.append(req)
            if swap.best is not None:
                swap.best = min(swap.best, (self._key(req), req.seq))
            return
        self._push(req)
        self._dispatch()

    def on_cancel(self, ev: Cancelled) -> None:
        """The client left while queued or waiting on a swap: forget it, free its slot, walk.
        The swap it waited on keeps going (as in fifo). A Cancelled for a request granted,
        answered or never seen is ignored."""
        self._now = ev.now
        req = ev.req
        if req in self._live:
            self._forget(req)
            self._release(req)
            self._dispatch()
            return
        for swap in self._active.values():
            if req in swap.waiters:
                swap.waiters.remove(req)
                swap.best = None
                self._release(req)
                self._dispatch()
                return

    def on_swap_done(self, ev: SwapDone) -> None:
        """Forget the swap. Failure answers each waiter SwapFailed (502, or 504 on timeout).
        Success puts the waiters back in the queue and walks it: they are granted in score
        order up to the model's `parallel`, unless a higher-scoring request needs the box
        first. If an unload of the model is pending, the walk keeps them queued and they get
        a fresh swap after UnloadDone (as in fifo). A stale SwapDone is ignored."""
        self._now = ev.now
        swap = self._active.pop(ev.model, None)
        if swap is None:
            return
        if ev.error is not None:
            for w in swap.waiters:
                self._fail(w, SwapFailed(ev.model, ev.error, ev.timed_out))
        else:
            self._exited.discard(ev.model)
            for w in swap.waiters:
                self._push(w)
        self._dispatch()

    def on_model_exited(self, ev: ModelExited) -> None:
        """As fifo: not loaded until a load of it succeeds; walk, so the requests queued for
        it (beyond `parallel`) start that load now, not when the cut requests are released."""
        self._now = ev.now
        self._exited.add(ev.model)
        self._dispatch()

    def on_serve_done(self, ev: ServeDone) -> None:
        """A granted request finished: free its in-flight count and slot, walk."""
        self._now = ev.now
        self._finish_serving(ev.req)
        self._dispatch()

    def on_unload(self, ev: UnloadRequested) -> None:
        """As fifo: mark the models unloading and have the shell stop them. Until UnloadDone
        nothing is granted to them, no swap loads or evicts them, and they lose affinity."""
        self._now = ev.now
        for m in ev.models:
            self._unloading[m] = self._unloading.get(m, 0) + 1
        self._fx.stop_processes(ev.models, ev.handle)
        self._dispatch()

    def on_unload_done(self, ev: UnloadDone) -> None:
        """The stop finished: lift the block and walk."""
        self._now = ev.now
        for m in ev.models:
            left = self._unloading.get(m, 0) - 1
            if left > 0:
                self._unloading[m] = left
            else:
                self._unloading.pop(m, None)
        self._dispatch()

    def on_restart(self, ev: RestartRequested) -> None:
        """As fifo: each running model restarts once idle; until then it gets nothing new."""
        self._now = ev.now
        self._request_restart(ev.models)
        self._dispatch()

    def on_settings_changed(self, ev: SettingsChanged) -> None:
        """Adopt the new config at once, keeping the queue: requests (queued, or waiting on a
        swap) for models it no longer defines get ModelNotFound; a running model that is gone
        stops, and one whose process definition changed restarts, once idle; a new aging
        divisor re-keys the heaps; the queue is re-ranked (new bonus, divisor) and walked."""
        self._now = ev.now
        self._invalidate_order()  # ranks change with the bonus and the divisor
        old_div = self._div
        self._note_config_change(self._config.models, ev.config.models)
        self._config = ev.config
        self._div = aging_divisor_of(ev.config)
        self._bonus = affinity_bonus_of(ev.config)
        models = ev.config.models
        for r in [r for r in self._live if r.model not in models]:
            self._forget(r)
            self._fail(r, ModelNotFound(r.model))
        for swap in self._active.values():
            if swap.target not in models:
                waiters, swap.waiters, swap.best = swap.waiters, [], None
                for w in waiters:
                    self._fail(w, ModelNotFound(w.model))
        if self._div != old_div:
            for m in list(self._heaps):
                self._rebuild(m)
            for swap in self._active.values():
                swap.best = None
        self._dispatch()

    def on_tick(self, ev: Tick) -> None:
        """Record `now` and walk. Aging alone never reorders waiting requests (every score
        grows by the same amount), so this only picks up shell state changes that came
        without an event."""
        self._now = ev.now
        self._dispatch()

    def on_shutdown(self, ev: Shutdown) -> None:
        """Answer ShuttingDown to everyone queued or waiting, and to every later request.
        Requests in flight are the shell's to finish; their ServeDone is still accepted."""
        self._now = ev.now
        self._shut_down = True
        queued = self.queued()
        self._heaps, self._pheaps, self._live, self._count = {}, {}, {}, {}
        self._positions.clear()
        self._invalidate_order()
        for r in queued:
            self._fail(r, ShuttingDown())
        for swap in self._active.values():
            waiters, swap.waiters, swap.best = swap.waiters, [], None
            for w in waiters:
                self._fail(w, ShuttingDown())

    # ---- policy switch (scheduling/core/handover.py) --------------------------------------

    def export_state(self) -> SchedulerState:
        """Move every book into a SchedulerState and leave this scheduler empty and shut down
        (a late request gets ShuttingDown; a late ServeDone raises)."""
        state = self._export_books(self.queued())
        self._heaps, self._pheaps, self._live, self._count = {}, {}, {}, {}
        self._invalidate_order()
        return state

    @classmethod
    def from_state(cls, state: SchedulerState, config: SchedulerConfig, fx: Effects
                   ) -> Serial:
        """A Serial holding `state`'s requests, swaps, in-flight counts, slots and unloads,
        with `on_settings_changed` applied for `config` (404 for undefined models, re-rank,
        walk). In-flight counts above a model's `parallel` (fifo ignores it) are kept: no new
        grant goes to that model until it is below."""
        s = cls(config, fx)
        s._restore_books(state, _Swap)
        for r in state.queued:
            s._push(r)
        s.on_settings_changed(SettingsChanged(config, state.now))
        return s

    # ---- decisions ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._forget_stopped()
        if not self._shut_down and self._heaps:
            self._walk()
        self._maintain()
        self._report_positions()

    def _walk(self) -> None:
        """Serve the queue in score order, as far as nothing higher is delayed.

        Repeatedly take the best among (1) the heads of the models not yet blocked in this
        walk (a model's head is its best request, so a blocked head blocks its whole model)
        and (2) the best waiter of each active swap not yet passed in this walk:

          - a swap's waiters → they wait for its SwapDone; they claim (target, whatever
            loaded beside it that the target would have to evict);
          - a head whose model has an active swap (not unloading) → all of the model's
            queued requests join that swap;
          - its model is being unloaded → blocked; it claims (model, eviction_for(model));
          - its model is READY, evicts nothing and is not being evicted → granted if the
            model has a free slot (in flight < parallel) and no higher claim names the
            model; else blocked, claiming (model, nothing);
          - otherwise it needs a swap evicting `evict`: started if it does not collide with
            an active swap, evicts no busy or unloading model, and conflicts with no higher
            claim; else blocked, claiming (model, `evict`).

        A claim (h, E) of a higher request means "h must be served, after stopping E": a
        lower request must not be granted to a model in E (that would keep E busy for
        longer), and must not start a swap that stops h, overlaps E, or loads a model that h
        would then have to evict. That is what "it cannot delay it" means here.
        """
        affine = self._affine()
        blocked: set[str] = set()  # models whose head was blocked in this walk
        passed: set[str] = set()  # active swaps whose waiters were ranked in this walk
        no_feed: set[str] = set()
        claims: list[tuple[str, list[str]]] = []
        swapper = self._config.swapper
        while True:
            best: tuple[float, int] | None = None
            m = ""
            req: Request | None = None
            for model in self._heaps:
                if model in blocked:
                    continue
                key, seq, _, r = self._head(model)
                rank = (key - (self._bonus if model in affine else 0) * self._div, seq)
                if best is None or rank < best:
                    best, m, req = rank, model, r
            waiters_first = False
            for target, swap in self._active.items():
                if target in passed or not swap.waiters:
                    continue
                key, seq = self._swap_best(swap)
                rank = (key - (self._bonus if target in affine else 0) * self._div, seq)
                if best is None or rank < best:
                    best, m, waiters_first = rank, target, True
            if best is None:
                return
            running = sorted(set(self._fx.running_models()) | self._active.keys())
            if waiters_first:
                passed.add(m)
                swap = self._active[m]
                if m in self._config.models:
                    later = [x for x in swapper.eviction_for(m, running) if x not in swap.evict]
                    claims.append((m, later))
                    no_feed.update(later)
                continue
            assert req is not None
            swap = self._active.get(m)
            if swap is not None and not self._held(m):
                swap.waiters.extend(self._take_all(m))
                swap.best = None
                continue
            evict = swapper.eviction_for(m, running)
            if self._held(m):
                blocked.add(m)
                claims.append((m, evict))
                no_feed.update(evict)
                continue
            if (not evict and not self._being_evicted(m) and m not in self._exited
                    and self._fx.model_state(m) == READY):
                if m in no_feed or self.in_flight(m) >= self._parallel(m):
                    blocked.add(m)
                    claims.append((m, []))
                    continue
                self._count_pick(req, blocked, affine)
                self._pop_head(m)
                self._grant(req, m, affine)
                continue
            if (self._collides(m, evict) or self._busy(evict)
                    or self._conflicts(m, evict, claims, running)):
                blocked.add(m)
                claims.append((m, evict))
                no_feed.update(evict)
                continue
            self._count_pick(req, blocked, affine)
            self._active[m] = _Swap(m, list(evict), self._take_all(m))
            affine.add(m)
            affine.difference_update(evict)
            logger.info("swap to %r: evicting %s (first waiter seq=%d)", m,
                        ", ".join(repr(x) for x in evict) or "nothing", req.seq)
            self._fx.start_swap(m, list(evict))

    def _start_restart(self, model: str) -> None:
        waiters = self._take_all(model) if model in self._heaps else []
        self._active[model] = _Swap(model, [model], waiters)
        logger.info("restarting %r (its definition changed or a restart was asked)", model)
        self._fx.start_swap(model, [model])

    def _swap_best(self, swap: _Swap) -> tuple[float, int]:
        """The best (key, seq) among a swap's waiters (cached until they change)."""
        if swap.best is None:
            swap.best = min((self._key(w), w.seq) for w in swap.waiters)
        return swap.best

    def _conflicts(self, target: str, evict: list[str], claims: list[tuple[str, list[str]]],
                   running: list[str]) -> bool:
        """Whether a swap to `target` stopping `evict` would delay a higher blocked request
        with claim (h, E): it stops h, overlaps E, or loads a model h must then evict."""
        stops = set(evict)
        for h, eh in claims:
            if h == target:
                continue
            if h in stops or not stops.isdisjoint(eh):
                return True
            if (h in self._config.models
                    and target in self._config.swapper.eviction_for(h, [*running, target])):
                return True
        return False

    def _parallel(self, model: str) -> int:
        mc = self._config.models.get(model)
        return mc.parallel if mc is not None and mc.parallel > 0 else 1

    def _affine(self) -> set[str]:
        """The models whose requests get the affinity bonus: READY and neither being evicted
        nor held (unloading, or waiting to stop or restart when idle), or the target of an
        active swap that is not held."""
        if self._bonus == 0:
            return set()
        out = {t for t in self._active if not self._held(t)}
        evicting = {m for swap in self._active.values() for m in swap.evict}
        for m in self._fx.running_models():
            if (m not in out and not self._held(m) and m not in evicting
                    and m not in self._exited and self._fx.model_state(m) == READY):
                out.add(m)
        return out

    def _count_pick(self, winner: Request, blocked: set[str], affine: set[str]) -> None:
        """Count whether aging or affinity decided this pick. The candidates are the queued
        requests of the models not blocked in this walk (the winner among them)."""
        candidates = sum(c for m, c in self._count.items() if m not in blocked)
        if candidates <= 1:
            return
        no_aging: tuple[float, int] | None = None
        no_aging_winner = None
        no_aff: tuple[float, int] | None = None
        no_aff_winner = None
        for m in self._heaps:
            if m in blocked:
                continue
            aff = self._bonus if m in affine else 0
            key, seq, _, r = self._head(m)
            if no_aff is None or (key, seq) < no_aff:
                no_aff, no_aff_winner = (key, seq), r
            negp, pseq, _, pr = self._phead(m)
            rank = (negp - aff, pseq)
            if no_aging is None or rank < no_aging:
                no_aging, no_aging_winner = rank, pr
        if no_aging_winner is not winner:
            self._stats.pick_changed_by_aging += 1
        if no_aff_winner is not winner:
            self._stats.pick_changed_by_affinity += 1

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

    def _is_live(self, entry: _Entry) -> bool:
        return self._live.get(entry[3]) == entry[2]

    def _head(self, m: str) -> _Entry:
        heap = self._heaps[m]
        while not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0]

    def _phead(self, m: str) -> _Entry:
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

    # ---- bookkeeping ----------------------------------------------------------------------

    def _grant(self, req: Request, model: str, affine: set[str]) -> None:
        """Hand `req` to `model`, its Dispatch record written first. Only a grant the client
        received counts in flight (a refused one would strand the count)."""
        aff = self._bonus if model in affine else 0
        aging = (self._now - req.arrived) / self._div
        req.dispatch = Dispatch(band=band(req.priority), score=req.priority + aff + aging,
                                priority=req.priority, affinity=float(aff), aging=aging,
                                seq=req.seq, queue_wait=self._now - req.arrived)
        self._deliver(req, model)

    def _report_positions(self) -> None:
        """Tell each queued request its 1-based position in score order when it is new or
        has changed. Pushes and removals keep the cached order by bisection, so only the
        positions from the first changed index on are looked at; it is re-ranked only when
        the set of loaded models or the settings changed."""
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
