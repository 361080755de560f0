"""Property tests: random event sequences against Fifo, checking its invariants after each step.

The fake shell here keeps model states consistent with what the scheduler asked for (a swap
stops its evict set and readies its target; an unload stops its models; a swap still running
when its target's unload finishes is aborted and fails) and checks, at the moment each effect
is called, what a real shell would suffer from: a busy model evicted, two swaps for one target,
a grant to a process that is not ready or is being stopped, a request answered twice.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import FAILED, READY, STARTING, STOPPED, STOPPING
from scheduling.core.errors import SchedulingError
from scheduling.core.events import (
    Cancelled,
    Request,
    RequestArrived,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.fifo import Fifo
from scheduling.core.matrix import MatrixSwapper
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, make_config, req, waiting_by_band_of

PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)
MODELS = ("a", "b", "c", "p", "q")  # a b c: exclusive (default group); p q: co-run
LIMITS = {"a": 3, "b": 10, "c": 10, "p": 2, "q": 10}
# The same five models under a matrix: a or b beside p, p beside q, b beside both (a
# reference), c in no set (alone); stopping p costs 3.
MATRIX = MatrixSwapper.compile(
    [("duo", "(a | b) & p"), ("pq", "p & q"), ("trio", "+pq & b")], {}, {"p": 3}, MODELS)


def _config(priorities: dict[str, int], drop: tuple[str, ...] = (),
            revisions: dict[str, str] | None = None, router: str = "group") -> SchedulerConfig:
    models = {m: ModelConfig(concurrency_limit=LIMITS[m], fifo_priority=priorities.get(m, 0),
                             revision=(revisions or {}).get(m, ""))
              for m in MODELS if m not in drop}
    if router == "matrix":
        return make_config(models, swapper=MATRIX)
    return make_config(models, groups=[PAIR])


def configs(router: str) -> list[SchedulerConfig]:
    return [
        _config({"c": 2}, router=router),
        _config({"a": 3, "p": 1, "q": -1}, router=router),  # new priorities: the queue re-sorts
        _config({"c": 2}, drop=("b", "q"), router=router),  # deleted: queued/waiting get 404
        # changed: restart a and p when idle
        _config({"c": 2}, revisions={"a": "v2", "p": "v2"}, router=router),
    ]


CONFIGS = configs("group")


def coresident(swapper: object, models: set[str]) -> bool:
    """Whether the router lets `models` run together: one model always may; a matrix only
    what one of its combinations holds."""
    if len(models) <= 1 or not isinstance(swapper, MatrixSwapper):
        return True
    return swapper.can_contain_all(models)


class CheckedEffects(FakeEffects):
    """FakeEffects that plays the shell's state changes and asserts the shell's safety rules
    when each effect is called."""

    def __init__(self) -> None:
        super().__init__()
        self.s: Fifo | None = None
        self.outstanding: dict[str, list[str]] = {}  # swaps started, SwapDone not delivered
        self.doomed: set[str] = set()  # swaps whose target's unload finished first: will fail
        self.unloads: list[tuple[str, ...]] = []  # UnloadRequested without UnloadDone
        self.answers: Counter[Request] = Counter()
        self.open: Counter[str] = Counter()  # granted and not yet served-done, per model
        self.cancelled: set[Request] = set()  # cancelled while queued or waiting
        self.last_position: dict[Request, int] = {}

    def unloading(self) -> set[str]:
        return {m for models in self.unloads for m in models}

    def start_swap(self, model: str, evict: list[str]) -> None:
        assert model not in self.outstanding, f"second swap to {model}"
        assert model not in self.unloading(), f"swap to {model} while it is unloading"
        for m in evict:
            assert self.open[m] == 0, f"swap to {model} evicts {m} with requests in flight"
            assert self.s.in_flight(m) == 0
            assert m not in self.unloading(), f"swap to {model} evicts unloading {m}"
        super().start_swap(model, evict)
        self.outstanding[model] = list(evict)
        # the evicted models keep reading READY until the shell's swap task gets to them:
        # the scheduler must know from its own books that they are going
        self.states[model] = STARTING

    def grant_serve(self, r: Request, model: str) -> bool:
        assert self.states.get(model) == READY, f"grant of {model} in {self.states.get(model)}"
        assert model not in self.unloading(), f"grant of {model} while it is unloading"
        assert not any(model in ev for ev in self.outstanding.values()), \
            f"grant of {model} while a swap is evicting it"
        assert r not in self.cancelled, "cancelled request granted"
        self.answers[r] += 1
        assert self.answers[r] == 1, "request answered twice"
        ok = super().grant_serve(r, model)
        if ok:
            self.open[model] += 1
        return ok

    def grant_error(self, r: Request, error: SchedulingError) -> None:
        assert r not in self.cancelled, "cancelled request answered"
        self.answers[r] += 1
        assert self.answers[r] == 1, "request answered twice"
        super().grant_error(r, error)

    def stop_processes(self, models, handle) -> None:
        if handle is None:  # the scheduler's own stop (a removed model): only when idle
            for m in models:
                assert self.open[m] == 0, f"stop of {m} with requests in flight"
        super().stop_processes(models, handle)
        self.unloads.append(tuple(models))
        for m in models:
            if self.states.get(m, STOPPED) not in (STOPPED, FAILED):
                self.states[m] = STOPPING

    def position_changed(self, r: Request, position: int) -> None:
        super().position_changed(r, position)
        self.last_position[r] = position

    # -- shell events --
    def swap_done(self, model: str, ok: bool, timed_out: bool, now: float) -> SwapDone:
        evict = self.outstanding.pop(model)
        ok = ok and model not in self.doomed
        self.doomed.discard(model)
        for m in evict:
            self.states[m] = STOPPED
        self.states[model] = READY if ok else FAILED
        if ok and self.s is not None:
            # What stays loaded (not being evicted by a swap still running) beside what is
            # loading must be a combination the router allows.
            going = {m for ev in self.outstanding.values() for m in ev}
            kept = {m for m, st in self.states.items()
                    if st in (READY, STARTING) and m not in going} | set(self.outstanding)
            assert coresident(self.s.config.swapper, kept), f"{sorted(kept)} may not co-run"
        return SwapDone(model, now, None if ok else "boom", timed_out and not ok)

    def unload_done(self, i: int, now: float) -> UnloadDone:
        models = self.unloads.pop(i)
        for m in models:
            self.states[m] = STOPPED
            if m in self.outstanding:  # the stop aborted this load
                self.doomed.add(m)
        return UnloadDone(models, now)


class Harness:
    def __init__(self, router: str = "group") -> None:
        self.configs = configs(router)
        self.fx = CheckedEffects()
        self.s = Fifo(self.configs[0], self.fx)
        self.fx.s = self.s
        self.requests: list[Request] = []
        self.now = 0.0

    def step(self, kind: str, a: int = 0, b: int = 0, f1: bool = False,
             f2: bool = False) -> None:
        """Apply one event; `a`, `b`, `f1`, `f2` are the random knobs it reads (see OP)."""
        s, fx = self.s, self.fx
        self.now += 1.0
        if kind == "arrive":
            r = req((*MODELS, "ghost")[a % 6], priority=0 if f1 else b, now=self.now)
            self.requests.append(r)
            s.on_request(RequestArrived(r, self.now))
        elif kind == "swap_done" and fx.outstanding:
            target = sorted(fx.outstanding)[a % len(fx.outstanding)]
            ok = not (f1 and not f2)  # a quarter fail; half of the failures time out
            s.on_swap_done(fx.swap_done(target, ok, b > 0, self.now))
        elif kind == "serve_done":
            granted = [r for r, _ in fx.grants if r not in fx.closed]
            if granted:
                self.serve_done(granted[a % len(granted)])
        elif kind in ("cancel", "leave") and self.requests:
            r = self.requests[a % len(self.requests)]
            fx.gone.add(r)  # a cancelling client has left: a racing grant must be refused
            if kind == "cancel":
                waiting = r in s.queued() or any(r in w for w in s.active_swaps().values())
                s.on_cancel(Cancelled(r, self.now))
                if waiting:
                    fx.cancelled.add(r)
        elif kind == "idle":
            pass  # time passes with nothing happening: the next event carries a later `now`
        elif kind == "unload":
            models = {MODELS[a % 5], MODELS[(a // 5) % 5]} if f1 else {MODELS[a % 5]}
            s.on_unload(UnloadRequested(tuple(sorted(models)), self.now, handle="explicit"))
        elif kind == "unload_all":  # whatever is loaded or loading now, resolved by the core
            extra = (MODELS[a % 5],) if f1 else ()
            s.on_unload(UnloadRequested(extra, self.now, handle="explicit", everything=True))
        elif kind == "restart":
            s.on_restart(RestartRequested((MODELS[a % 5],), self.now))
        elif kind == "unload_done" and fx.unloads:
            s.on_unload_done(fx.unload_done(a % len(fx.unloads), self.now))
        elif kind == "settings":
            s.on_settings_changed(SettingsChanged(self.configs[a % len(self.configs)], self.now))
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
        assert set(swaps) == set(fx.outstanding), "active swaps differ from the shell's"
        for target, ws in swaps.items():
            assert all(r.model == target for r in ws)
        holders = queued + waiting
        assert len(set(holders)) == len(holders), "a request is in two places"
        assert not fx.cancelled & set(holders), "a cancelled request is still held"
        for r in holders:
            assert fx.answers[r] == 0, "an answered request is still held"
        mcs = s.config.models
        ranks = [(-(mcs[r.model].fifo_priority + r.priority), r.seq) for r in queued]
        assert ranks == sorted(ranks), "queue out of order"
        for pos, r in enumerate(queued, start=1):
            assert fx.last_position.get(r) == pos, "stale queue position"
        for m in MODELS:
            assert s.in_flight(m) == fx.open[m] >= 0
            held = sum(1 for r in holders if r.model == m)
            assert s.reserved(m) == held + s.in_flight(m)
            if m in mcs:
                # every model here has an explicit limit: it always applies
                assert s.reserved(m) <= mcs[m].concurrency_limit
        assert s.waiting_by_band() == waiting_by_band_of(holders)

    def settle(self) -> None:
        """Let the shell finish everything (swaps succeed unless aborted) until quiet."""
        fx = self.fx
        for _ in range(200):
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


# An event kind, weighted by repetition (arrivals and completions are common, settings changes
# and unloads rare), with random knobs that `Harness.step` interprets per kind.
KINDS = (["arrive"] * 6 + ["swap_done"] * 4 + ["serve_done"] * 4 + ["cancel", "leave"] * 2
         + ["idle", "unload", "unload_all", "unload_done", "unload_done", "settings", "settings",
            "restart"])
OP = st.tuples(st.sampled_from(KINDS), st.integers(0, 60), st.integers(-2, 2), st.booleans(),
               st.booleans())


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OP, min_size=20, max_size=100),
       shutdown_at=st.none() | st.integers(0, 100), router=st.sampled_from(("group", "matrix")))
def test_fifo_random_events_keep_invariants_and_never_wedge(ops, shutdown_at, router):
    """Any interleaving keeps the books straight (slots, in-flight, one answer per request,
    no busy or unloading model evicted, under a matrix only allowed combinations loaded)
    and, once the shell finishes its work, leaves no request hanging: a wedge here is a
    client waiting forever."""
    h = Harness(router)
    for i, op in enumerate(ops):
        if i == shutdown_at:
            h.step("shutdown")
        h.step(*op)
    h.settle()

    s, fx = h.s, h.fx
    assert s.queued() == [] and s.active_swaps() == {}
    assert s.restart_pending() == frozenset(), "a restart was never carried out"
    for m in MODELS:
        assert s.reserved(m) == 0 and s.in_flight(m) == 0
    for r in h.requests:
        expected = 0 if r in fx.cancelled else 1
        assert fx.answers[r] == expected, f"{r} answered {fx.answers[r]} times"
