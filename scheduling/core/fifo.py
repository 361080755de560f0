"""llama-swap's FIFO scheduler (`internal/router/scheduler/fifo.go`), as a pure state machine.

Requests for a model that is ready are served at once; everything else waits for a swap, and
requests for the same model share one swap ("A B C A B C" is served "A A B B C C"). Nothing
here blocks or reads a clock: each `on_*` handler updates the books, then calls `Effects` verbs;
slow work (a swap, a stop) comes back later as an event. `docs/scheduler-design.md` walks
through it.

`ModelConfig.parallel` is ignored on purpose: like llama-swap, fifo forwards every granted
request and lets the upstream queue them in its own slots. The serial scheduler uses it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable

from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import READY, Effects
from scheduling.core.errors import ModelNotFound
from scheduling.core.events import (
    Dispatch,
    Request,
    RequestArrived,
    SettingsChanged,
)
from scheduling.core.handover import Swap
from scheduling.core.ledger import Ledger
from scheduling.core.priority import band

logger = logging.getLogger("scheduling.fifo")


class Fifo(Ledger):
    """The `Scheduler` protocol with llama-swap's FIFO semantics, plus per-request priority.

    The handlers fifo shares with serial (cancel, swap done, model exited, serve done,
    unload, unload done, restart, shutdown) and the handover are `Ledger`'s; fifo has its
    own `on_request` and `on_settings_changed`, and the hooks below them.

    Books, written only by the `on_*` handlers (all on the run loop's task, so no locks):
      - `_queue`: requests waiting for a chance, always sorted by `_rank` (effective priority
        descending, then arrival);
      - `_active`: target → the swap loading it, with its evict set and waiters;
      - `_in_flight` / `_serving`: granted requests a ServeDone has not yet closed;
      - `_holders` / `_reserved`: admission slots, one per request from admission until it
        is served-done, cancelled or errored;
      - `_unloading`: models with an explicit unload not yet reported by UnloadDone;
      - `_exited`: models whose process exited (ModelExited) since their last successful
        load: not loaded, whatever `model_state` still says.
    """

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        super().__init__(config, fx)
        self._queue: list[Request] = []

    # ---- read-only introspection (metrics, tests) -----------------------------------------

    def queued(self) -> list[Request]:
        """The queued requests, in the order they will be considered."""
        return list(self._queue)

    def active_swaps(self) -> dict[str, list[Request]]:
        """Each swap in progress: target → the requests waiting for it."""
        return {target: list(swap.waiters) for target, swap in self._active.items()}

    def pick(self, now: float) -> Request | None:
        """The request the next drain considers first (the queue head), or None. No side
        effects; `now` is unused (fifo has no aging) and kept for parity with Serial.pick."""
        return self._queue[0] if self._queue else None

    # ---- events ---------------------------------------------------------------------------

    def on_request(self, ev: RequestArrived) -> None:
        """Admit and place one arriving request. In order, the first that applies:

        1. the model is not defined → ModelNotFound (404); nothing is reserved;
        2. admission: after shutdown → ShuttingDown (503); the model already holds
           `concurrency_limit` slots (queued + waiting + serving) → ConcurrencyLimit (429,
           Retry-After: 1); otherwise reserve a slot;
        3. a swap to the same model is active (and no unload of it is pending) → join it as a
           waiter: one swap serves everyone who asked for that model (collation);
        4. evict = swapper.eviction_for(model, running models + active swap targets);
        5. fast path: the model is READY, evict is empty, no active swap is evicting it and no
           unload of it is pending → grant now, ahead of anything queued (llama-swap parity);
        6. it collides with an active swap (it would evict that swap's target, that swap
           evicts it, or their evict sets overlap) → queue;
        7. it would evict a model with requests in flight or with an unload pending, or its own
           model is being unloaded → queue: a model is never stopped mid-request;
        8. otherwise → record the swap, then start it. Swaps with disjoint evict sets run in
           parallel.

        Steps 3-8 are `_place`, which every drain re-applies to the queue in order. A
        selector request takes them as a request for the target its strategy picks at that
        moment, and waits unbound otherwise; unbound, it ranks by its own priority alone (no
        model's fifo priority: it has no model yet, and a rank must not change while queued).
        """
        self._now = ev.now
        req = ev.req
        # (1)-(2): Ledger._admit
        if not self._admit(req):
            return
        # (3)-(8)
        if not self._place(req):
            bisect.insort(self._queue, req, key=self._rank)
            self._report_positions()

    def on_settings_changed(self, ev: SettingsChanged) -> None:
        """Adopt the new config: requests for models it no longer defines get ModelNotFound,
        the queue is re-sorted by the new priorities, then drained. A running model that is
        gone stops, and one whose process definition changed restarts, once idle.

        A swap to a removed model keeps its record until its SwapDone (the shell is still
        loading it); requests in flight on a removed model keep their slot until ServeDone.
        """
        self._now = ev.now
        self._note_config_change(self._config.models, ev.config.models)
        self._config = ev.config
        models = ev.config.models
        for req in [r for r in self._queue if not self._defined(r.model)]:
            self._queue.remove(req)
            self._fail(req, ModelNotFound(req.model))
        for swap in self._active.values():
            if swap.target not in models:
                self._fail_waiters(swap, lambda w: ModelNotFound(w.model))
        self._queue.sort(key=self._rank)
        self._report_positions()
        self._drain()

    # ---- decisions ------------------------------------------------------------------------

    def _place(self, req: Request) -> bool:
        """Steps 3-8 of `on_request` for an admitted request; False means "queue it".

        A selector request not yet bound is placed as a request for the target its strategy
        picks now (scheduling/core/selectors.py), a peer's model granted at once; if that
        cannot go, it goes back to the queue unbound, to be decided again at the next drain.
        """
        if self._unbound(req) is None:
            return self._place_model(req)
        target, turned = self._pick(req.model)
        if target is None:  # every target is being stopped
            return False
        selector_id = req.model
        self._bind(req, target)
        if target in self._config.peer_models:
            self._grant(req, target)
        elif not self._place_model(req):
            self._unbind(req)
            return False
        if turned:
            self._turns[selector_id] = self._turns.get(selector_id, 0) + 1
        return True

    def _place_model(self, req: Request) -> bool:
        model = req.model
        unloading = self._held(model)
        # (3)
        swap = self._active.get(model)
        if swap is not None and not unloading:
            swap.waiters.append(req)
            return True
        # (4)
        running = sorted(set(self._fx.running_models()) | self._active.keys())
        evict = self._config.swapper.eviction_for(model, running)
        # (5)
        if (not evict and not unloading and not self._being_evicted(model)
                and model not in self._exited and self._fx.model_state(model) == READY):
            self._grant(req, model)
            return True
        # (6)
        if self._collides(model, evict):
            return False
        # (7)
        if unloading or self._busy(evict):
            return False
        # (8)
        self._active[model] = Swap(model, list(evict), [req])
        logger.info("swap to %r: evicting %s (first waiter seq=%d; %s)", model,
                    ", ".join(repr(m) for m in evict) or "nothing", req.seq,
                    self._config.swapper.explain(model, running))
        self._fx.start_swap(model, list(evict))
        return True

    def _drain(self) -> None:
        """Re-apply steps 3-8 to every queued request, in queue order.

        Those that can now join, fast-path or start do so (several swaps may start in one
        drain); the rest stay where they were, since the queue is sorted by a fixed key.
        """
        self._forget_stopped()
        for req in list(self._queue):
            self._queue.remove(req)
            if not self._place(req):
                bisect.insort(self._queue, req, key=self._rank)
        self._maintain()
        self._report_positions()

    def _dequeue(self, req: Request) -> bool:
        if req not in self._queue:
            return False
        self._queue.remove(req)
        self._report_positions()
        return True

    def _take_queue(self) -> list[Request]:
        queued, self._queue = self._queue, []
        return queued

    def _restore_queue(self, queued: Iterable[Request]) -> None:
        self._queue = list(queued)  # sorted by the on_settings_changed that follows

    def _swap_succeeded(self, swap: Swap) -> None:
        """Grant every waiter, unless an unload or a stop-when-idle of the model is pending
        (the swap won the race against the stop): then they go back to the queue and get a
        fresh swap once it is done."""
        if self._held(swap.target):
            for w in swap.waiters:
                bisect.insort(self._queue, w, key=self._rank)
            self._report_positions()
        else:
            for w in swap.waiters:
                self._grant(w, swap.target)

    def _start_restart(self, model: str) -> None:
        waiters = [r for r in self._queue if r.model == model]
        self._queue = [r for r in self._queue if r.model != model]
        self._active[model] = Swap(model, [model], waiters)
        logger.info("restarting %r (its definition changed or a restart was asked)", model)
        self._fx.start_swap(model, [model])
        self._report_positions()

    # ---- bookkeeping ----------------------------------------------------------------------

    def _rank(self, req: Request) -> tuple[int, int]:
        """Queue order: effective priority (model fifo priority + request's own), higher
        first; ties by arrival."""
        mc = self._config.models.get(req.model)
        return (-((mc.fifo_priority if mc else 0) + req.priority), req.seq)

    def _grant(self, req: Request, model: str) -> None:
        """Hand `req` to `model`, its Dispatch record written first. Only a grant the client
        received counts in flight: counting a refused one would strand the count and block
        every later eviction of `model`."""
        mc = self._config.models.get(model)
        effective = (mc.fifo_priority if mc else 0) + req.priority
        wait = self._now - req.arrived
        req.dispatch = Dispatch(band=band(req.priority), score=effective, priority=effective,
                                affinity=0.0, aging=0.0, seq=req.seq, queue_wait=wait)
        self._deliver(req, model)

    def _report_positions(self) -> None:
        """Tell each queued request its 1-based position, when it is new or has changed."""
        if not self._config.report_positions:
            return
        queued = set(self._queue)
        for r in [r for r in self._positions if r not in queued]:
            del self._positions[r]
        for pos, req in enumerate(self._queue, start=1):
            if self._positions.get(req) != pos:
                self._positions[req] = pos
                self._fx.position_changed(req, pos)
