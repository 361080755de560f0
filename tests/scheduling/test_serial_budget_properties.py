"""Property tests for serial's affinity budget (scheduling/core/budget.py) on random workloads.

(a) Bound: on a one-at-a-time box (models a, b, c ungrouped, parallel 1) at equal priority, a
    request R is *kept back by affinity* at a pick (a grant or swap start, seen by the shell)
    when R is the oldest queued request and the pick is another, younger one: with equal
    priorities the order without affinity is arrival order, and on such a box nothing else
    can hold the oldest back at a pick (nothing older waits, no other swap can run). From the
    first such pick, R leaves the queue (granted, or taken into its swap) within the budget
    plus one service time: the one running when the budget ran out.
(b) Within the budget, affinity still batches: `A B C A`-like sequences at equal priority,
    arriving together while A is loaded, are served grouped by model (the loaded one first,
    then the others in order of their first request), as without a budget, when the budget
    is longer than the whole reorder.
(c) Band isolation is untouched: the budget only ever gives a model the bonus (<= 99), so a
    request is never served after one 100 or more below it that arrived with it.
(d) Off is off: with the budget at 0, or so long that it never runs out, every decision
    (grants, swaps, errors, positions, Dispatch records, counters) is the same as with none,
    on the random workloads of test_serial_properties.py.
(e) With a budget that runs out often, those workloads keep the order rule of
    test_serial_properties.py (a), with the lifted models ranked as loaded, never wedge, and
    keep every bookkeeping invariant.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import READY
from scheduling.core.events import Request, RequestArrived, ServeDone
from scheduling.core.serial import Serial
from tests.scheduling.fakes import FakeEffects, make_config
from tests.scheduling.test_serial_properties import (
    OP,
    PARAMS,
    PRIORITIES,
    Harness,
    OrderChecked,
    make_configs,
)

EPS = 1e-9


class Box(FakeEffects):
    """A one-at-a-time box on a virtual clock: a swap takes `swap` s, a grant `service[r]` s.
    It notes each pick (grant or swap start) with the queue as it is then."""

    def __init__(self, swap: float, loaded: str | None = None) -> None:
        super().__init__({loaded: READY} if loaded else {})
        self.swap = swap
        self.now = 0.0
        self.s: Serial
        self.service: dict[Request, float] = {}
        self.events: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.left: dict[Request, float] = {}  # when a request left the queue
        self.first_kept: dict[Request, float] = {}  # first pick it was kept back by affinity
        self.granted: list[Request] = []

    def at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, payload))

    def picked(self, chosen: list[Request]) -> None:
        for r in chosen:
            self.left.setdefault(r, self.now)
        queued = self.s.queued()
        if not queued:
            return
        oldest = min(queued, key=lambda r: (r.arrived, r.seq))
        if all((oldest.arrived, oldest.seq) < (c.arrived, c.seq) for c in chosen):
            self.first_kept.setdefault(oldest, self.now)

    def grant_serve(self, req: Request, model: str) -> bool:
        ok = super().grant_serve(req, model)
        self.granted.append(req)
        self.picked([req])
        self.at(self.now + self.service[req], "serve_done", req)
        return ok

    def start_swap(self, model: str, evict: list[str]) -> None:
        super().start_swap(model, evict)
        self.picked(self.s.active_swaps()[model])
        self.at(self.now + self.swap, "swap_done", model)

    def run(self) -> None:
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                assert isinstance(payload, Request)
                self.s.on_request(RequestArrived(payload, t))
            elif kind == "serve_done":
                assert isinstance(payload, Request)
                self.closed.add(payload)
                self.s.on_serve_done(ServeDone(payload, t))
            else:
                assert isinstance(payload, str)
                self.s.on_swap_done(self.finish_swap(payload, now=t))


def box_config(budget: float = 0.0, swaps: float = 0.0, assumed: float = 10.0, bonus: int = 10,
               divisor: float = 60.0) -> SchedulerConfig:
    cfg = make_config({m: ModelConfig(concurrency_limit=10**6) for m in "abc"})
    return replace(cfg, scheduler="serial", swap_affinity_bonus=bonus, aging_divisor=divisor,
                   affinity_budget=budget, affinity_budget_swaps=swaps, assumed_swap_cost=assumed)


ARRIVALS = st.lists(st.tuples(st.sampled_from("aaabc"), st.sampled_from((0.0, 0.5, 1.0, 3.0, 8.0)),
                              st.sampled_from((1.0, 2.0, 5.0))), min_size=2, max_size=60)


@settings(max_examples=150, deadline=None)
@given(arrivals=ARRIVALS, swap=st.sampled_from((0.0, 1.0, 5.0)),
       budget=st.sampled_from((("s", 1.0), ("s", 7.0), ("s", 30.0), ("k", 1.0), ("k", 3.0))),
       bonus=st.sampled_from((10, 99)), divisor=st.sampled_from((1.0, 60.0)),
       loaded=st.sampled_from(("a", None)))
def test_no_request_is_kept_back_by_affinity_longer_than_budget_plus_one_service(
        arrivals, swap, budget, bonus, divisor, loaded):
    """(a), with the budget in seconds or as k x the measured swap (assumed = the real one)."""
    kind, amount = budget
    cfg = (box_config(budget=amount, bonus=bonus, divisor=divisor) if kind == "s" else
           box_config(swaps=amount, assumed=swap or 10.0, bonus=bonus, divisor=divisor))
    fx = Box(swap, loaded)
    fx.s = Serial(cfg, fx)
    t = 0.0
    for i, (model, gap, service) in enumerate(arrivals):
        t += gap
        r = Request(i + 1, model, t, 0)
        fx.service[r] = service
        fx.at(t, "arrive", r)
    fx.run()
    assert len(fx.granted) == len(arrivals), "a request was never served"
    longest = max(s for _, _, s in arrivals)
    # in swaps: k x the measured swap (`swap`), or the assumed one before (`swap`, or 10 s
    # when swaps are instant: then the budget is at most that)
    allowed = amount if kind == "s" else amount * (swap or 10.0)
    for r, first in fx.first_kept.items():
        assert fx.left[r] - first <= allowed + longest + EPS, (r, first, fx.left[r], allowed)


@settings(max_examples=150, deadline=None)
@given(models=st.lists(st.sampled_from("abc"), min_size=2, max_size=10),
       service=st.sampled_from((1.0, 2.0, 5.0)), swap=st.sampled_from((1.0, 5.0)),
       by_swaps=st.booleans())
def test_within_the_budget_affinity_still_batches_by_model(models, service, swap, by_swaps):
    """(b) a loaded and busy; the sequence arrives at 0 (after a's first request). Budget:
    longer than the whole run (every request and a swap each), in seconds or in swaps."""
    n = len(models) + 1
    total = n * (service + swap) + 1.0
    cfg = (box_config(swaps=total / swap, assumed=swap) if by_swaps else
           box_config(budget=total))
    fx = Box(swap, "a")
    fx.s = Serial(cfg, fx)
    rs = [Request(i + 1, m, 0.0, 0) for i, m in enumerate(["a", *models])]
    for r in rs:
        fx.service[r] = service
        fx.at(0.0, "arrive", r)
    fx.run()
    order = []
    for m in ["a", *models]:
        if m not in order:
            order.append(m)
    expected = [r for m in order for r in rs if r.model == m]
    assert fx.granted == expected
    assert fx.s.stats().affinity_budget_overrides == 0
    assert len(fx.swaps) == len(order) - 1


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(PRIORITIES)),
                     min_size=2, max_size=14),
       budget=st.sampled_from((0.5, 2.0, 10.0)), bonus=st.sampled_from((10, 99, 150)),
       loaded=st.sampled_from("abc"))
def test_budget_never_reorders_priorities_100_apart(reqs, budget, bonus, loaded):
    """(c) Everything arrives at 0 (equal age) while `loaded` is busy; services 1 s, swaps
    1 s, so budgets run out while they are served. A request 100 or more above another is
    always served first."""
    fx = Box(1.0, loaded)
    fx.s = Serial(box_config(budget=budget, bonus=bonus), fx)
    busy = Request(0, loaded, 0.0, 0)
    rs = [Request(i + 1, m, 0.0, p) for i, (m, p) in enumerate(reqs)]
    for r in [busy, *rs]:
        fx.service[r] = 1.0
        fx.at(0.0, "arrive", r)
    fx.run()
    pos = {r: i for i, r in enumerate(fx.granted)}
    assert len(pos) == len(rs) + 1
    for x, y in itertools.permutations(rs, 2):
        if x.priority >= y.priority + 100:
            assert pos[x] < pos[y], (x.model, x.priority, y.model, y.priority)


# ---- (d) and (e): the random workloads of test_serial_properties.py ------------------------


class BudgetHarness(Harness):
    """test_serial_properties.Harness with a budget in every config it switches between."""

    def __init__(self, layout, parallel, bonus, divisor, budget: float, swaps: float,
                 fx: OrderChecked | None = None) -> None:
        super().__init__(layout, parallel, bonus, divisor)
        self.configs = [replace(c, affinity_budget=budget, affinity_budget_swaps=swaps)
                        for c in make_configs(layout, parallel, bonus, divisor)]
        self.fx = fx or OrderChecked()
        self.s = Serial(self.configs[0], self.fx)
        self.fx.s = self.s  # type: ignore[assignment]


def decisions(h: Harness) -> dict[str, object]:
    """Everything the shell saw, with requests named by their place in the workload."""
    idx = {r: i for i, r in enumerate(h.requests)}
    fx = h.fx

    def d(r: Request):
        x = r.dispatch
        return None if x is None else (x.band, x.score, x.priority, x.affinity, x.aging,
                                       x.queue_wait, x.budget_override)

    return {"grants": [(idx[r], m, d(r)) for r, m in fx.grants],
            "refused": [(idx[r], m) for r, m in fx.refused],
            "swaps": fx.swaps,
            "errors": [(idx[r], type(e).__name__) for r, e in fx.errors],
            "stops": [m for m, _ in fx.stops],
            "positions": [(idx[r], p) for r, p in fx.positions],
            "stats": h.s.stats()}


def play(h: Harness, ops, shutdown_at) -> None:
    for i, op in enumerate(ops):
        if i == shutdown_at:
            h.step("shutdown")
        h.step(*op)
    h.settle()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(OP, min_size=20, max_size=90), shutdown_at=st.none() | st.integers(0, 300),
       never=st.sampled_from(((0.0, 0.0), (1e12, 0.0))), **PARAMS)
def test_budget_off_or_never_spent_decides_as_without_one(ops, shutdown_at, never, layout,
                                                          parallel, bonus, divisor):
    """(d) The same workload under the seed's config and under a budget of 0 or of 10^12 s:
    the same decisions, record for record. (Not 10^12 swaps: here a swap may take 0 s, and
    k x 0 is a budget of 0.)"""
    plain = Harness(layout, parallel, bonus, divisor)
    play(plain, ops, shutdown_at)
    budgeted = BudgetHarness(layout, parallel, bonus, divisor, *never)
    play(budgeted, ops, shutdown_at)
    assert decisions(budgeted) == decisions(plain)
    assert all(not r.dispatch.budget_override for r in budgeted.requests if r.dispatch)


class LiftChecked(OrderChecked):
    """OrderChecked whose specification ranks the models the budget lifts as loaded."""

    def aff(self, m: str, view) -> int:
        if m in self.s.budget_lifted():  # type: ignore[attr-defined]
            return min(max(self.s.config.swap_affinity_bonus, 0), 99)
        return super().aff(m, view)

    def grant_serve(self, r: Request, model: str) -> bool:
        assert r.dispatch is not None
        lifted = model in self.s.budget_lifted()  # type: ignore[attr-defined]
        assert r.dispatch.budget_override == lifted
        return super().grant_serve(r, model)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OP, min_size=20, max_size=90), shutdown_at=st.none() | st.integers(0, 300),
       budget=st.sampled_from(((0.5, 0.0), (3.0, 0.0), (0.0, 0.1))), **PARAMS)
def test_budget_keeps_order_and_never_wedges(ops, shutdown_at, budget, layout, parallel,
                                             bonus, divisor):
    """(e) test_serial_properties.py's (a) and (b) with short budgets (0.5 s, 3 s, or a tenth
    of an assumed 10 s swap): every grant and swap start respects the order with lifted
    models ranked as loaded, the books stay straight, and every request is answered once."""
    h = BudgetHarness(layout, parallel, bonus, divisor, *budget, fx=LiftChecked())
    play(h, ops, shutdown_at)
    s, fx = h.s, h.fx
    assert s.queued() == [] and s.active_swaps() == {}
    assert s.budget_lifted() == frozenset()
    for m in h.models:
        assert s.reserved(m) == 0 and s.in_flight(m) == 0
    for r in h.requests:
        assert fx.answers[r] == (0 if r in fx.cancelled else 1), r


def test_the_random_workloads_do_spend_budgets():
    """(e) is not vacuous: a fixed workload from its strategy (arrivals while a model is
    busy, then serves) makes the budget run out."""
    h = BudgetHarness("exclusive", (1, 1, 1, 1), 10, 60.0, 0.5, 0.0, fx=LiftChecked())
    ops = [("arrive", 0, 6, False, False, 0), ("swap_done", 0, 0, False, False, 0),
           ("arrive", 1, 6, False, False, 0), ("arrive", 0, 6, False, False, 2),
           ("serve_done", 0, 0, False, False, 3), ("arrive", 0, 6, False, False, 2),
           ("serve_done", 0, 0, False, False, 3)]
    play(h, ops, None)
    assert h.s.stats().affinity_budget_overrides >= 1
