"""Property tests for the serial scheduler: random workloads against its guarantees.

(a) Order: whenever a request is granted or starts a swap, every waiting request that scores
    higher at that `now` was blocked for a legitimate reason (no free slot, a swap that would
    evict a busy or unloading model or collides with an active swap, its model loading or
    unloading), or could not go without delaying an even higher request; and the action
    itself delays no higher request. The checker restates the rule from the specification,
    with its own score formula, in `OrderChecked`.
(b) No wedge: once arrivals stop and the shell finishes every swap and serve, every request
    has been answered exactly once and every count is back to 0.
(c) Starvation bound: a batch request under a saturating stream of interactive requests to the
    loaded model is served within T = (priority gap + bonus) x agingDivisor plus one service,
    one swap and one more service.
(d) Affinity never reorders two requests whose priorities differ by >= 100 at equal age.
Plus fifo's bookkeeping invariants (slots, in flight <= parallel, one swap per target, never
evicting a busy model), checked after every event by the shell fake of
test_fifo_properties.py.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import FAILED, READY, STOPPED
from scheduling.core.events import (
    Cancelled,
    Request,
    RequestArrived,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    UnloadRequested,
)
from scheduling.core.matrix import MatrixSwapper
from scheduling.core.priority import band
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, make_config, req, waiting_by_band_of
from tests.scheduling.test_fifo_properties import CheckedEffects

EPS = 1e-9

# Model layouts: (models, groups). Ungrouped models share the exclusive `(default)` group.
LAYOUTS = {
    "exclusive": (("a", "b", "c", "d"), []),
    "pair": (("a", "b", "p", "q"), [Group("pair", frozenset({"p", "q"}), swap=False,
                                          exclusive=False)]),
    "two-swap-groups": (("a1", "a2", "b1", "b2"),
                        [Group("one", frozenset({"a1", "a2"}), swap=True, exclusive=False),
                         Group("two", frozenset({"b1", "b2"}), swap=True, exclusive=False)]),
    "persistent": (("a", "b", "c", "k"), [Group("keep", frozenset({"k"}), swap=True,
                                                exclusive=False, persistent=True)]),
    # A matrix: a or b beside the embedder e, e beside d, b beside both; c in no set (runs
    # alone); stopping e costs 5, so a load prefers to keep it.
    "matrix": (("a", "b", "c", "e"), MatrixSwapper.compile(
        [("chat", "(a | b) & e"), ("side", "e & d"), ("wide", "+chat & d")], {}, {"e": 5},
        ("a", "b", "c", "d", "e"))),
}
PRIORITIES = (-150, -100, -60, -50, -49, -5, 0, 0, 0, 3, 40, 50, 100, 103, 200)
DTS = (0.0, 0.0, 0.5, 1.0, 3.0, 30.0, 120.0)  # time between events: often equal, sometimes long
BONUSES = (0, 10, 99, 150)  # 150 is out of range: the scheduler must treat it as 99
DIVISORS = (0.5, 1.0, 60.0)


def eff_bonus(cfg: SchedulerConfig) -> int:
    return min(max(cfg.swap_affinity_bonus, 0), 99)


def parallel_of(cfg: SchedulerConfig, m: str) -> int:
    mc = cfg.models.get(m)
    return mc.parallel if mc is not None and mc.parallel > 0 else 1


class OrderChecked(CheckedEffects):
    """CheckedEffects that, at every grant and swap start, checks property (a) against the
    states the shell holds at that moment, and the Dispatch record of every grant."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.violations: list[str] = []

    # -- the specification, restated -------------------------------------------------------
    def view(self, exclude: str | None = None):
        active = {t: list(e) for t, e in self.outstanding.items() if t != exclude}
        # A model waiting to be stopped or restarted once idle is held like an unloading one
        # (the shell cannot see it, so the spec reads the scheduler's own list of them).
        unl = self.unloading() | set(self.s._pending_stop)
        evicting = {m for e in active.values() for m in e}
        running = sorted({m for m, st in self.states.items() if st not in (STOPPED, FAILED)}
                         | active.keys())
        return active, unl, evicting, running

    def aff(self, m: str, view) -> int:
        active, unl, evicting, _ = view
        loaded = (m in active and m not in unl) or (
            self.states.get(m) == READY and m not in evicting and m not in unl)
        return eff_bonus(self.s.config) if loaded else 0

    def score(self, r: Request, view) -> float:
        div = self.s.config.aging_divisor
        return r.priority + self.aff(r.model, view) + (self.now - r.arrived) / div

    def higher(self, x: Request, y: Request, view) -> bool:
        d = self.score(x, view) - self.score(y, view)
        return d > EPS or (abs(d) <= EPS and x.seq < y.seq)

    def need(self, r: Request, view):
        """(kind, evict, can_go_now) of a waiting request: kind is "joins" (waiting for the
        swap loading its model), "slot" (loaded: needs a free slot) or "swap"; `evict` is
        what must stop before it can be served."""
        active, unl, evicting, running = view
        m = r.model
        if m in active and (m not in unl or r not in self.s.queued()):
            later = [x for x in self.s.config.swapper.eviction_for(m, running)
                     if x not in active[m]]
            return "joins", later, False
        evict = self.s.config.swapper.eviction_for(m, running)
        if m in unl:
            return "swap", evict, False
        if not evict and m not in evicting and self.states.get(m) == READY:
            return "slot", [], self.open[m] < parallel_of(self.s.config, m)
        collide = any(t != m and (t in evict or m in ev or set(evict) & set(ev))
                      for t, ev in active.items())
        busy = any(self.open[x] > 0 or x in unl for x in evict)
        return "swap", evict, not collide and not busy

    def conflicts(self, h: Request, action, view) -> bool:
        """Whether `action` ("grant", m) or ("swap", t, evict) would delay waiting `h`."""
        kind, eh, _ = self.need(h, view)
        mh = h.model
        if action[0] == "grant":
            return action[1] == mh if kind == "slot" else action[1] in eh
        _, t, evict = action
        if t == mh:
            return False
        running = view[3]
        after = self.s.config.swapper.eviction_for(
            mh, [*(m for m in running if m not in evict), t])
        return (mh in evict or bool(set(evict) & set(eh)) or t in after
                or not set(after) <= set(eh))

    def check_order(self, g: Request, action, exclude: str | None = None) -> None:
        view = self.view(exclude)
        waiters = [w for t, ws in self.s.active_swaps().items() if t != exclude for w in ws]
        waiting = [r for r in [*self.s.queued(), *waiters] if r is not g]
        above = [h for h in waiting if self.higher(h, g, view)]
        for h in above:
            if self.conflicts(h, action, view):
                self.violations.append(f"{action} for {g} delays higher {h} "
                                       f"{self.need(h, view)}; {self.describe(view)}")
            kind, eh, can = self.need(h, view)
            if not can:
                continue
            mine = ("grant", h.model) if kind == "slot" else ("swap", h.model, eh)
            if not any(self.higher(h0, h, view) and self.conflicts(h0, mine, view)
                       for h0 in waiting if h0 is not h):
                self.violations.append(f"{action} for {g} while higher {h} could go "
                                       f"({kind}); {self.describe(view)}")

    def describe(self, view) -> str:
        active, unl, _, running = view
        return (f"now={self.now} active={active} unloading={sorted(unl)} running={running} "
                f"states={self.states} open={dict(self.open)} queued={self.s.queued()}")

    # -- effects -----------------------------------------------------------------------------
    def grant_serve(self, r: Request, model: str) -> bool:
        self.check_order(r, ("grant", model))
        d = r.dispatch
        view = self.view()
        assert d is not None, "granted without a Dispatch record"
        assert d.band == band(r.priority) and d.priority == r.priority and d.seq == r.seq
        assert d.affinity == self.aff(model, view)
        assert abs(d.aging - (self.now - r.arrived) / self.s.config.aging_divisor) < 1e-6
        assert abs(d.score - (d.priority + d.affinity + d.aging)) < 1e-6
        assert d.queue_wait == self.now - r.arrived
        return super().grant_serve(r, model)

    def start_swap(self, model: str, evict: list[str]) -> None:
        if model not in evict:  # a restart (a swap evicting its own target) is not a pick
            first = self.s.active_swaps()[model][0]  # recorded before start_swap
            self.check_order(first, ("swap", model, list(evict)), exclude=model)
        super().start_swap(model, evict)


def make_configs(layout: str, parallel: tuple[int, ...], bonus: int, divisor: float
                 ) -> list[SchedulerConfig]:
    models, groups = LAYOUTS[layout]
    limits = (3, 10, 4, 10)
    mcs = {m: ModelConfig(concurrency_limit=limits[i], parallel=parallel[i])
           for i, m in enumerate(models)}

    def cfg(b: int, d: float, drop: tuple[str, ...] = (),
            changed: tuple[str, ...] = ()) -> SchedulerConfig:
        kept = {m: replace(mc, revision="v2" if m in changed else "")
                for m, mc in mcs.items() if m not in drop}
        base = (make_config(kept, groups=groups) if isinstance(groups, list)
                else make_config(kept, swapper=groups))
        return replace(base, scheduler="serial", swap_affinity_bonus=b, aging_divisor=d)

    return [cfg(bonus, divisor), cfg(0 if bonus else 50, divisor * 4),
            cfg(bonus, divisor, drop=(models[1],)),
            cfg(bonus, divisor, changed=(models[0], models[2]))]


class Harness:
    def __init__(self, layout: str, parallel: tuple[int, ...], bonus: int,
                 divisor: float) -> None:
        self.models = LAYOUTS[layout][0]
        self.configs = make_configs(layout, parallel, bonus, divisor)
        self.fx = OrderChecked()
        self.s = Serial(self.configs[0], self.fx)
        self.fx.s = self.s  # type: ignore[assignment]
        self.requests: list[Request] = []
        self.now = 0.0

    def step(self, kind: str, a: int = 0, b: int = 0, f1: bool = False, f2: bool = False,
             dt: int = 1) -> None:
        s, fx = self.s, self.fx
        self.now += DTS[dt % len(DTS)]
        fx.now = self.now
        models = self.models
        if kind == "arrive":
            r = req((*models, "ghost")[a % 5], priority=PRIORITIES[b % len(PRIORITIES)],
                    now=self.now)
            self.requests.append(r)
            s.on_request(RequestArrived(r, self.now))
        elif kind == "swap_done" and fx.outstanding:
            target = sorted(fx.outstanding)[a % len(fx.outstanding)]
            s.on_swap_done(fx.swap_done(target, not (f1 and not f2), b > 6, self.now))
        elif kind == "serve_done":
            granted = [r for r, _ in fx.grants if r not in fx.closed]
            if granted:
                self.serve_done(granted[a % len(granted)])
        elif kind in ("cancel", "leave") and self.requests:
            r = self.requests[a % len(self.requests)]
            fx.gone.add(r)
            if kind == "cancel":
                waiting = r in s.queued() or any(r in w for w in s.active_swaps().values())
                s.on_cancel(Cancelled(r, self.now))
                if waiting:
                    fx.cancelled.add(r)
        elif kind == "idle":
            pass  # time passes with nothing happening: the next event carries a later `now`
        elif kind == "unload":
            ms = {models[a % 4], models[(a // 4) % 4]} if f1 else {models[a % 4]}
            s.on_unload(UnloadRequested(tuple(sorted(ms)), self.now, handle="explicit"))
        elif kind == "unload_all":  # whatever is loaded or loading now, resolved by the core
            extra = (models[a % 4],) if f1 else ()
            s.on_unload(UnloadRequested(extra, self.now, handle="explicit", everything=True))
        elif kind == "unload_done" and fx.unloads:
            s.on_unload_done(fx.unload_done(a % len(fx.unloads), self.now))
        elif kind == "settings":
            s.on_settings_changed(SettingsChanged(self.configs[a % 4], self.now))
        elif kind == "restart":
            s.on_restart(RestartRequested((models[a % 4],), self.now))
        elif kind == "shutdown":
            s.on_shutdown(Shutdown(self.now))
        self.check()

    def serve_done(self, r: Request) -> None:
        model = next(m for x, m in self.fx.grants if x is r)
        self.fx.closed.add(r)
        self.fx.open[model] -= 1
        self.s.on_serve_done(ServeDone(r, self.now))

    def check(self) -> None:
        s, fx = self.s, self.fx
        assert not fx.violations, fx.violations
        queued = s.queued()
        swaps = s.active_swaps()
        waiting = [r for ws in swaps.values() for r in ws]
        assert set(swaps) == set(fx.outstanding)
        for target, ws in swaps.items():
            assert all(r.model == target for r in ws)
        holders = queued + waiting
        assert len(set(holders)) == len(holders), "a request is in two places"
        assert not fx.cancelled & set(holders), "a cancelled request is still held"
        for r in holders:
            assert fx.answers[r] == 0, "an answered request is still held"
        view = fx.view()
        for x, y in itertools.pairwise(queued):
            assert not fx.higher(y, x, view), f"queue out of order: seq={x.seq} before {y.seq}"
        for pos, r in enumerate(queued, start=1):
            assert fx.last_position.get(r) == pos, "stale queue position"
        mcs = s.config.models
        for m in self.models:
            assert s.in_flight(m) == fx.open[m] >= 0
            held = sum(1 for r in holders if r.model == m)
            assert s.reserved(m) == held + s.in_flight(m)
            assert s.in_flight(m) <= parallel_of(self.configs[0], m), f"{m} over parallel"
            if m in mcs:
                # every model here has an explicit limit: it always applies
                assert s.reserved(m) <= mcs[m].concurrency_limit
        assert sum(s.stats().dispatched.values()) == len(fx.grants)
        assert s.waiting_by_band() == waiting_by_band_of(holders)

    def settle(self) -> None:
        fx = self.fx
        for _ in range(500):
            busy = False
            while fx.unloads:
                busy = True
                self.step("unload_done", dt=0)
            while fx.outstanding:
                busy = True
                self.step("swap_done", dt=0)
            granted = [r for r, _ in fx.grants if r not in fx.closed]
            if granted:
                busy = True
                self.serve_done(granted[0])
                self.check()
            if not busy:
                return
        raise AssertionError("the scheduler never settled")


KINDS = (["arrive"] * 7 + ["swap_done"] * 4 + ["serve_done"] * 5 + ["cancel", "leave"]
         + ["idle", "idle", "unload", "unload_all", "unload_done", "unload_done", "settings",
            "restart"])
OP = st.tuples(st.sampled_from(KINDS), st.integers(0, 60), st.integers(0, 30), st.booleans(),
               st.booleans(), st.integers(0, 6))
PARAMS = dict(layout=st.sampled_from(sorted(LAYOUTS)),
              parallel=st.tuples(*[st.sampled_from((1, 1, 2))] * 4),
              bonus=st.sampled_from(BONUSES), divisor=st.sampled_from(DIVISORS))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OP, min_size=20, max_size=90), shutdown_at=st.none() | st.integers(0, 300),
       **PARAMS)
def test_serial_random_workloads_keep_order_and_never_wedge(ops, shutdown_at, layout,
                                                            parallel, bonus, divisor):
    """(a) and (b) on random workloads: every grant and swap start respects the score order
    (no request dispatched while a higher one could have gone in its place, none delaying a
    higher one), the books stay straight after every event, and once the shell finishes
    its work every request is answered exactly once: a wedge is a client waiting forever."""
    h = Harness(layout, parallel, bonus, divisor)
    for i, op in enumerate(ops):
        if i == shutdown_at:
            h.step("shutdown")
        h.step(*op)
    h.settle()
    s, fx = h.s, h.fx
    assert s.queued() == [] and s.active_swaps() == {}
    assert s.restart_pending() == frozenset(), "a restart was never carried out"
    for m in h.models:
        assert s.reserved(m) == 0 and s.in_flight(m) == 0
    for r in h.requests:
        expected = 0 if r in fx.cancelled else 1
        assert fx.answers[r] == expected, f"{r} answered {fx.answers[r]} times"


# ---- (c) the starvation bound ------------------------------------------------------------------


class Timed(FakeEffects):
    """FakeEffects that notes the virtual time of each grant and swap start."""

    def __init__(self, states) -> None:
        super().__init__(states)
        self.now = 0.0
        self.granted_at: dict[Request, float] = {}
        self.started: list[tuple[str, float]] = []

    def grant_serve(self, r, model):
        ok = super().grant_serve(r, model)
        self.granted_at[r] = self.now
        return ok

    def start_swap(self, model, evict):
        super().start_swap(model, evict)
        self.started.append((model, self.now))


@settings(max_examples=40, deadline=None)
@given(divisor=st.sampled_from((0.25, 0.5, 1.0)), service=st.sampled_from((1.0, 2.0, 4.0)),
       swap=st.sampled_from((0.0, 1.0, 10.0)), bonus=st.sampled_from(BONUSES),
       phase=st.sampled_from((0.25, 0.5, 0.75)), offset=st.sampled_from((0.0, 0.3, 0.9)),
       hi=st.sampled_from((100, 103)), lo=st.sampled_from((-100, -120)))
def test_serial_batch_wait_bounded_under_interactive_stream(divisor, service, swap, bonus,
                                                            phase, offset, hi, lo):
    """(c) One batch request for b, then interactive requests for the loaded a, one every
    service time, arriving `phase` of a service before the running one ends, so a is never
    idle and one is always queued. Every interactive request that arrives within
    T = (hi - lo + bonus) x divisor of the batch one outscores it for ever; later ones never
    do. So the batch request waits at most T + one service (the request then queued) + one
    service (the one running) + one swap, and at least T - one service (the stream really
    held it back). No aging, or an uncapped bonus, breaks the upper bound."""
    fx = Timed({"a": READY})
    cfg = replace(make_config(("a", "b")), scheduler="serial", swap_affinity_bonus=bonus,
                  aging_divisor=divisor)
    s = Serial(cfg, fx)
    t_bound = (hi - lo + min(bonus, 99)) * divisor
    t0 = offset * service
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()

    def at(t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(events, (t, next(order), kind, payload))

    batch = Request(0, "b", t0, lo)
    at(t0, "arrive", batch)
    horizon = t0 + 3 * t_bound + 10 * (service + swap)
    k = 1
    while k * service - phase * service < horizon:
        at(k * service - phase * service, "arrive",
           Request(k, "a", k * service - phase * service, hi))
        k += 1
    first = Request(-1, "a", 0.0, hi)  # keeps a busy from the start
    seen_grants = 0
    seen_swaps = 0
    fx.now = 0.0
    s.on_request(RequestArrived(first, 0.0))
    while events:
        t, _, kind, payload = heapq.heappop(events)
        fx.now = t
        if kind == "arrive":
            s.on_request(RequestArrived(payload, t))  # type: ignore[arg-type]
        elif kind == "serve_done":
            s.on_serve_done(ServeDone(payload, t))  # type: ignore[arg-type]
        elif kind == "swap_done":
            s.on_swap_done(fx.finish_swap(payload, now=t))  # type: ignore[arg-type]
        for r, _m in fx.grants[seen_grants:]:
            at(fx.granted_at[r] + service, "serve_done", r)
        seen_grants = len(fx.grants)
        for m, started in fx.started[seen_swaps:]:
            at(started + swap, "swap_done", m)
        seen_swaps = len(fx.started)
        if batch in fx.granted_at:
            break
    assert batch in fx.granted_at, "the batch request starved"
    wait = fx.granted_at[batch] - t0
    assert wait <= t_bound + 2 * service + swap + EPS, (wait, t_bound)
    assert wait >= t_bound - service - EPS, (wait, t_bound)
    assert batch.dispatch is not None and batch.dispatch.queue_wait == wait


# ---- (d) band isolation -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(PRIORITIES)),
                     min_size=2, max_size=12),
       bonus=st.integers(-5, 250), loaded=st.sampled_from("abcd"))
def test_serial_affinity_never_reorders_priorities_100_apart(reqs, bonus, loaded):
    """(d) At equal age, a request whatever its model is never ranked or served after one
    whose priority is 100 or more below it, whatever the bonus (it is capped at 99): the
    bonus may only reorder within a band."""
    fx = FakeEffects({loaded: READY})
    cfg = replace(make_config({m: ModelConfig(concurrency_limit=100) for m in "abcd"}),
                  scheduler="serial", swap_affinity_bonus=bonus, aging_divisor=1.0)
    s = Serial(cfg, fx)
    busy = req(loaded)
    s.on_request(RequestArrived(busy, 0.0))  # the loaded model is busy: everyone queues
    rs = [req(m, priority=p, now=0.0) for m, p in reqs]
    for r in rs:
        s.on_request(RequestArrived(r, 0.0))
    rank = {r: i for i, r in enumerate(s.queued())}
    waiting = [r for r in rs if r in rank]  # the rest joined a swap or were granted
    for x, y in itertools.permutations(waiting, 2):
        if x.priority >= y.priority + 100:
            assert rank[x] < rank[y], (x, y)
    fx.closed.add(busy)
    s.on_serve_done(ServeDone(busy, 0.0))
    for _ in range(200):  # finish everything at the same instant: no aging at all
        if s.active_swaps():
            s.on_swap_done(fx.finish_swap(next(iter(s.active_swaps()))))
            continue
        open_ = [r for r, _ in fx.grants if r not in fx.closed]
        if not open_:
            break
        fx.closed.add(open_[0])
        s.on_serve_done(ServeDone(open_[0], 0.0))
    served = [r for r, _ in fx.grants if r is not busy]
    assert len(served) == len(rs)
    pos = {r: i for i, r in enumerate(served)}
    for x, y in itertools.permutations(rs, 2):
        if x.priority >= y.priority + 100:
            assert pos[x] < pos[y], (x.model, x.priority, y.model, y.priority)
