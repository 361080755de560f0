"""Property test: selector requests mixed into random workloads, under both schedulers.

The shell fake is test_fifo_properties.py's `CheckedEffects` (a grant only to a READY model
nobody is stopping, no busy or unloading model evicted, one answer per request), plus: a
selector request is granted only to one of its selector's targets, a peer's model is granted
without a swap, a queued selector request is unbound. After every event the books must
balance (each model's, selector's and peer model's slots = its requests held + in flight);
once the shell finishes its work, every request is answered exactly once and every count is
back to 0. Policy switches (fifo ↔ serial) and a settings change that removes a selector are
among the events.

Under serial, also test_serial_properties.py's property (a), the score order, with a
selector request not yet bound standing for a request for its pick.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.config import ModelConfig, SchedulerConfig, SelectorConfig
from scheduling.core.effects import READY, STARTING, STOPPING
from scheduling.core.events import (
    Cancelled,
    Request,
    RequestArrived,
    ServeDone,
    SettingsChanged,
    Shutdown,
    UnloadRequested,
)
from scheduling.core.fifo import Fifo
from scheduling.core.policies import make_scheduler
from scheduling.core.selectors import COLD, choose
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
from tests.scheduling import test_serial_properties as sp
from tests.scheduling.fakes import FakeEffects, make_config, req, waiting_by_band_of
from tests.scheduling.test_fifo_properties import CheckedEffects

PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)
MODELS = ("a", "b", "c", "p", "q")  # a b c: exclusive (default group); p q: co-run
PEER = "far/m"
SELECTORS = {
    "w": SelectorConfig("warm", ("a", "b")),
    "pin": SelectorConfig("pin", ("c", "p")),
    "sp": SelectorConfig("spillover", ("p", "q", PEER), spillover=2),
    "sq": SelectorConfig("spillover", ("p", "q")),
}
NAMES = (*MODELS, *SELECTORS, *SELECTORS, "ghost")  # selectors twice as often


def make(kind: str, drop_w: bool = False, parallel: int = 1) -> SchedulerConfig:
    mcs = {m: ModelConfig(parallel=parallel) for m in MODELS}
    sels = {k: v for k, v in SELECTORS.items() if not (drop_w and k == "w")}
    return replace(make_config(mcs, groups=[PAIR]), scheduler=kind, selectors=sels,
                   peer_models=frozenset({PEER}))


class SelectorChecked(CheckedEffects):
    def __init__(self) -> None:
        super().__init__()
        self.switched = False  # a policy switch happened: serial may hold fifo's grants

    def grant_serve(self, r: Request, model: str) -> bool:
        if r.selector:
            assert model in SELECTORS[r.selector].targets, f"{r} granted {model}"
        assert r.model == model
        if model != PEER:
            return super().grant_serve(r, model)
        assert model not in self.outstanding
        self.answers[r] += 1
        assert self.answers[r] == 1, "request answered twice"
        ok = FakeEffects.grant_serve(self, r, model)
        if ok:
            self.open[model] += 1
        return ok


class Harness:
    def __init__(self, kind: str, parallel: int) -> None:
        self.parallel = parallel
        self.fx = SelectorChecked()
        self.kind = kind
        self.s: Fifo | Serial = (Fifo if kind == "fifo" else Serial)(
            make(kind, parallel=parallel), self.fx)
        self.fx.s = self.s  # type: ignore[assignment]
        self.requests: list[Request] = []
        self.now = 0.0

    def step(self, kind: str, a: int = 0, b: int = 0, f1: bool = False) -> None:
        s, fx = self.s, self.fx
        self.now += 1.0
        if kind == "arrive":
            r = req(NAMES[a % len(NAMES)], priority=b, now=self.now)
            self.requests.append(r)
            s.on_request(RequestArrived(r, self.now))
        elif kind == "swap_done" and fx.outstanding:
            target = sorted(fx.outstanding)[a % len(fx.outstanding)]
            s.on_swap_done(fx.swap_done(target, not f1 or b != 0, False, self.now))
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
        elif kind == "unload":
            s.on_unload(UnloadRequested((MODELS[a % 5],), self.now, handle="explicit"))
        elif kind == "unload_done" and fx.unloads:
            s.on_unload_done(fx.unload_done(a % len(fx.unloads), self.now))
        elif kind == "settings":  # "w" removed, or back
            s.on_settings_changed(SettingsChanged(
                make(s.config.scheduler, drop_w=f1, parallel=self.parallel), self.now))
        elif kind == "switch":  # a live policy switch, as the run loop does it
            other = "serial" if s.config.scheduler == "fifo" else "fifo"
            cfg = make(other, drop_w="w" not in s.config.selectors, parallel=self.parallel)
            self.s = make_scheduler(cfg, fx, s)  # type: ignore[assignment]
            fx.s = self.s  # type: ignore[assignment]
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
        for r in queued:
            if r.model in SELECTORS:
                assert r.selector == "", "a queued selector request is bound"
        for pos, r in enumerate(queued, start=1):
            assert fx.last_position.get(r) == pos, "stale queue position"
        for m in (*MODELS, *SELECTORS, PEER):
            assert s.in_flight(m) == fx.open[m] >= 0
            held = sum(1 for r in holders if r.model == m)
            assert s.reserved(m) == held + s.in_flight(m), m
            if s.config.scheduler == "serial" and m in MODELS:
                assert s.in_flight(m) <= self.parallel or fx.switched, f"{m} over parallel"
        assert s.waiting_by_band() == waiting_by_band_of(holders)

    def settle(self) -> None:
        fx = self.fx
        for _ in range(300):
            busy = False
            while fx.unloads:
                busy = True
                self.step("unload_done")
            while fx.outstanding:
                busy = True
                self.step("swap_done")
            for r in [r for r, _ in fx.grants if r not in fx.closed]:
                busy = True
                self.serve_done(r)
                self.check()
            if not busy:
                return
        raise AssertionError("the scheduler never settled")


KINDS = (["arrive"] * 8 + ["swap_done"] * 4 + ["serve_done"] * 5 + ["cancel", "leave"]
         + ["unload", "unload_done", "unload_done", "settings", "switch"])
OP = st.tuples(st.sampled_from(KINDS), st.integers(0, 60), st.integers(-2, 2), st.booleans())


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OP, min_size=20, max_size=100), kind=st.sampled_from(("fifo", "serial")),
       parallel=st.sampled_from((1, 2)), shutdown_at=st.none() | st.integers(0, 150))
def test_selector_requests_keep_the_books_and_never_wedge(ops, kind, parallel, shutdown_at):
    """Selector requests among model requests, under fifo and serial and across switches:
    every grant goes to a READY target of the request's selector (or to the peer's model,
    unswapped), the books balance after every event, and once the shell finishes its work
    every request is answered exactly once and every count is back to 0."""
    h = Harness(kind, parallel)
    for i, op in enumerate(ops):
        if i == shutdown_at:
            h.step("shutdown")
        if op[0] == "switch":
            h.fx.switched = True  # fifo grants past `parallel`; serial keeps what it gets
        h.step(*op)
    h.settle()
    s, fx = h.s, h.fx
    assert s.queued() == [] and s.active_swaps() == {}
    for m in (*MODELS, *SELECTORS, PEER):
        assert s.reserved(m) == 0 and s.in_flight(m) == 0, m
    for r in h.requests:
        expected = 0 if r in fx.cancelled else 1
        assert fx.answers[r] == expected, f"{r} answered {fx.answers[r]} times"


# ---- serial: the score order, with selector requests ranked by their pick ------------------


class SelectorOrderChecked(sp.OrderChecked):
    deciding: Request | None = None  # the request whose grant or swap is being checked
    bound_before: frozenset[Request] = frozenset()  # bound to a target before this event
    proxies: set[Request]  # requests standing for an unbound selector request, for its pick

    def __init__(self) -> None:
        super().__init__()
        self.proxies = set()

    """test_serial_properties.py's order check (property (a)), where a selector request not
    yet bound stands for a request for the target its strategy picks in the spec's view of
    the box (READY, STARTING, being stopped, cold: restated here from the shell's states);
    with no target to pick it can go nowhere and delays nobody."""

    def pick(self, r: Request, view) -> Request | None:
        sel = self.s.config.selectors.get(r.model)
        if r.selector or sel is None:
            return r
        active, unl, evicting, _ = view
        models = self.s.config.models

        def condition(t: str) -> str:
            if t not in models or t in unl or t in evicting:
                return STOPPING
            if t in active:
                return STARTING
            return {READY: READY, STARTING: STARTING, STOPPING: STOPPING}.get(
                self.states.get(t, ""), COLD)

        usable = SelectorConfig(sel.strategy, tuple(t for t in sel.targets if t in models),
                                sel.spillover)
        # The books as the walk read them before it bound the request being checked (`g`)
        # in this event: not yet counted at its target, its selector's turn not advanced.
        g = self.deciding if self.deciding not in self.bound_before else None

        def reserved(t: str) -> int:
            return self.s.reserved(t) - (1 if g is not None and g.selector and g.model == t
                                         else 0)

        turn = self.s._turns.get(r.model, 0)
        if g is not None and g.selector == r.model and turn > 0:
            before = choose(usable, condition, reserved, turn - 1)
            if before == (g.model, True):
                turn -= 1
        t, _ = choose(usable, condition, reserved, turn)
        if t is None:
            return None
        proxy = Request(r.seq, t, r.arrived, r.priority)
        self.proxies.add(proxy)
        return proxy

    def check_order(self, g: Request, action, exclude: str | None = None) -> None:
        """test_serial_properties.py's, with a waiting selector request's own move made as
        a request for its pick."""
        self.deciding = g
        self.proxies = set()
        try:
            view = self.view(exclude)
            waiters = [w for t, ws in self.s.active_swaps().items() if t != exclude for w in ws]
            waiting = [r for r in [*self.s.queued(), *waiters] if r is not g]
            for h in [h for h in waiting if self.higher(h, g, view)]:
                if self.conflicts(h, action, view):
                    self.violations.append(f"{action} for {g} delays higher {h}; "
                                           f"{self.describe(view)}")
                kind, eh, can = self.need(h, view)
                p = self.pick(h, view)
                if not can or p is None:
                    continue
                mine = ("grant", p.model) if kind == "slot" else ("swap", p.model, eh)
                if not any(self.higher(h0, h, view) and self.conflicts(h0, mine, view)
                           for h0 in waiting if h0 is not h):
                    self.violations.append(f"{action} for {g} while higher {h} could go "
                                           f"({kind}); {self.describe(view)}")
        finally:
            self.deciding = None

    def score(self, r: Request, view) -> float:
        return super().score(self.pick(r, view) or r, view)

    def need(self, r: Request, view):
        p = r if r in self.proxies else self.pick(r, view)
        if p is None:
            return "swap", [], False
        if p in self.proxies and p.model in view[1]:  # its pick is held: it waits unbound
            return "swap", self.s.config.swapper.eviction_for(p.model, view[3]), False
        return super().need(p, view)

    def conflicts(self, h: Request, action, view) -> bool:
        p = self.pick(h, view)
        return p is not None and super().conflicts(p, action, view)


class OrderHarness(sp.Harness):
    def __init__(self, layout: str, parallel: tuple[int, ...], bonus: int,
                 divisor: float) -> None:
        self.models = sp.LAYOUTS[layout][0]
        m = self.models
        sels = {"w": SelectorConfig("warm", (m[0], m[1])),
                "pin": SelectorConfig("pin", (m[2], m[0])),
                "sp": SelectorConfig("spillover", (m[2], m[3], m[1]), spillover=2)}
        self.configs = [
            replace(c, selectors=sels,
                    models={k: replace(mc, concurrency_limit=1000) for k, mc in c.models.items()})
            for c in sp.make_configs(layout, parallel, bonus, divisor)]
        self.names = (*m, *sels, *sels)
        self.fx = SelectorOrderChecked()
        self.s = Serial(self.configs[0], self.fx)
        self.fx.s = self.s  # type: ignore[assignment]
        self.requests = []
        self.now = 0.0

    def serve_done(self, r: Request) -> None:
        self.fx.bound_before = frozenset(x for x in self.requests if x.selector)
        super().serve_done(r)

    def step(self, kind: str, a: int = 0, b: int = 0, f1: bool = False, f2: bool = False,
             dt: int = 1) -> None:
        self.fx.bound_before = frozenset(x for x in self.requests if x.selector)
        if kind != "arrive":
            super().step(kind, a, b, f1, f2, dt)
            return
        self.now += sp.DTS[dt % len(sp.DTS)]
        self.fx.now = self.now
        r = req(self.names[a % len(self.names)], priority=sp.PRIORITIES[b % len(sp.PRIORITIES)],
                now=self.now)
        self.requests.append(r)
        self.s.on_request(RequestArrived(r, self.now))
        self.check()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(sp.OP, min_size=20, max_size=90), **sp.PARAMS)
def test_serial_selector_requests_keep_the_score_order(ops, layout, parallel, bonus, divisor):
    """Serial's property (a) with selector requests among the rest: no grant or swap start
    while a higher request (a selector's ranked as a request for its pick) could have gone
    instead, none delaying a higher one; and once the shell is done, nothing hangs."""
    h = OrderHarness(layout, parallel, bonus, divisor)
    for op in ops:
        h.step(*op)
    h.settle()
    s, fx = h.s, h.fx
    assert s.queued() == [] and s.active_swaps() == {}
    for r in h.requests:
        assert fx.answers[r] == (0 if r in fx.cancelled else 1), r
