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

logger = logging.getLogger("scheduling.fifo")


@dataclass
class _Swap:
    """A swap started with `Effects.start_swap` and not yet reported by `SwapDone`."""

    target: str
    evict: list[str]
    waiters: list[Request] = field(default_factory=list)


class Fifo(Ledger):
    """The `Scheduler` protocol with llama-swap's FIFO semantics, plus per-request priority.

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
        self._init_books(config, fx)
        self._queue: list[Request] = []
        self._exited: set[str] = set()

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

    # ---- policy switch (scheduling/core/handover.py) --------------------------------------

    def export_state(self) -> SchedulerState:
        """Move every book into a SchedulerState and leave this scheduler empty and shut down
        (a late request gets ShuttingDown; a late ServeDone raises): hand it to
        `Serial.from_state` (or `Fifo.from_state`) and stop sending events here."""
        state = self._export_books(list(self._queue))
        self._queue = []
        return state

    @classmethod
    def from_state(cls, state: SchedulerState, config: SchedulerConfig, fx: Effects) -> Fifo:
        """A Fifo holding `state`'s requests, swaps, in-flight counts, slots and unloads, with
        `on_settings_changed` applied for `config`: requests for models it does not define get
        ModelNotFound, the queue is sorted by fifo's rank, then drained."""
        s = cls(config, fx)
        s._restore_books(state, _Swap)
        s._queue = list(state.queued)
        s.on_settings_changed(SettingsChanged(config, state.now))
        return s

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

        Steps 3-8 are `_place`, which every drain re-applies to the queue in order.
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

    def on_cancel(self, ev: Cancelled) -> None:
        """The client left while queued or waiting on a swap: forget it, free its slot.

        The swap it waited on keeps going even if it was the only waiter (parity): stopping
        half-loaded models is worse than finishing. A Cancelled for a request already granted
        (the shell then sends ServeDone), already answered or never seen is ignored.
        """
        self._now = ev.now
        req = ev.req
        if req in self._queue:
            self._queue.remove(req)
            self._release(req)
            self._report_positions()
            self._drain()
            return
        for swap in self._active.values():
            if req in swap.waiters:
                swap.waiters.remove(req)
                self._release(req)
                self._drain()
                return

    def on_swap_done(self, ev: SwapDone) -> None:
        """Answer the swap's waiters, forget the swap, drain.

        Success grants every waiter, unless an unload of the model is pending (the swap won
        the race against the stop): then they go back to the queue and get a fresh swap once
        the unload is done. Failure answers each waiter SwapFailed (502, or 504 when it timed
        out) — this is also how waiters learn that an unload aborted their swap.
        A SwapDone with no active swap (stale, or after shutdown) is ignored.
        """
        self._now = ev.now
        swap = self._active.pop(ev.model, None)
        if swap is None:
            return
        if ev.error is not None:
            for w in swap.waiters:
                self._fail(w, SwapFailed(ev.model, ev.error, ev.timed_out))
        elif self._held(ev.model):
            self._exited.discard(ev.model)
            for w in swap.waiters:
                bisect.insort(self._queue, w, key=self._rank)
            self._report_positions()
        else:
            self._exited.discard(ev.model)
            for w in swap.waiters:
                self._grant(w, ev.model)
        self._drain()

    def on_model_exited(self, ev: ModelExited) -> None:
        """The model's process exited: it is not loaded until a load of it succeeds, so the
        next request for it starts one (instead of a grant to a process that is gone); drain,
        so queued requests start it too. Requests in flight on it end on their own."""
        self._now = ev.now
        self._exited.add(ev.model)
        self._drain()

    def on_serve_done(self, ev: ServeDone) -> None:
        """A granted request finished: free its in-flight count and slot, drain.

        llama-swap drains only when the count reaches 0; draining every time costs one walk of
        the queue and also picks up state changes the shell reported no event for.
        """
        self._now = ev.now
        self._finish_serving(ev.req)
        self._drain()

    def on_unload(self, ev: UnloadRequested) -> None:
        """Mark the models unloading and have the shell stop them.

        Until UnloadDone, requests for them queue (no fast path, no join, no new swap) and no
        swap that would evict them starts, so nothing races the stop. A swap already loading
        one of them is left to the shell's stop to abort; its SwapDone(error) errors its
        waiters. Requests in flight are not waited for: an explicit unload is the operator's
        call (llama-swap parity); their ServeDone arrives as usual.
        """
        self._now = ev.now
        for m in ev.models:
            self._unloading[m] = self._unloading.get(m, 0) + 1
        self._fx.stop_processes(ev.models, ev.handle)

    def on_unload_done(self, ev: UnloadDone) -> None:
        """The stop finished: lift the block and drain (a queued request now starts fresh)."""
        self._now = ev.now
        for m in ev.models:
            left = self._unloading.get(m, 0) - 1
            if left > 0:
                self._unloading[m] = left
            else:
                self._unloading.pop(m, None)
        self._drain()

    def on_restart(self, ev: RestartRequested) -> None:
        """Restart each running model once it is idle (no request in flight); until then
        requests for it queue. The restart is a swap to the model that evicts itself."""
        self._now = ev.now
        self._request_restart(ev.models)
        self._drain()

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
        for req in [r for r in self._queue if r.model not in models]:
            self._queue.remove(req)
            self._fail(req, ModelNotFound(req.model))
        for swap in self._active.values():
            if swap.target not in models:
                waiters, swap.waiters = swap.waiters, []
                for w in waiters:
                    self._fail(w, ModelNotFound(w.model))
        self._queue.sort(key=self._rank)
        self._report_positions()
        self._drain()

    def on_tick(self, ev: Tick) -> None:
        """Nothing to do: fifo has no aging (serial walks its queue here)."""
        self._now = ev.now

    def on_shutdown(self, ev: Shutdown) -> None:
        """Answer ShuttingDown to everyone queued or waiting, and to every later request.

        Requests in flight are the shell's to finish; their ServeDone is still accepted.
        """
        self._now = ev.now
        self._shut_down = True
        queued, self._queue = self._queue, []
        self._positions.clear()
        for req in queued:
            self._fail(req, ShuttingDown())
        for swap in self._active.values():
            waiters, swap.waiters = swap.waiters, []
            for w in waiters:
                self._fail(w, ShuttingDown())

    # ---- decisions ------------------------------------------------------------------------

    def _place(self, req: Request) -> bool:
        """Steps 3-8 of `on_request` for an admitted request; False means "queue it"."""
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
        self._active[model] = _Swap(model, list(evict), [req])
        logger.info("swap to %r: evicting %s (first waiter seq=%d)", model,
                    ", ".join(repr(m) for m in evict) or "nothing", req.seq)
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

    def _start_restart(self, model: str) -> None:
        waiters = [r for r in self._queue if r.model == model]
        self._queue = [r for r in self._queue if r.model != model]
        self._active[model] = _Swap(model, [model], waiters)
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
        queued = set(self._queue)
        for r in [r for r in self._positions if r not in queued]:
            del self._positions[r]
        for pos, req in enumerate(self._queue, start=1):
            if self._positions.get(req) != pos:
                self._positions[req] = pos
                self._fx.position_changed(req, pos)
