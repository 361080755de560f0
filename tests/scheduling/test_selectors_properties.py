"""Property test: selector requests mixed into random workloads, under both schedulers.

The shell fake is test_fifo_properties.py's `CheckedEffects` (a grant only to a READY model
nobody is stopping, no busy or unloading model evicted, one answer per request), plus: a
selector request is granted only to one of its selector's targets, a peer's model is granted
without a swap, a queued selector request is unbound. After every event the books must
balance (each model's, selector's and peer model's slots = its requests held + in flight);
once the shell finishes its work, every request is answered exactly once and every count is
back to 0. Policy switches (fifo ↔ serial) and a settings change that removes a selector are
among the events.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.config import ModelConfig, SchedulerConfig, SelectorConfig
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
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
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
