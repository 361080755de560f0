"""The serial scheduler: one dispatch order for the whole box, by score. Pure state machine.

    score = priority + swap affinity + aging
      priority  the request's own X-LlamaSwap-Priority (scheduling/core/priority.py)
      affinity  swap_affinity_bonus (clamped to 0..99) when the request's model is loaded:
                READY (and neither being evicted nor unloading), or the target of a swap in
                progress; else 0
      aging     (now - arrived) / aging_divisor, unbounded
      ties      earlier arrival (smaller seq) first

At every decision (arrival, serve done, swap done, model exited, cancel, unload, unload
done, restart, settings change) the waiting requests are walked in score order and the
highest-scoring one is served first. A lower-scoring request is dispatched before a higher
one only where that cannot delay it; the llama-swap safety rules of fifo.py all hold
(admission, join, never evicting a busy or unloading model, record-then-start, counting only
received grants). `docs/scheduler-design.md` §7 walks through it.

Unlike fifo, serial grants at most `ModelConfig.parallel` requests at once per model and keeps
the rest here, so the order is decided by the score and not by the upstream's own queue.

A selector's requests wait in a heap of their own, unbound, ranked with the affinity of the
target their strategy would pick now, and are bound to that target when the walk dispatches
them, or queues them at it when it is loaded and only short of a free slot
(scheduling/core/selectors.py; docs/scheduler-design.md, "Selectors").

The queue itself (per-model heaps, the cached order, position reports) is
`scheduling/core/score_queue.py`; the handlers serial shares with fifo are `Ledger`'s.

With an affinity budget (off by default), a request that has lost picks only because of the
affinity term for the budget has affinity ignored for it until it is served: its model ranks
as if loaded (`scheduling/core/budget.py`: the rule, its definitions and its bound).
"""

from __future__ import annotations

import logging

from scheduling.core.budget import AffinityBudget
from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import READY, Effects
from scheduling.core.errors import ModelNotFound
from scheduling.core.events import (
    Dispatch,
    Request,
    RequestArrived,
    SettingsChanged,
    UnloadRequested,
)
from scheduling.core.handover import Swap
from scheduling.core.priority import band
from scheduling.core.score_queue import ScoreQueue, affinity_bonus_of, aging_divisor_of

logger = logging.getLogger("scheduling.serial")


class Serial(ScoreQueue):
    """The `Scheduler` protocol with score order (see the module docstring).

    The handlers serial shares with fifo (cancel, swap done, model exited, serve done,
    unload done, restart, shutdown) and the handover are `Ledger`'s; serial has its own
    `on_request` and `on_settings_changed`, and walks after `Ledger.on_unload`.

    Books, written only by the `on_*` handlers (all on the run loop's task, so no locks):
      - the queue: `ScoreQueue`'s heaps (`_heaps`, `_pheaps`, `_live`, `_count`) and its
        cached order for position reports;
      - `_active`: target → the swap loading it, with its evict set and waiters;
      - `_in_flight` / `_serving`: granted requests a ServeDone has not yet closed;
      - `_holders` / `_reserved`: admission slots, as in fifo;
      - `_unloading`: models with an explicit unload not yet reported by UnloadDone;
      - `_exited`: models whose process exited (ModelExited) since their last successful
        load: not loaded, whatever `model_state` still says.
    """

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        super().__init__(config, fx)
        self._budget = AffinityBudget(config)

    # ---- read-only introspection (metrics, tests, bench) ----------------------------------

    def budget_lifted(self) -> frozenset[str]:
        """The models (or selectors) ranked as loaded now because a request of theirs spent
        its affinity budget and still waits."""
        return frozenset(self._budget.lifted())

    def swap_costs(self) -> dict[str, float]:
        """The latest measured swap cost per model (seconds), as the budget's `auto` uses."""
        return self._budget.swap_costs()

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
        self._drain()

    def on_unload(self, ev: UnloadRequested) -> None:
        """`Ledger.on_unload`, then walk: until UnloadDone the models lose affinity, which
        may reorder the queue."""
        super().on_unload(ev)
        self._drain()

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
        self._budget.configure(ev.config)
        models = ev.config.models
        for r in [r for r in self._live if not self._defined(r.model)]:
            self._forget(r)
            self._fail(r, ModelNotFound(r.model))
        for swap in self._active.values():
            if swap.target not in models:
                self._fail_waiters(swap, lambda w: ModelNotFound(w.model))
        if self._div != old_div:
            for m in list(self._heaps):
                self._rebuild(m)
            for swap in self._active.values():
                swap.best = None
        self._drain()

    # ---- decisions ------------------------------------------------------------------------

    def _drain(self) -> None:
        self._forget_stopped()
        if not self._shut_down and self._heaps:
            while self._walk():  # True: a budget ran out, walk again without affinity
                pass
        self._maintain()
        self._report_positions()

    def _walk(self) -> bool:
        """Serve the queue in score order, as far as nothing higher is delayed. Returns True,
        having done nothing at that pick, when a pick used up a request's affinity budget: the
        caller walks again with affinity off.

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
        blocked_on: dict[str, str | None] = {}  # blocked selector -> the pick it was blocked on
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
                return False
            running = sorted(set(self._fx.running_models()) | self._active.keys())
            if waiters_first:
                passed.add(m)
                loading = self._active[m]
                if m in self._config.models:
                    later = [x for x in swapper.eviction_for(m, running)
                             if x not in loading.evict]
                    claims.append((m, later))
                    no_feed.update(later)
                continue
            assert req is not None
            # `m` is the queue the head came from, `t` the model it needs: the same, but for
            # a selector's head, handled as a head of the target its strategy picks now and
            # bound to it only when it goes (else it stays unbound, for the next walk).
            t, turned = self._pick(m) if self._unbound(req) is not None else (m, False)
            if t != m:
                blocked_on[m] = t  # (unless it goes: then `_after_move` forgets it)
            if t is None:  # every target is being stopped
                blocked.add(m)
                continue
            if t in self._config.peer_models:  # a peer: granted at once, never swapped
                if self._count_pick(req, blocked, affine):
                    return True
                self._take_head(m, req, t, turned)
                self._grant(req, t, affine)
                self._after_move(affine, blocked, blocked_on)
                continue
            loading_m = self._active.get(t)
            if loading_m is not None and not self._held(t):
                if t == m:
                    loading_m.waiters.extend(self._take_all(m))
                else:
                    loading_m.waiters.append(self._take_head(m, req, t, turned))
                    self._after_move(affine, blocked, blocked_on)
                loading_m.best = None
                continue
            evict = swapper.eviction_for(t, running)
            if self._held(t):
                blocked.update((m, t))
                claims.append((t, evict))
                no_feed.update(evict)
                continue
            if (not evict and not self._being_evicted(t) and t not in self._exited
                    and self._fx.model_state(t) == READY):
                if t in no_feed or self.in_flight(t) >= self._parallel(t):
                    if t != m and t not in no_feed:
                        # loaded, only short of a free slot: it queues there, bound, so
                        # spillover counts it (llama-swap's requests waiting at a target)
                        self._push(self._take_head(m, req, t, turned))
                        self._after_move(affine, blocked, blocked_on)
                    else:
                        blocked.add(m)
                    blocked.add(t)
                    claims.append((t, []))
                    continue
                if self._count_pick(req, blocked, affine):
                    return True
                self._take_head(m, req, t, turned)
                self._grant(req, t, affine)
                self._after_move(affine, blocked, blocked_on)
                continue
            if (self._collides(t, evict) or self._busy(evict)
                    or self._conflicts(t, evict, claims, running)):
                blocked.update((m, t))
                claims.append((t, evict))
                no_feed.update(evict)
                continue
            if self._count_pick(req, blocked, affine):
                return True
            if t == m:
                waiters = self._take_all(m)
            else:
                waiters = [self._take_head(m, req, t, turned)]
                waiters.extend(self._take_all(t) if t in self._heaps else [])
            self._active[t] = Swap(t, list(evict), waiters)
            self._budget.swap_started(t, self._now)
            affine.add(t)
            affine.difference_update(evict)
            self._after_move(affine, blocked, blocked_on)
            logger.info("swap to %r: evicting %s (first waiter seq=%d; %s)", t,
                        ", ".join(repr(x) for x in evict) or "nothing", req.seq,
                        swapper.explain(t, running))
            self._fx.start_swap(t, list(evict))

    def _swap_succeeded(self, swap: Swap) -> None:
        """The waiters go back into the model's heap; the walk that follows grants them in
        score order up to `parallel`, unless a higher-scoring request needs the box first,
        and keeps them queued while an unload of the model is pending (they get a fresh swap
        after UnloadDone, as in fifo). The swap's cost is measured for the budget's `auto`."""
        self._budget.swap_done(swap.target, self._now)
        for w in swap.waiters:
            self._push(w)

    def _start_restart(self, model: str) -> None:
        waiters = self._take_all(model) if model in self._heaps else []
        self._active[model] = Swap(model, [model], waiters)
        self._budget.swap_started(model, self._now)
        logger.info("restarting %r (its definition changed or a restart was asked)", model)
        self._fx.start_swap(model, [model])

    def _after_move(self, affine: set[str], blocked: set[str],
                    blocked_on: dict[str, str | None]) -> None:
        """After a grant, a bind or a swap start in a walk, selectors follow their pick now:
        their affinity, and a selector blocked on a target it no longer picks is unblocked,
        since its new pick may go in this walk (else a lower request could take it first)."""
        if not self._config.selectors:
            return
        self._affine_selectors(affine)
        if self._budget.overriding:  # (a lifted selector keeps its lift)
            affine |= self._budget.lifted()
        for selector_id, was in list(blocked_on.items()):
            if selector_id not in self._heaps or self._pick(selector_id)[0] != was:
                blocked.discard(selector_id)
                del blocked_on[selector_id]

    def _take_head(self, m: str, req: Request, target: str, turned: bool) -> Request:
        """Take `req`, the head of queue `m`, out of the queue, bound to `target` when `m`
        is its selector."""
        self._pop_head(m)
        if target != m:
            self._bind(req, target, turned)
        return req

    def _swap_best(self, swap: Swap) -> tuple[float, int]:
        """The best (key, seq) among a swap's waiters (cached until they change)."""
        if swap.best is None:
            swap.best = min((self._key(w), w.seq) for w in swap.waiters)
        return swap.best

    def _conflicts(self, target: str, evict: list[str], claims: list[tuple[str, list[str]]],
                   running: list[str]) -> bool:
        """Whether a swap to `target` stopping `evict` would delay a higher blocked request
        with claim (h, E): it stops h, overlaps E, loads a model h must then evict, or
        (under a matrix) makes h's own load stop more than E."""
        stops = set(evict)
        for h, eh in claims:
            if h == target:
                continue
            if h in stops or not stops.isdisjoint(eh):
                return True
            if h in self._config.models:
                # h's eviction once this swap is done: under groups at most E plus the
                # target; under a matrix the target may also change which set h keeps.
                after = self._config.swapper.eviction_for(
                    h, [*(m for m in running if m not in stops), target])
                if target in after or not set(after) <= set(eh):
                    return True
        return False

    def _parallel(self, model: str) -> int:
        mc = self._config.models.get(model)
        return mc.parallel if mc is not None and mc.parallel > 0 else 1

    def _affine(self) -> set[str]:
        """The models whose requests get the affinity bonus: READY and neither being evicted
        nor held (unloading, or waiting to stop or restart when idle), or the target of an
        active swap that is not held; and those the affinity budget lifts."""
        if self._bonus == 0:
            return set()
        out = {t for t in self._active if not self._held(t)}
        evicting = {m for swap in self._active.values() for m in swap.evict}
        for m in self._fx.running_models():
            if (m not in out and not self._held(m) and m not in evicting
                    and m not in self._exited and self._fx.model_state(m) == READY):
                out.add(m)
        if self._config.selectors:
            self._affine_selectors(out)
        if self._budget.overriding:
            out |= self._budget.lifted()
        return out

    def _count_pick(self, winner: Request, blocked: set[str], affine: set[str]) -> bool:
        """Count whether aging or affinity decided this pick. The candidates are the queued
        requests of the models not blocked in this walk (the winner among them). With a
        budget, the winner without affinity lost this pick only because of it: True when
        that used up its budget (affinity goes off; the pick is not made, nor counted)."""
        candidates = sum(c for m, c in self._count.items() if m not in blocked)
        if candidates <= 1:
            return False
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
        # (a lifted request cannot lose a pick to affinity again, so each walk that ends
        # here has lifted one more request: the walks that follow end)
        if (no_aff_winner is not winner and no_aff_winner is not None and self._budget.on
                and self._budget.lost(no_aff_winner, self._now, self._runs_on(no_aff_winner))):
            self._stats.affinity_budget_overrides += 1
            self._invalidate_order()
            return True
        if no_aging_winner is not winner:
            self._stats.pick_changed_by_aging += 1
        if no_aff_winner is not winner:
            self._stats.pick_changed_by_affinity += 1
        return False

    def _runs_on(self, req: Request) -> str:
        """The model `req` would run on: a selector's request, its selector's pick now (the
        swap costs are measured per model, never per selector)."""
        if req.model in self._config.selectors:
            return self._pick(req.model)[0] or req.model
        return req.model

    def _release(self, req: Request) -> None:
        """`Ledger._release`; a request that leaves the queue ends its budget override."""
        super()._release(req)
        if self._budget.forget(req):
            self._invalidate_order()

    # ---- bookkeeping ----------------------------------------------------------------------

    def _grant(self, req: Request, model: str, affine: set[str]) -> None:
        """Hand `req` to `model`, its Dispatch record written first. Only a grant the client
        received counts in flight (a refused one would strand the count)."""
        aff = self._bonus if model in affine else 0
        aging = (self._now - req.arrived) / self._div
        req.dispatch = Dispatch(band=band(req.priority), score=req.priority + aff + aging,
                                priority=req.priority, affinity=float(aff), aging=aging,
                                seq=req.seq, queue_wait=self._now - req.arrived,
                                budget_override=(self._budget.overriding
                                                 and model in self._budget.lifted()))
        self._deliver(req, model)
        if self._budget.forget(req):  # served: its override ends
            self._invalidate_order()
