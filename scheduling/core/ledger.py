"""What every policy does the same way: the books (admission reservations, requests in
flight, swaps, unloads, pending restarts), the grant itself, and the event handlers that do
not depend on the order a policy serves in. The policies (fifo.py, serial.py) differ in whom
they pick, never in how a pick is accounted, so that part lives here once. A policy
subclasses `Ledger` and supplies its queue through the hooks under "what each policy
supplies".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Self

from scheduling.core.config import DEFAULT_CONCURRENCY_LIMIT, ModelConfig, SchedulerConfig
from scheduling.core.effects import READY, STARTING, Effects
from scheduling.core.errors import (
    ConcurrencyLimit,
    ModelNotFound,
    QueueFull,
    SchedulingError,
    ShuttingDown,
    SwapFailed,
)
from scheduling.core.events import (
    Cancelled,
    ModelExited,
    Request,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.handover import SchedulerState, Swap
from scheduling.core.priority import band
from scheduling.core.selectors import SelectorBooks
from scheduling.core.stats import SchedulerStats, WaitGauges


class InvariantViolation(AssertionError):
    """The shell sent events that contradict the scheduler's books (a bug, not an outcome):
    a ServeDone for a request never granted, a slot released twice, a request arriving
    twice. Raised, not asserted, so `python -O` keeps the check."""


def limit_of(mc: ModelConfig, scheduler: str) -> int | None:
    """A model's admission cap (queued + waiting + serving), or None for no cap of its own.

    An explicit `concurrencyLimit` always applies. Unset (0) is llama-swap's 10 under fifo,
    whose semantics stay exactly llama-swap's (`fifo.go`: `defaultConcurrencyLimit` unless
    ConcurrencyLimit > 0). Under serial it is no cap: llama-swap's 10 exists because it
    forwards every admitted request to the upstream, while serial keeps all but `parallel`
    in its own queue, which `max_waiting` and the band caps bound.
    """
    if mc.concurrency_limit > 0:
        return mc.concurrency_limit
    return DEFAULT_CONCURRENCY_LIMIT if scheduler == "fifo" else None


class Ledger(SelectorBooks):
    """The base of every policy: the shared books (set up by `__init__`), the shared event
    handlers, and the hooks each policy implements for its own queue."""

    _config: SchedulerConfig
    _fx: Effects
    _now: float  # the `now` of the last event
    _shut_down: bool
    _active: dict[str, Swap]  # target -> the swap loading it
    _unloading: dict[str, int]  # model -> explicit unloads not yet reported done
    _positions: dict[Request, int]  # last position reported to each queued request
    _holders: set[Request]  # requests holding an admission slot
    _reserved: dict[str, int]  # model -> slots held (queued + waiting + in flight)
    _serving: dict[Request, str]  # granted request -> model, until its ServeDone
    _in_flight: dict[str, int]  # model -> granted requests not yet done
    _stats: SchedulerStats
    _waits: WaitGauges  # admitted and not yet granted, per band (queue caps and gauges)
    # Models to stop once idle, never cutting off work in flight: "restart" (its definition
    # changed, or an admin asked) restarts it with a swap evicting itself; "removed" (no
    # longer defined, or disabled) just stops it. Until then nothing new is granted to it.
    _pending_stop: dict[str, str]
    # Models whose process exited (ModelExited) since their last successful load: not
    # loaded, whatever `model_state` still says.
    _exited: set[str]

    def __init__(self, config: SchedulerConfig, fx: Effects) -> None:
        """The shared books, empty; each policy's constructor calls this first."""
        self._config = config
        self._fx = fx
        self._now = 0.0
        self._shut_down = False
        self._active = {}
        self._unloading = {}
        self._positions = {}
        self._holders = set()
        self._reserved = {}
        self._serving = {}
        self._in_flight = {}
        self._stats = SchedulerStats()
        self._pending_stop = {}
        self._waits = WaitGauges()
        self._exited = set()
        self._turns = {}

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @property
    def now(self) -> float:
        """The `now` of the last event handled (the core never reads a clock)."""
        return self._now

    def in_flight(self, model: str) -> int:
        """Granted requests for `model` whose ServeDone has not arrived."""
        return self._in_flight.get(model, 0)

    def reserved(self, model: str) -> int:
        """Admission slots held for `model`: queued + waiting on a swap + in flight."""
        return self._reserved.get(model, 0)

    def stats(self) -> SchedulerStats:
        """A copy of the counters (see SchedulerStats)."""
        return self._stats.copy()

    def restart_pending(self) -> frozenset[str]:
        """Models waiting to be restarted once idle (for the dashboard's "restart needed")."""
        return frozenset(m for m, why in self._pending_stop.items() if why == "restart")

    def waiting_by_band(self) -> dict[str, tuple[int, float | None]]:
        """Per band: (requests admitted and not yet granted, the oldest one's `arrived`, or
        None when the band is empty). Every band is present. O(bands), amortised: the run
        loop publishes this after every event for the metrics."""
        return self._waits.by_band()

    # ---- policy switch (scheduling/core/handover.py) --------------------------------------

    def export_state(self) -> SchedulerState:
        """Move every book into a SchedulerState and leave this scheduler empty and shut down
        (a late request gets ShuttingDown; a late ServeDone raises): hand it to the other
        policy's `from_state` and stop sending events here."""
        return self._export_books(self._take_queue())

    @classmethod
    def from_state(cls, state: SchedulerState, config: SchedulerConfig, fx: Effects) -> Self:
        """A scheduler of this policy holding `state`'s requests, swaps, in-flight counts,
        slots and unloads, with `on_settings_changed` applied for `config`: requests for
        models it does not define get ModelNotFound, the queue is ranked by this policy's
        order, then drained. In-flight counts above a model's `parallel` (fifo ignores it)
        are kept: serial grants that model nothing new until it is below."""
        s = cls(config, fx)
        s._restore_books(state)
        s._restore_queue(state.queued)
        s.on_settings_changed(SettingsChanged(config, state.now))
        return s

    # ---- the events every policy handles alike ---------------------------------------------

    def on_cancel(self, ev: Cancelled) -> None:
        """The client left while queued or waiting on a swap: forget it, free its slot, drain.
        The swap it waited on keeps going even if it was the only waiter (llama-swap parity).
        A Cancelled for a request granted (ServeDone follows), answered or unseen is ignored.
        """
        self._now = ev.now
        req = ev.req
        if self._dequeue(req):
            self._release(req)
            self._drain()
            return
        for swap in self._active.values():
            if req in swap.waiters:
                swap.waiters.remove(req)
                swap.best = None
                self._release(req)
                self._drain()
                return

    def on_swap_done(self, ev: SwapDone) -> None:
        """Forget the swap and drain. Failure answers each waiter SwapFailed (502, or 504
        when it timed out); this is also how waiters learn that an unload aborted their swap.
        Success clears the model's exit mark and leaves the waiters to the policy
        (`_swap_succeeded`). A SwapDone with no active swap (stale, or after shutdown) is
        ignored."""
        self._now = ev.now
        swap = self._active.pop(ev.model, None)
        if swap is None:
            return
        if ev.error is not None:
            error, timed_out = ev.error, ev.timed_out
            self._fail_waiters(swap, lambda w: SwapFailed(ev.model, error, timed_out))
        else:
            self._exited.discard(ev.model)
            self._swap_succeeded(swap)
        self._drain()

    def on_model_exited(self, ev: ModelExited) -> None:
        """The model's process exited: it is not loaded until a load of it succeeds, so the
        next request for it starts one (instead of a grant to a process that is gone); drain,
        so queued requests for it start that load now, not when the cut requests are
        released. Requests in flight on it end on their own."""
        self._now = ev.now
        self._exited.add(ev.model)
        self._drain()

    def on_serve_done(self, ev: ServeDone) -> None:
        """A granted request finished: free its in-flight count and slot, drain (llama-swap
        drains only at 0 in flight; every time also picks up unreported state changes)."""
        self._now = ev.now
        self._finish_serving(ev.req)
        self._drain()

    def on_unload(self, ev: UnloadRequested) -> None:
        """Mark the models unloading and have the shell stop them (and answer `ev.handle`).
        With `ev.everything` they are `ev.models` plus every model loaded or loading as this
        runs (`_loaded_now`), resolved here so no earlier read decides what is stopped.

        Until UnloadDone, requests for them queue (no fast path, no join, no new swap) and no
        swap that would evict them starts, so nothing races the stop. A swap already loading
        one of them is left to the shell's stop to abort; its SwapDone(error) errors its
        waiters. Requests in flight are not waited for: an explicit unload is the operator's
        call (llama-swap parity). fifo does not drain here; serial does (affinity changes).
        """
        self._now = ev.now
        models = self._loaded_now(ev.models) if ev.everything else ev.models
        for m in models:
            self._unloading[m] = self._unloading.get(m, 0) + 1
        self._fx.stop_processes(models, ev.handle)

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
        """Restart each running, defined model once it is idle (no request in flight); until
        then nothing new is granted to it. The restart is a swap to the model that evicts
        itself (`_start_restart`)."""
        self._now = ev.now
        self._request_restart(ev.models)
        self._drain()

    def on_shutdown(self, ev: Shutdown) -> None:
        """Answer ShuttingDown to everyone queued or waiting, and to every later request.
        Requests in flight are the shell's to finish; their ServeDone is still accepted."""
        self._now = ev.now
        self._shut_down = True
        queued = self._take_queue()
        self._positions.clear()
        for req in queued:
            self._fail(req, ShuttingDown())
        for swap in self._active.values():
            self._fail_waiters(swap, lambda w: ShuttingDown())

    # ---- what each policy supplies ---------------------------------------------------------

    def on_settings_changed(self, ev: SettingsChanged) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        """Re-decide after an event: grant, join or start what now can, carry out pending
        stops (`_maintain`), report positions. Every shared handler ends with it."""
        raise NotImplementedError

    def _dequeue(self, req: Request) -> bool:
        """Remove `req` from the queue (not from a swap's waiters); False if not queued."""
        raise NotImplementedError

    def _take_queue(self) -> list[Request]:
        """Empty the queue; return what it held, in the order it would be considered."""
        raise NotImplementedError

    def _restore_queue(self, queued: Iterable[Request]) -> None:
        """Put handed-over requests (slots already reserved) into the empty queue."""
        raise NotImplementedError

    def _swap_succeeded(self, swap: Swap) -> None:
        """The waiters of a swap that loaded its target: grant or queue them."""
        raise NotImplementedError

    def _start_restart(self, model: str) -> None:
        """A swap to `model` that evicts `model` itself: the shell stops it, then starts it
        again from the current definition. Requests for it wait for this swap like any other."""
        raise NotImplementedError

    # ---- shared decisions and bookkeeping ----------------------------------------------------

    def _loaded_now(self, models: Iterable[str] = ()) -> tuple[str, ...]:
        """`models` plus every model loaded or loading, sorted: the running processes
        (`running_models`: neither stopped nor failed) and the active swaps' targets."""
        return tuple(sorted({*models, *self._fx.running_models(), *self._active}))

    def _fail_waiters(self, swap: Swap, error: Callable[[Request], SchedulingError]) -> None:
        """Answer each of `swap`'s waiters `error(waiter)`, freeing its slot; the swap keeps
        running with none."""
        waiters, swap.waiters, swap.best = swap.waiters, [], None
        for w in waiters:
            self._fail(w, error(w))

    def _admit(self, req: Request) -> bool:
        """Admission, the same for every policy. In order: an unknown model →
        ModelNotFound (404), nothing reserved; after shutdown → ShuttingDown (503); the model
        already holds its cap (`limit_of`) of slots (queued + waiting + serving) →
        ConcurrencyLimit (429, Retry-After: 1); the queue, or the request's band of it, already
        holds its cap of waiting requests → QueueFull (429, Retry-After: 5); otherwise
        reserve a slot and return True."""
        if req in self._holders or req in self._serving:
            raise InvariantViolation(f"request seq={req.seq} arrived twice")
        if not self._defined(req.model):
            nodes = self._config.elsewhere.get(req.model)
            self._fx.grant_error(req, ModelNotFound(req.model, why=(
                f"it is placed on node(s) {', '.join(nodes)} of the fleet, not on this node; "
                "send it to one of those (or add this node to its `nodes` in the admin)")
                if nodes else ""))
            return False
        if self._shut_down:
            self._fx.grant_error(req, ShuttingDown())
            return False
        # A selector has no cap of its own: the target it would pick now applies its cap to
        # it and the selector's requests not yet bound, as llama-swap resolves it first.
        capped = req.model if req.model in self._config.models else self._pick(req.model)[0]
        mc = self._config.models.get(capped or "")
        limit = limit_of(mc, self._config.scheduler) if mc is not None else None
        unbound = self.reserved(req.model) if capped != req.model else 0
        if limit is not None and self.reserved(capped or "") + unbound >= limit:
            self._fx.grant_error(req, ConcurrencyLimit(capped or "", limit))
            return False
        cap = self._config.max_waiting
        if cap > 0 and self._waits.total() >= cap:
            self._fx.grant_error(req, QueueFull("the queue", cap))
            return False
        b = band(req.priority)
        cap = self._config.max_waiting_per_band.get(b, 0)
        if cap > 0 and self._waits.count[b] >= cap:
            self._fx.grant_error(req, QueueFull(f"the {b} band", cap))
            return False
        self._reserve(req)
        return True

    def _held(self, model: str) -> bool:
        """Nothing new may be granted to `model`, nor a swap load it: an explicit unload is
        under way, or a stop-when-idle is pending."""
        return model in self._unloading or model in self._pending_stop

    def _running(self, model: str) -> bool:
        return (model in self._active
                or self._fx.model_state(model) in (READY, STARTING))

    def _note_config_change(self, old: dict[str, ModelConfig],
                            new: dict[str, ModelConfig]) -> None:
        """A running model that the new config no longer defines is stopped when idle; one
        whose process definition (`revision`) changed is restarted when idle."""
        for m, mc in old.items():
            if not self._running(m):
                continue
            if m not in new:
                self._pending_stop[m] = "removed"
            elif new[m].revision != mc.revision:
                self._pending_stop.setdefault(m, "restart")

    def _request_restart(self, models: tuple[str, ...]) -> None:
        """An admin asked: restart each running, defined model once it is idle."""
        for m in models:
            if m in self._config.models and self._running(m):
                self._pending_stop.setdefault(m, "restart")

    def _forget_stopped(self) -> None:
        """Drop pending stops of models that stopped by themselves meanwhile (TTL, crash,
        eviction, unload): their next start uses the new definition anyway. Runs before
        every walk, so their requests are no longer held in it."""
        if self._shut_down:  # the shell stops everything on its way out
            self._pending_stop.clear()
        for m in [m for m in self._pending_stop if not self._running(m)]:
            del self._pending_stop[m]

    def _maintain(self) -> None:
        """Carry out pending stops whose model has gone idle. Runs after every walk: a model
        the walk chose to evict needs no restart, and an idle one is never held for long."""
        for m, why in list(self._pending_stop.items()):
            if (m in self._active or m in self._unloading or self._being_evicted(m)
                    or self._in_flight.get(m, 0) > 0):
                continue
            if why == "restart":
                if self._collides(m, [m]):
                    continue
                del self._pending_stop[m]
                self._start_restart(m)
            else:
                del self._pending_stop[m]
                self._unloading[m] = self._unloading.get(m, 0) + 1
                self._fx.stop_processes([m], None)

    def _being_evicted(self, model: str) -> bool:
        return any(model in swap.evict for swap in self._active.values())

    def _collides(self, model: str, evict: list[str]) -> bool:
        """Whether a swap to `model` evicting `evict` cannot run beside the active swaps."""
        for target, swap in self._active.items():
            if target == model:
                continue
            if target in evict or model in swap.evict or not set(evict).isdisjoint(swap.evict):
                return True
        return False

    def _busy(self, evict: list[str]) -> bool:
        """Whether stopping `evict` now would cut requests off or race an explicit unload."""
        return any(self._in_flight.get(m, 0) > 0 or m in self._unloading for m in evict)

    def _export_books(self, queued: list[Request]) -> SchedulerState:
        """The shared half of `export_state`: move the books into a SchedulerState and leave
        them empty and shut down; the policy then clears its own queue structure."""
        state = SchedulerState(
            queued=queued,
            swaps=[Swap(s.target, list(s.evict), list(s.waiters))
                   for s in self._active.values()],
            serving=dict(self._serving),
            unloading=dict(self._unloading),
            shut_down=self._shut_down,
            now=self._now,
            stats=self._stats.copy(),
            positions=dict(self._positions),
            pending_stop=dict(self._pending_stop),
            models=dict(self._config.models),
            turns=dict(self._turns),
        )
        self._active, self._serving, self._in_flight = {}, {}, {}
        self._holders, self._reserved, self._unloading, self._positions = set(), {}, {}, {}
        self._pending_stop = {}
        self._waits = WaitGauges()
        self._shut_down = True
        return state

    def _restore_books(self, state: SchedulerState) -> None:
        """The shared half of `from_state`: slots, swaps, in-flight counts, unloads, clock,
        counters and positions; the policy then fills its own queue structure."""
        for r in state.holders():
            self._reserve(r)
        for sw in state.swaps:
            self._active[sw.target] = Swap(sw.target, list(sw.evict), list(sw.waiters))
        for r, model in state.serving.items():
            self._serving[r] = model
            self._in_flight[model] = self._in_flight.get(model, 0) + 1
            self._waits.discard(r)
        self._unloading = dict(state.unloading)
        self._shut_down = state.shut_down
        self._now = state.now
        self._stats = state.stats.copy()
        self._positions = dict(state.positions)
        self._pending_stop = dict(state.pending_stop)
        self._turns = dict(state.turns)
        self._note_config_change(state.models, self._config.models)

    def _deliver(self, req: Request, model: str) -> None:
        """Grant `req` (its Dispatch already written). Only a grant the client received
        counts in flight: counting a refused one would strand the count and block every
        later eviction of `model`."""
        if self._fx.grant_serve(req, model):
            self._waits.discard(req)
            self._serving[req] = model
            self._in_flight[model] = self._in_flight.get(model, 0) + 1
            assert req.dispatch is not None
            self._stats.dispatched[req.dispatch.band] += 1
        else:
            self._release(req)

    def _finish_serving(self, req: Request) -> str:
        """Account a ServeDone; returns the model it was served by."""
        model = self._serving.pop(req, None)
        if model is None:
            raise InvariantViolation(
                f"ServeDone for request seq={req.seq} ({req.model!r}), which is not "
                "being served (never granted, or done twice)")
        left = self._in_flight.get(model, 0) - 1
        if left < 0:
            raise InvariantViolation(f"in-flight count of {model!r} would go negative")
        if left:
            self._in_flight[model] = left
        else:
            del self._in_flight[model]
        self._release(req)
        return model

    def _fail(self, req: Request, error: SchedulingError) -> None:
        self._release(req)
        self._fx.grant_error(req, error)

    def _reserve(self, req: Request) -> None:
        self._holders.add(req)
        self._reserved[req.model] = self._reserved.get(req.model, 0) + 1
        self._waits.add(req)

    def _release(self, req: Request) -> None:
        if req not in self._holders:
            raise InvariantViolation(f"releasing a slot request seq={req.seq} never reserved")
        self._holders.remove(req)
        self._waits.discard(req)
        left = self._reserved[req.model] - 1
        if left:
            self._reserved[req.model] = left
        else:
            del self._reserved[req.model]
