"""Selectors in the core (scheduling/core/selectors.py), under both schedulers.

llama-swap's strategies (`internal/server/selector.go`), hand-worked: warm takes the first
READY target, else the first STARTING one, else loads the first; pin the first; spillover
fills each active target to N reserved requests, then starts the next cold one, then shares
the least busy in turn. Here the choice is made when the scheduler dispatches the request,
from its own books at that moment. Method as in test_fifo.py: the `on_*` handlers called
directly with a FakeEffects; a swap completes when a test delivers its SwapDone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.config import ModelConfig, SchedulerConfig, SelectorConfig
from scheduling.core.effects import READY, STARTING, STOPPING
from scheduling.core.errors import ConcurrencyLimit, ModelNotFound
from scheduling.core.events import (
    Cancelled,
    Request,
    ServeDone,
    SettingsChanged,
    UnloadDone,
    UnloadRequested,
)
from scheduling.core.fifo import Fifo
from scheduling.core.policies import make_scheduler
from scheduling.core.selectors import COLD, PEER, choose
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, arrive, make_config

PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)  # p, q co-run
POLICIES = ("fifo", "serial")


def config(kind: str, selectors: dict[str, SelectorConfig], models=("a", "b", "c"),
           groups=(), peers: frozenset[str] = frozenset(), parallel: int = 1,
           limit: int = 0) -> SchedulerConfig:
    mcs = {m: ModelConfig(concurrency_limit=limit, parallel=parallel) for m in models}
    return replace(make_config(mcs, groups), scheduler=kind, selectors=selectors,
                   peer_models=peers)


def sched(kind: str, selectors: dict[str, SelectorConfig], states=None, **kw
          ) -> tuple[Fifo | Serial, FakeEffects]:
    fx = FakeEffects(states)
    cls = Fifo if kind == "fifo" else Serial
    return cls(config(kind, selectors, **kw), fx), fx


def warm(*targets: str) -> dict[str, SelectorConfig]:
    return {"auto": SelectorConfig("warm", targets)}


def complete(s, fx: FakeEffects, model: str) -> None:
    s.on_swap_done(fx.finish_swap(model))


def done(s, fx: FakeEffects, r: Request) -> None:
    fx.closed.add(r)
    s.on_serve_done(ServeDone(r, 0.0))


# ---- the strategy itself ---------------------------------------------------------------------


def test_choose_by_hand():
    """The strategies on hand-written conditions and counts (llama-swap's selector.go)."""
    cond = {"a": COLD, "b": READY, "c": STARTING, "d": STOPPING, "x/m": PEER}.__getitem__
    none = {}.get

    def pick(strategy, targets, reserved=None, n=1, turn=0):
        counts = reserved or {}
        return choose(SelectorConfig(strategy, targets, n), cond,
                      lambda t: counts.get(t, 0), turn)

    assert pick("pin", ("a", "b")) == ("a", False)
    assert pick("warm", ("a", "c", "b")) == ("b", False)  # ready beats starting beats order
    assert pick("warm", ("a", "c")) == ("c", False)
    assert pick("warm", ("a", "d")) == ("a", False)
    assert none("x") is None
    # spillover, N = 2: b is active with 1 → b; with 2 → the first cold one (a), not d
    assert pick("spillover", ("d", "b", "a"), {"b": 1}, n=2) == ("b", True)
    assert pick("spillover", ("d", "b", "a"), {"b": 2}, n=2) == ("a", False)
    # all active and full: the least busy, ties in turn
    assert pick("spillover", ("b", "c"), {"b": 2, "c": 3}, n=2) == ("b", True)
    assert pick("spillover", ("b", "c"), {"b": 2, "c": 2}, n=2, turn=1) == ("c", True)
    # a peer is active while it holds requests, else cold
    assert pick("spillover", ("x/m", "a"), {}, n=1) == ("x/m", False)
    assert pick("spillover", ("x/m", "a"), {"x/m": 1}, n=1) == ("a", False)
    # only targets being stopped: nothing now
    assert pick("spillover", ("d",)) == (None, False)


# ---- warm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLICIES)
def test_warm_picks_the_ready_target_over_a_cold_first_one(kind):
    """b is loaded, a (listed first) is not: the request goes to b, nothing is swapped, and
    it becomes a request for b (the activity row's model)."""
    s, fx = sched(kind, warm("a", "b"), {"b": READY})
    r = arrive(s, "auto")
    assert fx.grants == [(r, "b")] and fx.swaps == []
    assert (r.model, r.selector) == ("b", "auto")
    assert s.reserved("b") == 1 and s.reserved("auto") == 0 and s.in_flight("b") == 1
    done(s, fx, r)
    assert s.reserved("b") == 0 and s.in_flight("b") == 0


@pytest.mark.parametrize("kind", POLICIES)
def test_warm_joins_the_starting_target(kind):
    """Nothing is ready, b is loading: the request waits for b's load instead of starting
    a's (which would stop b), and is granted b when it is done."""
    s, fx = sched(kind, warm("a", "b"))
    first = arrive(s, "b")
    r = arrive(s, "auto")
    assert fx.swaps == [("b", [])]
    assert s.active_swaps() == {"b": [first, r]}
    complete(s, fx, "b")
    if kind == "serial":
        done(s, fx, first)  # serial grants b one at a time (parallel 1)
    assert (r, "b") in fx.grants and fx.swaps == [("b", [])]


@pytest.mark.parametrize("kind", POLICIES)
def test_warm_cold_starts_the_first_target(kind):
    """Nothing loaded or loading: warm loads its first target."""
    s, fx = sched(kind, warm("a", "b"), {"c": READY})
    r = arrive(s, "auto")
    assert fx.swaps == [("a", ["c"])] and s.active_swaps() == {"a": [r]}
    complete(s, fx, "a")
    assert fx.grants == [(r, "a")]


@pytest.mark.parametrize("kind", POLICIES)
def test_a_waiting_selector_request_is_decided_when_it_goes(kind):
    """The choice is made at dispatch, not at arrival. a and x share a swap group, b is in
    another that runs beside it; x is busy. The warm request finds nothing loaded, so it
    would load a, which must wait for x: it waits unbound. Meanwhile b is loaded for someone
    else; when the request can go, b is ready, so it is served by b and a is never loaded
    (llama-swap, having chosen a at arrival, would have waited for x and loaded a)."""
    groups = [Group("g", frozenset({"a", "x"}), swap=True, exclusive=False),
              Group("h", frozenset({"b"}), swap=True, exclusive=False)]
    s, fx = sched(kind, warm("a", "b"), {"x": READY}, models=("a", "b", "x"), groups=groups)
    busy = arrive(s, "x")
    assert fx.grants == [(busy, "x")]
    r = arrive(s, "auto")
    assert fx.swaps == [] and r.model == "auto" and r.selector == ""
    assert s.queued() == [r] and s.reserved("auto") == 1
    other = arrive(s, "b")
    assert fx.swaps == [("b", [])]
    complete(s, fx, "b")
    if kind == "serial":  # one at a time on b (parallel 1): the selector's, older, first
        assert fx.grants[-1] == (r, "b")
        done(s, fx, r)
    assert (other, "b") in fx.grants and (r, "b") in fx.grants and r.model == "b"
    assert [m for m, _ in fx.swaps] == ["b"], "a was never loaded"


# ---- pin -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLICIES)
def test_pin_takes_the_first_target_even_when_another_is_ready(kind):
    s, fx = sched(kind, {"fixed": SelectorConfig("pin", ("a", "b"))}, {"b": READY})
    r = arrive(s, "fixed")
    assert fx.swaps == [("a", ["b"])] and s.active_swaps() == {"a": [r]}
    complete(s, fx, "a")
    assert fx.grants == [(r, "a")]


# ---- spillover -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POLICIES)
def test_spillover_fills_the_first_target_then_starts_the_second(kind):
    """p is loaded, q (beside it) is not, N = 2: two requests go to p; the third starts q;
    the fourth joins q (least busy, 1 < 2); then both hold 2 and the next ones share them
    in turn, least busy first."""
    sels = {"pool": SelectorConfig("spillover", ("p", "q"), spillover=2)}
    s, fx = sched(kind, sels, {"p": READY}, models=("p", "q"), groups=[PAIR], parallel=4)
    r1, r2 = arrive(s, "pool"), arrive(s, "pool")
    assert fx.grants == [(r1, "p"), (r2, "p")] and fx.swaps == []
    r3 = arrive(s, "pool")
    assert fx.swaps == [("q", [])] and s.active_swaps() == {"q": [r3]}
    r4 = arrive(s, "pool")
    assert s.active_swaps() == {"q": [r3, r4]}
    assert s.reserved("p") == 2 and s.reserved("q") == 2
    r5 = arrive(s, "pool")  # both full, no cold one: the round robin's turn (3) → q
    r6 = arrive(s, "pool")  # p 2, q 3: the least busy → p
    assert r5.model == "q" and r6.model == "p"
    complete(s, fx, "q")
    assert {r.model for r, _ in fx.grants} == {"p", "q"} and len(fx.grants) == 6
    for r in (r1, r2, r3, r4, r5, r6):
        done(s, fx, r)
    assert s.reserved("p") == s.reserved("q") == s.reserved("pool") == 0


@pytest.mark.parametrize("kind", POLICIES)
def test_spillover_skips_a_target_being_unloaded(kind):
    """A target being stopped is neither active nor cold (llama-swap skips a stopping one):
    the request starts the next one instead of waiting for the unload."""
    sels = {"pool": SelectorConfig("spillover", ("p", "q"))}
    s, fx = sched(kind, sels, {"p": READY}, models=("p", "q"), groups=[PAIR])
    s.on_unload(UnloadRequested(("p",), 0.0, handle=None))
    r = arrive(s, "pool")
    assert fx.swaps == [("q", [])] and s.active_swaps() == {"q": [r]}
    s.on_unload_done(UnloadDone(("p",), 0.0))


# ---- peers, admission, settings, handover ---------------------------------------------------


@pytest.mark.parametrize("kind", POLICIES)
def test_a_peer_target_is_granted_at_once_and_counted(kind):
    """p is full (N = 1): the next request goes to the peer's model, granted at once, never
    swapped, and counted in flight so the one after sees the peer busy too."""
    sels = {"pool": SelectorConfig("spillover", ("p", "far/m"))}
    s, fx = sched(kind, sels, {"p": READY}, models=("p",), peers=frozenset({"far/m"}),
                  parallel=4)
    r1, r2 = arrive(s, "pool"), arrive(s, "pool")
    assert fx.grants == [(r1, "p"), (r2, "far/m")] and fx.swaps == []
    assert s.in_flight("far/m") == 1
    r3 = arrive(s, "pool")  # both hold 1, none cold: in turn
    assert r3.model in ("p", "far/m") and len(fx.grants) == 3
    for r in (r1, r2, r3):
        done(s, fx, r)
    assert s.reserved("far/m") == 0 and s.in_flight("far/m") == 0


@pytest.mark.parametrize("kind", POLICIES)
def test_selector_admission(kind):
    """A selector whose targets are all undefined is not served (404); one that is has no
    cap of its own, the cap of the target it would pick applies (429 naming the target)."""
    s, fx = sched(kind, {"gone": SelectorConfig("pin", ("zz",)),
                         "fixed": SelectorConfig("pin", ("a",))}, {"a": READY}, limit=1)
    r = arrive(s, "gone")
    assert isinstance(fx.error_of(r), ModelNotFound) and s.reserved("gone") == 0
    first = arrive(s, "fixed")
    assert fx.grants == [(first, "a")]
    second = arrive(s, "fixed")
    err = fx.error_of(second)
    assert isinstance(err, ConcurrencyLimit) and err.model == "a"


@pytest.mark.parametrize("kind", POLICIES)
def test_removing_a_selector_fails_its_waiting_requests(kind):
    """A settings change that removes a selector answers its requests still unbound 404;
    one already bound to a target keeps its place (it is a request for that model)."""
    s, fx = sched(kind, warm("a", "b"), {"c": READY})
    busy = arrive(s, "c")
    r = arrive(s, "auto")  # would load a, which must stop the busy c: waits unbound
    assert s.queued() == [r] and r.model == "auto"
    s.on_settings_changed(SettingsChanged(config(kind, {}), 1.0))
    assert isinstance(fx.error_of(r), ModelNotFound) and s.reserved("auto") == 0
    assert s.queued() == []
    done(s, fx, busy)


@pytest.mark.parametrize("kind", POLICIES)
def test_handover_keeps_unbound_selector_requests(kind):
    """A live fifo↔serial switch hands a waiting selector request over unbound; the new
    policy decides its target when it goes."""
    s, fx = sched(kind, warm("a", "b"), {"c": READY})
    busy = arrive(s, "c")
    r = arrive(s, "auto")
    other = "serial" if kind == "fifo" else "fifo"
    t = make_scheduler(config(other, warm("a", "b")), fx, s)
    assert type(t) is not type(s)
    assert t.queued() == [r] and r.model == "auto" and t.reserved("auto") == 1
    done(t, fx, busy)
    assert fx.swaps == [("a", ["c"])] and r.model == "a"
    complete(t, fx, "a")
    assert (r, "a") in fx.grants and t.reserved("auto") == 0


@pytest.mark.parametrize("kind", POLICIES)
def test_cancel_of_a_waiting_selector_request(kind):
    s, fx = sched(kind, warm("a", "b"), {"c": READY})
    busy = arrive(s, "c")
    r = arrive(s, "auto")
    s.on_cancel(Cancelled(r, 0.0))
    assert s.queued() == [] and s.reserved("auto") == 0
    done(s, fx, busy)
    assert fx.swaps == []


def test_serial_selector_affinity_is_its_picks():
    """Serial: a selector's queued request gets the affinity bonus when the target its
    strategy would pick now is loaded, so it ranks like a request for that target."""
    sels = {"auto": SelectorConfig("warm", ("a", "b")),
            "fixed": SelectorConfig("pin", ("a", "b"))}
    s, fx = sched("serial", sels, {"b": READY})
    busy = arrive(s, "b")  # b busy (parallel 1): what follows queues
    cold = arrive(s, "c", now=0.0)
    pinned = arrive(s, "fixed", now=0.0)
    auto = arrive(s, "auto", now=0.0)
    # auto would go to the loaded b: bonus, first; fixed would load a: none, after c (seq)
    assert s.queued() == [auto, cold, pinned]
    assert s.score(auto, 0.0) == 10 and s.score(pinned, 0.0) == 0
    done(s, fx, busy)
    assert fx.grants[-1] == (auto, "b")


@pytest.mark.parametrize("kind", POLICIES)
def test_spillover_counts_requests_queued_at_a_loaded_target(kind):
    """N = 2, p loaded with one slot: the second request finds p busy; it is p's all the
    same (queued there under serial, forwarded under fifo, which leaves slots to the
    upstream), so p holds 2 and the third request spills over to q. Were it left unbound
    waiting for p's slot, p would never hold 2 and nothing would ever spill."""
    sels = {"pool": SelectorConfig("spillover", ("p", "q"), spillover=2)}
    s, fx = sched(kind, sels, {"p": READY}, models=("p", "q"), groups=[PAIR])
    r1, r2 = arrive(s, "pool"), arrive(s, "pool")
    assert fx.grants[0] == (r1, "p") and r2.model == "p" and s.reserved("p") == 2
    if kind == "serial":
        assert s.queued() == [r2]
    r3 = arrive(s, "pool")
    assert fx.swaps == [("q", [])] and s.active_swaps() == {"q": [r3]}


def test_serial_selector_request_does_not_feed_what_a_higher_one_must_stop():
    """Serial's rule holds for a selector's pick: c is loaded with a free slot (parallel 2)
    and one request in flight; an interactive request for a must stop c, so it waits for
    c to drain. A normal request for `fixed` (pin: c) would keep c busy longer: it is not
    granted c, and stays unbound; a is loaded first, then c again for it."""
    s, fx = sched("serial", {"fixed": SelectorConfig("pin", ("c",))}, {"c": READY},
                  parallel=2)
    busy = arrive(s, "c")
    hi = arrive(s, "a", priority=100)
    low = arrive(s, "fixed")
    assert fx.grants == [(busy, "c")] and fx.swaps == []
    assert low.model == "fixed" and s.queued() == [hi, low]
    done(s, fx, busy)
    assert fx.swaps == [("a", ["c"])] and low.model == "fixed"
    complete(s, fx, "a")
    assert fx.grants[-1] == (hi, "a")
    done(s, fx, hi)
    assert fx.swaps[-1] == ("c", ["a"]) and low.model == "c"
    complete(s, fx, "c")
    assert fx.grants[-1] == (low, "c")
