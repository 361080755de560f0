"""Slot bookkeeping that every policy keeps the same way: admission reservations, requests
in flight, and the grant itself. The policies (fifo.py, serial.py) differ in whom they pick,
never in how a pick is accounted, so that part lives here once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from scheduling.core.config import DEFAULT_CONCURRENCY_LIMIT, ModelConfig, SchedulerConfig
from scheduling.core.effects import READY, STARTING, Effects
from scheduling.core.errors import (
    ConcurrencyLimit,
    ModelNotFound,
    QueueFull,
    SchedulingError,
    ShuttingDown,
)
from scheduling.core.events import Request
from scheduling.core.handover import SchedulerState, SwapState
from scheduling.core.priority import BANDS, band
from scheduling.core.stats import SchedulerStats


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


class Ledger:
    """Mixed into a policy, which sets these attributes in its constructor."""

    _config: SchedulerConfig
    _fx: Effects
    _now: float  # the `now` of the last event
    _shut_down: bool
    _active: dict[str, Any]  # target -> the policy's swap record (.target .evict .waiters)
    _unloading: dict[str, int]  # model -> explicit unloads not yet reported done
    _positions: dict[Request, int]  # last position reported to each queued request
    _holders: set[Request]  # requests holding an admission slot
    _reserved: dict[str, int]  # model -> slots held (queued + waiting + in flight)
    _serving: dict[Request, str]  # granted request -> model, until its ServeDone
    _in_flight: dict[str, int]  # model -> granted requests not yet done
    _stats: SchedulerStats
    # Admitted and not yet granted (queued or waiting on a swap), per band, for the queue
    # gauges: a count, and a heap on arrival with lazy deletion (an entry is live while its
    # request is in `_waiting`), so the oldest is O(log n) amortised instead of a scan.
    # Models to stop once idle, never cutting off work in flight: "restart" (its definition
    # changed, or an admin asked) restarts it with a swap evicting itself; "removed" (no
    # longer defined, or disabled) just stops it. Until then nothing new is granted to it.
    _pending_stop: dict[str, str]
    _waiting: set[Request]
    _wait_count: dict[str, int]
    _wait_heaps: dict[str, list[tuple[float, int, int, Request]]]

    def _init_books(self, config: SchedulerConfig, fx: Effects) -> None:
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
        self._waiting = set()
        self._wait_count = dict.fromkeys(BANDS, 0)
        self._wait_heaps = {b: [] for b in BANDS}

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
        out: dict[str, tuple[int, float | None]] = {}
        for b in BANDS:
            heap = self._wait_heaps[b]
            while heap and heap[0][3] not in self._waiting:
                heapq.heappop(heap)
            out[b] = (self._wait_count[b], heap[0][0] if heap else None)
        return out

    def _admit(self, req: Request) -> bool:
        """Admission, the same for every policy. In order: an unknown model →
        ModelNotFound (404), nothing reserved; after shutdown → ShuttingDown (503); the model
        already holds its cap (`limit_of`) of slots (queued + waiting + serving) →
        ConcurrencyLimit (429, Retry-After: 1); the queue, or the request's band of it, already
        holds its cap of waiting requests → QueueFull (429, Retry-After: 5); otherwise
        reserve a slot and return True."""
        if req in self._holders or req in self._serving:
            raise InvariantViolation(f"request seq={req.seq} arrived twice")
        mc = self._config.models.get(req.model)
        if mc is None:
            self._fx.grant_error(req, ModelNotFound(req.model))
            return False
        if self._shut_down:
            self._fx.grant_error(req, ShuttingDown())
            return False
        limit = limit_of(mc, self._config.scheduler)
        if limit is not None and self.reserved(req.model) >= limit:
            self._fx.grant_error(req, ConcurrencyLimit(req.model, limit))
            return False
        cap = self._config.max_waiting
        if cap > 0 and sum(self._wait_count.values()) >= cap:
            self._fx.grant_error(req, QueueFull("the queue", cap))
            return False
        b = band(req.priority)
        cap = self._config.max_waiting_per_band.get(b, 0)
        if cap > 0 and self._wait_count[b] >= cap:
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

    def _start_restart(self, model: str) -> None:
        """A swap to `model` that evicts `model` itself: the shell stops it, then starts it
        again from the current definition. Requests for it wait for this swap like any other."""
        raise NotImplementedError

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
            swaps=[SwapState(s.target, list(s.evict), list(s.waiters))
                   for s in self._active.values()],
            serving=dict(self._serving),
            unloading=dict(self._unloading),
            shut_down=self._shut_down,
            now=self._now,
            stats=self._stats.copy(),
            positions=dict(self._positions),
            pending_stop=dict(self._pending_stop),
            models=dict(self._config.models),
        )
        self._active, self._serving, self._in_flight = {}, {}, {}
        self._holders, self._reserved, self._unloading, self._positions = set(), {}, {}, {}
        self._pending_stop = {}
        self._waiting = set()
        self._wait_count = dict.fromkeys(BANDS, 0)
        self._wait_heaps = {b: [] for b in BANDS}
        self._shut_down = True
        return state

    def _restore_books(self, state: SchedulerState,
                       make_swap: Callable[[str, list[str], list[Request]], Any]) -> None:
        """The shared half of `from_state`: slots, swaps, in-flight counts, unloads, clock,
        counters and positions; the policy then fills its own queue structure."""
        for r in state.holders():
            self._reserve(r)
        for sw in state.swaps:
            self._active[sw.target] = make_swap(sw.target, list(sw.evict), list(sw.waiters))
        for r, model in state.serving.items():
            self._serving[r] = model
            self._in_flight[model] = self._in_flight.get(model, 0) + 1
            self._unwait(r)
        self._unloading = dict(state.unloading)
        self._shut_down = state.shut_down
        self._now = state.now
        self._stats = state.stats.copy()
        self._positions = dict(state.positions)
        self._pending_stop = dict(state.pending_stop)
        self._note_config_change(state.models, self._config.models)

    def _deliver(self, req: Request, model: str) -> None:
        """Grant `req` (its Dispatch already written). Only a grant the client received
        counts in flight: counting a refused one would strand the count and block every
        later eviction of `model`."""
        if self._fx.grant_serve(req, model):
            self._unwait(req)
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
        b = band(req.priority)
        self._waiting.add(req)
        self._wait_count[b] += 1
        heapq.heappush(self._wait_heaps[b], (req.arrived, req.seq, id(req), req))

    def _unwait(self, req: Request) -> None:
        """`req` stops waiting (granted or gone); its heap entry is dropped lazily."""
        if req in self._waiting:
            self._waiting.remove(req)
            b = band(req.priority)
            self._wait_count[b] -= 1
            heap = self._wait_heaps[b]
            if len(heap) > 64 + 2 * self._wait_count[b]:
                # Mostly dead entries (an old request holds the top while later ones come and
                # go): rebuild, so memory follows the live queue and no granted request is
                # kept alive by its entry.
                heap[:] = [e for e in heap if e[3] in self._waiting]
                heapq.heapify(heap)

    def _release(self, req: Request) -> None:
        if req not in self._holders:
            raise InvariantViolation(f"releasing a slot request seq={req.seq} never reserved")
        self._holders.remove(req)
        self._unwait(req)
        left = self._reserved[req.model] - 1
        if left:
            self._reserved[req.model] = left
        else:
            del self._reserved[req.model]
