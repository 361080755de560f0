"""The serial scheduler (scheduling/core/serial.py): score = priority + swap affinity + aging.

Method as in test_fifo.py: call the `on_*` handlers directly with a FakeEffects; a swap
completes when a test delivers its SwapDone (`fx.finish_swap` sets the states the shell would
leave), a request when it delivers its ServeDone. Time is the `now` each event carries. Models
a, b, c are ungrouped, hence mutually exclusive (the implicit `(default)` group).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import READY, STOPPED
from scheduling.core.errors import ConcurrencyLimit, ModelNotFound, ShuttingDown, SwapFailed
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
from scheduling.core.handover import HandoverError, SchedulerState
from scheduling.core.ledger import InvariantViolation
from scheduling.core.policies import make_scheduler
from scheduling.core.serial import Serial
from scheduling.core.stats import SchedulerStats
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, StubSwapper, arrive, make_config, req

PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)
DUO = Group("duo", frozenset({"a", "b"}), swap=True, exclusive=False)


def config(models=("a", "b", "c"), groups=(), swapper=None, bonus=10, divisor=60.0,
           kind="serial") -> SchedulerConfig:
    return replace(make_config(models, groups, swapper), scheduler=kind,
                   swap_affinity_bonus=bonus, aging_divisor=divisor)


def serial(models=("a", "b", "c"), groups=(), states=None, swapper=None, bonus=10,
           divisor=60.0) -> tuple[Serial, FakeEffects]:
    fx = FakeEffects(states)
    return Serial(config(models, groups, swapper, bonus, divisor), fx), fx


def complete(s, fx: FakeEffects, model: str, now: float = 0.0, **kw) -> None:
    s.on_swap_done(fx.finish_swap(model, now=now, **kw))


def done(s, fx: FakeEffects, r: Request, now: float = 0.0) -> None:
    fx.closed.add(r)
    s.on_serve_done(ServeDone(r, now))


def open_grants(fx: FakeEffects, model: str | None = None) -> list[Request]:
    return [r for r, m in fx.grants if r not in fx.closed and (model is None or m == model)]


def run_to_quiet(s, fx: FakeEffects, now: float = 0.0) -> None:
    """Finish swaps and serves, one event at a time (oldest grant first), until nothing is
    left to do."""
    for _ in range(1000):
        if s.active_swaps():
            complete(s, fx, next(iter(s.active_swaps())), now)
        elif open_grants(fx):
            done(s, fx, open_grants(fx)[0], now)
        else:
            return
    raise AssertionError("never quiet")


# ---- the specification's example ------------------------------------------------------------


def test_serial_abca_with_affinity_is_served_aabc():
    """A loaded and idle, `A B C A` arriving together at equal priority, parallel 1: the
    second A scores bonus 10 above B and C and is served before any swap (A A B C), which is
    the whole point of swap affinity: one swap fewer than arrival order."""
    s, fx = serial(states={"a": READY})
    a1, b, c, a2 = (arrive(s, m, now=0.0) for m in "abca")
    assert fx.grants == [(a1, "a")] and fx.swaps == []
    assert s.queued() == [a2, b, c]  # a2 is first: 0 + 10 beats 0 + 0
    done(s, fx, a1)  # A idle: a2 is the best and A has a free slot
    assert fx.grants[-1] == (a2, "a") and fx.swaps == []
    done(s, fx, a2)  # b and c tie on score: b arrived first
    assert fx.swaps == [("b", ["a"])] and s.active_swaps() == {"b": [b]}
    complete(s, fx, "b")
    assert fx.grants[-1] == (b, "b")
    done(s, fx, b)
    assert fx.swaps[-1] == ("c", ["b"])
    complete(s, fx, "c")
    done(s, fx, c)
    assert [r for r, _ in fx.grants] == [a1, a2, b, c]
    assert [m for m, _ in fx.swaps] == ["b", "c"]
    assert s.queued() == [] and all(s.reserved(m) == 0 for m in "abc")


def test_serial_abca_without_affinity_is_served_abca():
    """With swapAffinityBonus 0 equal priorities are served strictly by arrival: A B C A,
    and while B waits for A to drain nothing new is fed to A (the second A waits its turn)."""
    s, fx = serial(states={"a": READY}, bonus=0)
    a1, b, c, a2 = (arrive(s, m, now=0.0) for m in "abca")
    assert fx.grants == [(a1, "a")]
    assert s.queued() == [b, c, a2]
    done(s, fx, a1)
    assert fx.swaps == [("b", ["a"])] and fx.grants == [(a1, "a")]
    complete(s, fx, "b")
    done(s, fx, b)
    assert fx.swaps[-1] == ("c", ["b"])
    complete(s, fx, "c")
    done(s, fx, c)
    assert fx.swaps[-1] == ("a", ["c"])
    complete(s, fx, "a")
    done(s, fx, a2)
    assert [r for r, _ in fx.grants] == [a1, b, c, a2]


# ---- score: priority, aging, ties -------------------------------------------------------------


def test_serial_priority_beats_arrival():
    """A later request with a higher priority is served first: ordering by arrival would
    leave interactive work behind batch work."""
    s, fx = serial(states={"a": READY})
    a = arrive(s, "a")
    b = arrive(s, "b", priority=0)
    c = arrive(s, "c", priority=5)
    assert s.queued() == [c, b]
    done(s, fx, a)
    assert fx.swaps == [("c", ["a"])]
    assert s.queued() == [b]


def test_serial_aging_beats_priority_after_bound():
    """Aging: a batch request that has waited long enough beats a fresh normal one, so batch
    work cannot starve. By hand, divisor 1 s, bonus 10: batch b (-100, arrived 0) scores
    -100 + t; a fresh normal request for the loaded a scores 0 + 10 + 0 = 10. The batch
    request wins once t > 110: at t = 109 the fresh a request is served, at t = 111 b is."""
    s, fx = serial(states={"a": READY}, divisor=1.0)
    a0 = arrive(s, "a", now=0.0)
    b = arrive(s, "b", priority=-100, now=0.0)
    a1 = arrive(s, "a", now=109.0)
    assert s.score(b, 109.0) == pytest.approx(9.0) and s.score(a1, 109.0) == 10.0
    done(s, fx, a0, now=109.0)
    assert fx.grants[-1] == (a1, "a") and fx.swaps == []
    a2 = arrive(s, "a", now=111.0)
    assert s.score(b, 111.0) == pytest.approx(11.0) and s.score(a2, 111.0) == 10.0
    assert s.queued() == [b, a2]
    done(s, fx, a1, now=111.0)
    assert fx.swaps == [("b", ["a"])] and s.queued() == [a2]
    complete(s, fx, "b", now=112.0)
    assert fx.grants[-1] == (b, "b")
    assert b.dispatch.queue_wait == 112.0


def test_serial_ties_go_to_earlier_arrival():
    """Equal scores are served by arrival (smaller seq): equal priority at the same instant,
    and also a later request whose higher priority exactly cancels the earlier one's aging
    (divisor 1: 0 + (t - 0) == 10 + (t - 10)). A reversed or missing tie-break would serve
    the later one first."""
    s, fx = serial(states={"a": READY}, divisor=1.0, bonus=0)
    a = arrive(s, "a", now=0.0)
    c = arrive(s, "c", now=0.0)
    b = arrive(s, "b", now=0.0)
    assert s.queued() == [c, b]  # c arrived first, although "b" < "c"
    x = arrive(s, "b", priority=0, now=5.0)
    y = arrive(s, "c", priority=5, now=10.0)  # scores: x = t - 5, y = 5 + t - 10 = t - 5
    assert s.score(x, 20.0) == s.score(y, 20.0)
    assert s.queued() == [c, b, x, y]
    done(s, fx, a, now=20.0)
    assert fx.swaps == [("c", ["a"])]


def test_serial_parallel_one_holds_others_in_scheduler():
    """parallel 1: one request at a time goes to the upstream and the others wait here, in
    score order; forwarding them all would let the upstream's own queue decide the order."""
    s, fx = serial({"a": ModelConfig(parallel=1)}, states={"a": READY})
    a1 = arrive(s, "a")
    a2 = arrive(s, "a", priority=-5)
    a3 = arrive(s, "a", priority=5)
    assert fx.grants == [(a1, "a")] and s.in_flight("a") == 1
    assert s.queued() == [a3, a2]
    done(s, fx, a1)
    assert fx.grants[-1] == (a3, "a") and s.in_flight("a") == 1
    done(s, fx, a3)
    assert fx.grants[-1] == (a2, "a")


def test_serial_parallel_two_grants_two():
    """parallel 2: two requests are served at once, the third waits for a free slot; after
    a swap, its waiters are granted in score order up to parallel."""
    s, fx = serial({"a": ModelConfig(parallel=2), "b": ModelConfig(parallel=2)},
                   states={"a": READY})
    a1, a2, a3 = arrive(s, "a"), arrive(s, "a"), arrive(s, "a")
    assert [r for r, _ in fx.grants] == [a1, a2] and s.queued() == [a3]
    done(s, fx, a1)
    assert fx.grants[-1] == (a3, "a") and s.in_flight("a") == 2
    done(s, fx, a2)
    done(s, fx, a3)
    b1 = arrive(s, "b", priority=1)
    b2 = arrive(s, "b", priority=3)
    b3 = arrive(s, "b", priority=2)
    assert s.active_swaps() == {"b": [b1, b2, b3]}
    complete(s, fx, "b")
    assert [r for r, _ in fx.grants[-2:]] == [b2, b3] and s.queued() == [b1]


# ---- never delay the top request; dispatch what cannot delay it -------------------------------


def test_serial_never_evicts_model_with_requests_in_flight():
    """A higher-priority request for B waits for every A request to finish: stopping A
    would cut its clients off mid-response."""
    s, fx = serial({"a": ModelConfig(parallel=2), "b": ModelConfig()}, states={"a": READY})
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    b = arrive(s, "b", priority=100)
    assert fx.swaps == [] and s.queued() == [b]
    done(s, fx, a1)
    assert fx.swaps == []
    done(s, fx, a2)
    assert fx.swaps == [("b", ["a"])]


def test_serial_does_not_feed_model_the_top_request_waits_to_evict():
    """While the top request (B) waits for A to drain, a lower request for A must not be
    granted even though A has a free slot: each one would push B back by a whole service
    time (fifo's fast path starvation). A request for A that scores above B is granted."""
    s, fx = serial({"a": ModelConfig(parallel=2), "b": ModelConfig()}, states={"a": READY})
    a1 = arrive(s, "a")
    b = arrive(s, "b", priority=50)
    a2 = arrive(s, "a")  # 0 + 10 < 50: A has a free slot, but B needs A stopped
    assert fx.grants == [(a1, "a")] and s.queued() == [b, a2]
    a3 = arrive(s, "a", priority=45)  # 45 + 10 > 50: ahead of B, so it may go
    assert fx.grants[-1] == (a3, "a")
    done(s, fx, a1)
    assert fx.swaps == [] and fx.grants[-1] == (a3, "a")
    done(s, fx, a3)
    assert fx.swaps == [("b", ["a"])] and s.queued() == [a2]


def test_serial_lower_request_on_unrelated_co_runnable_model_is_dispatched():
    """A lower-scoring request runs before a blocked higher one when it cannot delay it:
    B (group duo, swap) waits for busy A; P is loaded in a non-exclusive group B does not
    evict, and Q loads beside everything. Holding them would idle the box for nothing."""
    s, fx = serial(("a", "b", "p", "q"), groups=[DUO, PAIR], states={"a": READY, "p": READY})
    a1 = arrive(s, "a")
    b = arrive(s, "b", priority=100)
    p = arrive(s, "p", priority=-100)
    q = arrive(s, "q", priority=-100)
    assert s.queued() == [b]
    assert fx.grants == [(a1, "a"), (p, "p")]
    assert fx.swaps == [("q", [])] and s.active_swaps() == {"q": [q]}
    done(s, fx, a1)
    assert fx.swaps[-1] == ("b", ["a"])


def test_serial_lower_swap_that_would_delay_the_top_request_is_held():
    """A lower request must not start a swap the top one would then have to undo: X loads
    beside A, but B (waiting for busy A) evicts X too, so loading X now would add X's
    service and stop to B's wait. Y, which B leaves alone, does load."""
    swapper = StubSwapper({"b": ["a", "x"], "x": [], "y": []})
    s, fx = serial(("a", "b", "x", "y"), states={"a": READY}, swapper=swapper)
    a1 = arrive(s, "a")
    b = arrive(s, "b", priority=100)
    x = arrive(s, "x")
    arrive(s, "y")
    assert fx.swaps == [("y", [])] and s.queued() == [b, x]
    done(s, fx, a1)
    assert fx.swaps[-1] == ("b", ["a", "x"]) and s.queued() == [x]


def test_serial_lower_swap_beside_a_loading_higher_one_is_held():
    """Requests waiting on a swap are in the order too: while exclusive B loads for a higher
    request, Q (non-exclusive, so its swap does not collide with B's) must not load beside
    it, or B's waiters would find Q to evict after their own swap (llama-swap's
    exclusive-group gotcha). Once B's request is served, nothing waits on B: Q loads."""
    s, fx = serial(("b", "p", "q"), groups=[PAIR])
    b = arrive(s, "b", priority=100)
    q = arrive(s, "q")
    assert fx.swaps == [("b", [])] and s.queued() == [q]
    complete(s, fx, "b")
    assert fx.grants == [(b, "b")] and fx.swaps == [("b", []), ("q", [])]


def test_serial_swap_waiters_wait_for_swap_done_then_score_order():
    """Requests for a model being loaded join that swap (one swap, not one per request)
    and are granted when it is done, best score first, up to parallel."""
    s, fx = serial()
    a1 = arrive(s, "a", priority=-10)
    a2 = arrive(s, "a", priority=10)
    assert fx.swaps == [("a", [])] and s.active_swaps() == {"a": [a1, a2]}
    complete(s, fx, "a")
    assert fx.grants == [(a2, "a")] and s.queued() == [a1]


def test_serial_higher_request_overtakes_swap_waiters_after_swap():
    """After a swap, one dispatch order still holds: a request that arrived during the swap
    and outscores the waiters (beyond the bonus) is served first, even if it must evict the
    just-loaded model (it is idle)."""
    s, fx = serial()
    a = arrive(s, "a", priority=-100)
    b = arrive(s, "b", priority=100)
    assert fx.swaps == [("a", [])] and s.queued() == [b]
    complete(s, fx, "a")
    assert fx.grants == [] and fx.swaps[-1] == ("b", ["a"]) and s.queued() == [a]


# ---- affinity ------------------------------------------------------------------------------------


def test_serial_affinity_bonus_is_clamped_to_99():
    """An out-of-range bonus (500) acts as 99: it can reorder within a band but never lets a
    loaded model's request overtake one 100 points higher at equal age."""
    s, fx = serial(states={"a": READY}, bonus=500)
    a0 = arrive(s, "a")
    lo = arrive(s, "a", priority=0)
    hi = arrive(s, "b", priority=100)
    mid = arrive(s, "c", priority=98)
    assert s.queued() == [hi, lo, mid]  # 100 > 0 + 99 > 98
    assert s.score(lo, 0.0) == 99
    done(s, fx, a0)
    assert fx.swaps == [("b", ["a"])]
    s2, _ = serial(states={"a": READY}, bonus=-5)
    r = arrive(s2, "a")
    assert r.dispatch.affinity == 0  # negative clamps to 0


def test_serial_no_affinity_for_models_being_evicted_or_unloaded():
    """Only a model that stays loaded earns the bonus: one an active swap is stopping, or
    one being unloaded, does not (its requests would otherwise be ranked for a process that
    is going away)."""
    s, fx = serial(("a", "b", "p", "q"), groups=[DUO, PAIR], states={"a": READY, "p": READY})
    arrive(s, "a")  # a busy, stays loaded
    pr = arrive(s, "p")  # p loaded beside it
    done(s, fx, pr)
    assert s.score(req("p"), 0.0) == 10 and s.score(req("a"), 0.0) == 10
    assert s.score(req("q"), 0.0) == 0
    s.on_unload(UnloadRequested(("p",), 0.0))
    assert s.score(req("p"), 0.0) == 0
    s2, fx2 = serial(("a", "b"), groups=[DUO], states={"a": READY})
    arrive(s2, "b")  # b evicts idle a (same swap group)
    assert fx2.swaps == [("b", ["a"])]
    assert s2.score(req("a"), 0.0) == 0 and s2.score(req("b"), 0.0) == 10  # committed target


# ---- settings changes -------------------------------------------------------------------------


def test_serial_settings_change_bonus_reranks_at_once():
    """A bonus change re-ranks the queue immediately (positions re-reported), not only for
    later arrivals, and keeps every queued request."""
    s, fx = serial(states={"a": READY}, bonus=0)
    a1 = arrive(s, "a")
    b, c, a2 = arrive(s, "b"), arrive(s, "c"), arrive(s, "a")
    assert s.queued() == [b, c, a2]
    s.on_settings_changed(SettingsChanged(config(bonus=50), 1.0))
    assert s.queued() == [a2, b, c] and s.reserved("a") == 2
    assert [fx.position(r) for r in (a2, b, c)] == [1, 2, 3]
    done(s, fx, a1, now=1.0)
    assert fx.grants[-1] == (a2, "a")


def test_serial_settings_change_divisor_flips_order():
    """A new agingDivisor re-keys the heaps: at t = 100, x (0, arrived 0) vs y (5, arrived
    100): divisor 60 → x = 1.67 < y = 5; divisor 10 → x = 10 > y = 5. Stale keys would keep
    the old order forever."""
    s, fx = serial(states={"a": READY}, divisor=60.0)
    a = arrive(s, "a", now=0.0)
    x = arrive(s, "b", now=0.0)
    y = arrive(s, "c", priority=5, now=100.0)
    assert s.queued() == [y, x]
    s.on_settings_changed(SettingsChanged(config(divisor=10.0), 100.0))
    assert s.queued() == [x, y]
    done(s, fx, a, now=100.0)
    assert fx.swaps == [("b", ["a"])]


def test_serial_settings_change_removes_model_404():
    """Requests for a model the new settings no longer define get 404 (queued or waiting on
    a swap), and free their slots; the rest stay queued."""
    s, fx = serial(("a", "b", "c", "d"), states={"a": READY})
    a = arrive(s, "a")
    b, c = arrive(s, "b"), arrive(s, "c")
    s.on_settings_changed(SettingsChanged(config(("a", "c", "d")), 1.0))
    assert isinstance(fx.error_of(b), ModelNotFound) and s.reserved("b") == 0
    assert s.queued() == [c]
    done(s, fx, a)
    assert fx.swaps[-1] == ("c", ["a"])
    d = arrive(s, "d")
    s.on_settings_changed(SettingsChanged(config(("a", "c")), 2.0))
    assert isinstance(fx.error_of(d), ModelNotFound)
    s3, fx3 = serial()
    w = arrive(s3, "a")
    s3.on_settings_changed(SettingsChanged(config(("b",)), 1.0))
    assert isinstance(fx3.error_of(w), ModelNotFound) and s3.active_swaps() == {"a": []}


def test_serial_aging_alone_changes_nothing():
    """Aging alone never reorders waiting requests (every score grows alike): an event that
    changes nothing else (a restart of a model that is not running), handled long after the
    arrivals, walks the queue and must not grant, swap or re-report positions."""
    s, fx = serial(states={"a": READY})
    arrive(s, "a")
    b = arrive(s, "b", priority=-100)
    c = arrive(s, "c")
    fx.clear()
    s.on_restart(RestartRequested(("b",), 1e6))
    assert s.now == 1e6 and s.restart_pending() == frozenset()
    assert s.queued() == [c, b]
    assert (fx.swaps, fx.grants, fx.errors, fx.positions) == ([], [], [], [])


# ---- fifo: header priority and dispatch record -------------------------------------------------


def test_fifo_adds_header_priority_to_model_priority():
    """fifo orders by its per-model priority plus the header, so the header is not silently
    ignored there; its Dispatch record says so (score = priority = the sum, no aging or
    affinity)."""
    fx = FakeEffects({"a": READY})
    models = {"a": ModelConfig(), "b": ModelConfig(fifo_priority=5), "c": ModelConfig()}
    s = Fifo(config(models, kind="fifo"), fx)
    a = arrive(s, "a", now=0.0)
    b = arrive(s, "b", now=1.0)  # 5 + 0
    c = arrive(s, "c", priority=7, now=2.0)  # 0 + 7
    assert s.queued() == [c, b]
    s.on_serve_done(ServeDone(a, 10.0))
    assert fx.swaps[-1] == ("c", ["a"])
    s.on_swap_done(fx.finish_swap("c", now=12.0))
    assert c.dispatch is not None
    assert (c.dispatch.band, c.dispatch.score, c.dispatch.priority, c.dispatch.affinity,
            c.dispatch.aging, c.dispatch.seq, c.dispatch.queue_wait) == \
        ("normal", 7, 7, 0, 0, c.seq, 10.0)
    assert a.dispatch.queue_wait == 0.0
    assert s.stats().dispatched == {"interactive": 0, "normal": 2, "batch": 0}
    assert s.stats().pick_changed_by_aging == s.stats().pick_changed_by_affinity == 0


# ---- dispatch record, stats, snapshot ---------------------------------------------------------


def test_serial_dispatch_record_parts_add_up():
    """Every grant carries its score and the parts it is made of, so the activity log can
    explain the order: priority + affinity + aging == score; queue wait from arrival."""
    s, fx = serial(states={"a": READY}, divisor=60.0)
    a = arrive(s, "a", now=0.0)
    b = arrive(s, "b", priority=-70, now=0.0)
    assert a.dispatch is not None and b.dispatch is None
    done(s, fx, a, now=30.0)
    complete(s, fx, "b", now=45.0)
    d = b.dispatch
    assert (d.band, d.priority, d.affinity, d.seq) == ("batch", -70, 10.0, b.seq)
    assert d.aging == pytest.approx(45.0 / 60.0) and d.queue_wait == 45.0
    assert d.score == pytest.approx(d.priority + d.affinity + d.aging)


def test_serial_dispatch_is_set_before_grant_serve():
    """The shell reads `req.dispatch` inside grant_serve (activity log, metrics); setting it
    after would log a grant without its reason."""
    seen = []

    class Recording(FakeEffects):
        def grant_serve(self, r, model):
            seen.append(r.dispatch)
            return super().grant_serve(r, model)

    fx = Recording({"a": READY})
    s = Serial(config(), fx)
    arrive(s, "a", priority=100)
    assert seen and seen[0] is not None and seen[0].band == "interactive"


def test_serial_stats_affinity_changed_pick():
    """The affinity counter moves exactly when the winner without the bonus would have been
    another request (A A B C: a2 beats the earlier b only by its bonus) and not otherwise
    (bonus 0)."""
    s, fx = serial(states={"a": READY})
    for m in "abca":
        arrive(s, m)
    run_to_quiet(s, fx)
    st = s.stats()
    assert (st.pick_changed_by_affinity, st.pick_changed_by_aging) == (1, 0)
    s0, fx0 = serial(states={"a": READY}, bonus=0)
    for m in "abca":
        arrive(s0, m)
    run_to_quiet(s0, fx0)
    assert s0.stats().pick_changed_by_affinity == 0


def test_serial_stats_aging_changed_pick():
    """The aging counter moves when the old batch request wins only by its wait (without
    aging the fresh normal one would win), and not when priority alone decides."""
    s, fx = serial(states={"a": READY}, divisor=1.0, bonus=0)
    a = arrive(s, "a", now=0.0)
    b = arrive(s, "b", priority=-100, now=0.0)
    c = arrive(s, "c", now=150.0)
    done(s, fx, a, now=151.0)  # b: -100 + 151 = 51 > c: 0 + 1
    assert fx.swaps[-1] == ("b", ["a"])
    assert s.stats().pick_changed_by_aging == 1
    complete(s, fx, "b", now=152.0)  # b is the only ready candidate... c still queued
    assert s.stats().pick_changed_by_aging == 2  # b (51+) over c again, by aging only
    done(s, fx, b, now=153.0)
    complete(s, fx, "c", now=154.0)  # c alone: not counted
    assert s.stats().pick_changed_by_aging == 2
    s2, fx2 = serial(states={"a": READY}, divisor=1.0, bonus=0)
    a = arrive(s2, "a", now=0.0)
    arrive(s2, "b", priority=10, now=0.0)
    arrive(s2, "c", now=5.0)
    done(s2, fx2, a, now=6.0)  # b wins on priority alone
    assert s2.stats().pick_changed_by_aging == 0 and c is not None


def test_serial_stats_dispatched_per_band_and_only_received_grants():
    """Dispatches are counted per band of the request's own priority, every band always
    present; a grant the client never received (it left) is not counted."""
    s, fx = serial({"a": ModelConfig(parallel=10)}, states={"a": READY})
    assert s.stats().dispatched == {"interactive": 0, "normal": 0, "batch": 0}
    for p in (100, 50, 49, 0, -49, -50, -100):
        arrive(s, "a", priority=p)
    gone = req("a", priority=100)
    fx.gone.add(gone)
    s.on_request(RequestArrived(gone, 0.0))
    assert s.stats().dispatched == {"interactive": 2, "normal": 3, "batch": 2}
    st = s.stats()
    st.dispatched["batch"] = 99  # a copy: the caller cannot corrupt the counters
    assert s.stats().dispatched["batch"] == 2


def test_serial_waiting_by_band():
    """Depth and oldest arrival per band, counting swap waiters too; every band present even
    when empty (a missing label would make the gauge vanish instead of reading 0)."""
    s, _ = serial(states={"a": READY})
    assert s.waiting_by_band() == {"interactive": (0, None), "normal": (0, None),
                                   "batch": (0, None)}
    arrive(s, "a", now=0.0)  # granted: not waiting
    arrive(s, "b", priority=-100, now=1.0)
    arrive(s, "b", priority=-60, now=3.0)
    arrive(s, "c", priority=100, now=4.0)
    assert s.waiting_by_band() == {"interactive": (1, 4.0), "normal": (0, None),
                                   "batch": (2, 1.0)}
    s2, _ = serial()
    arrive(s2, "a", priority=7, now=2.0)  # waits on the swap
    assert s2.waiting_by_band()["normal"] == (1, 2.0)


def test_serial_pick_returns_winner_without_side_effects():
    """`pick(now)` (used by bench/scheduler_pick.py) names the current best queued request
    and changes nothing: no grant, no swap, no position report."""
    s, fx = serial(states={"a": READY})
    assert s.pick(0.0) is None
    arrive(s, "a")
    b = arrive(s, "b", priority=-100, now=0.0)
    c = arrive(s, "c", now=0.0)
    fx.clear()
    assert s.pick(0.0) is c
    assert s.pick(0.0) is c and s.queued() == [c, b]
    assert (fx.swaps, fx.grants, fx.positions) == ([], [], [])
    s.on_cancel(Cancelled(c, 1.0))
    assert s.pick(1.0) is b


def test_serial_pick_scales_to_100k_queued():
    """The pick stays correct with 100k queued over several models (heaps, lazy deletion),
    built through the handover path that bulk-loads a queue."""
    fx = FakeEffects({"a": READY})
    models = {m: ModelConfig(concurrency_limit=10**6) for m in "abcd"}
    served = req("a")
    queued = [Request(i, "abcd"[i % 4], float(i % 1000), (i * 7919) % 201 - 100)
              for i in range(1, 100_001)]
    state = SchedulerState(queued=queued, serving={served: "a"})
    s = Serial.from_state(state, config(models), fx)
    best = max(queued, key=lambda r: (s.score(r, 2000.0), -r.seq))
    assert s.pick(2000.0) is best
    for _ in range(2):  # lazy deletion: a cancelled head is skipped
        s.on_cancel(Cancelled(best, 2000.0))
        queued.remove(best)
        best = max(queued, key=lambda r: (s.score(r, 2000.0), -r.seq))
        assert s.pick(2000.0) is best


# ---- handover -----------------------------------------------------------------------------------


def _holders(s) -> set[Request]:
    return {*s.queued(), *(w for ws in s.active_swaps().values() for w in ws)}


def test_handover_fifo_to_serial_to_fifo_keeps_every_request():
    """Switching the policy live keeps the queue, the active swap with its waiters, the
    in-flight requests and the slot counts, and every request is later served exactly once:
    a lossy switch would hang clients or evict a busy model."""
    models = {m: ModelConfig(parallel=1) for m in ("a", "b", "c", "p", "q")}
    fx = FakeEffects({"a": READY})
    fifo_cfg = config(models, groups=[PAIR], kind="fifo")
    serial_cfg = config(models, groups=[PAIR], kind="serial")
    f = make_scheduler(fifo_cfg, fx)
    assert type(f) is Fifo
    a1, a2 = arrive(f, "a"), arrive(f, "a")  # fifo ignores parallel: both in flight
    p1, p2 = arrive(f, "p"), arrive(f, "p")  # p loads beside a (non-exclusive pair)
    b, c = arrive(f, "b"), arrive(f, "c", priority=5)
    assert f.in_flight("a") == 2 and f.active_swaps() == {"p": [p1, p2]}
    before = {m: f.reserved(m) for m in models}
    stats_before = f.stats()

    s = make_scheduler(serial_cfg, fx, previous=f)
    assert type(s) is Serial
    assert s.in_flight("a") == 2 and s.active_swaps() == {"p": [p1, p2]}
    assert set(s.queued()) == {b, c} and s.queued() == [c, b]
    assert {m: s.reserved(m) for m in models} == before
    assert s.stats() == stats_before
    assert f.queued() == [] and f.in_flight("a") == 0  # the old one holds nothing
    late = arrive(f, "a")
    assert isinstance(fx.error_of(late), ShuttingDown)  # and refuses rather than loses
    with pytest.raises(InvariantViolation):
        f.on_serve_done(ServeDone(a1, 0.0))

    s.on_swap_done(fx.finish_swap("p"))  # serial: parallel 1 → p1 granted, p2 queued
    assert fx.grants[-1] == (p1, "p") and set(s.queued()) == {b, c, p2}

    f2 = make_scheduler(fifo_cfg, fx, previous=s)
    assert type(f2) is Fifo
    assert fx.grants[-1] == (p2, "p")  # fifo's fast path: p ready, evicts nothing
    assert f2.queued() == [c, b] and f2.in_flight("a") == 2 and f2.in_flight("p") == 2
    assert f2.reserved("a") == 2 and f2.reserved("p") == 2
    run_to_quiet(f2, fx)
    granted = [r for r, _ in fx.grants]
    assert sorted(r.seq for r in granted) == sorted(r.seq for r in (a1, a2, p1, p2, b, c))
    assert len(set(granted)) == len(granted)
    assert all(f2.reserved(m) == 0 for m in models)


def test_handover_applies_settings_and_keeps_unloads_and_shutdown():
    """The adopting scheduler applies the new settings (404 for models they drop), keeps
    pending unloads (no grant to a model being stopped) and a shutdown flag."""
    fx = FakeEffects({"a": READY})
    f = Fifo(config(("a", "b", "c"), kind="fifo"), fx)
    a = arrive(f, "a")
    b = arrive(f, "b")
    f.on_unload(UnloadRequested(("c",), 0.0))
    s = make_scheduler(config(("a", "c")), fx, previous=f)
    assert isinstance(fx.error_of(b), ModelNotFound)
    c = arrive(s, "c")
    assert s.queued() == [c]
    fx.states["c"] = STOPPED
    s.on_unload_done(UnloadDone(("c",), 1.0))
    assert s.queued() == [c]  # still waits for busy a
    done(s, fx, a)
    assert fx.swaps[-1] == ("c", ["a"])
    s.on_shutdown(Shutdown(2.0))
    f3 = make_scheduler(config(("a", "c"), kind="fifo"), fx, previous=s)
    assert isinstance(fx.error_of(arrive(f3, "a")), ShuttingDown)


def test_make_scheduler_same_kind_and_unknown():
    """The same kind keeps the scheduler (only on_settings_changed); an unknown kind is a
    ValueError, not a silent default; a corrupt state is refused."""
    fx = FakeEffects()
    s = make_scheduler(config(), fx)
    assert make_scheduler(s.config, fx, previous=s) is s
    new = config(bonus=20)
    assert make_scheduler(new, fx, previous=s) is s and s.config is new
    with pytest.raises(ValueError):
        make_scheduler(replace(config(), scheduler="lottery"), fx)
    r = req("a")
    with pytest.raises(HandoverError):
        Serial.from_state(SchedulerState(queued=[r], serving={r: "a"}), config(), fx)


# ---- safety rules kept from fifo ---------------------------------------------------------------


def test_serial_unknown_model_is_404():
    """An undefined model is answered 404 at once, nothing reserved or loaded."""
    s, fx = serial()
    r = arrive(s, "ghost")
    assert isinstance(fx.error_of(r), ModelNotFound)
    assert fx.swaps == [] and s.reserved("ghost") == 0 and s.queued() == []


def test_serial_concurrency_limit_counts_queued_waiting_and_serving():
    """concurrencyLimit is reserved at admission and covers queued, swap-waiting and served
    requests (429 with Retry-After); serial's own hold-back queue must not over-admit."""
    models = {"a": ModelConfig(concurrency_limit=2), "b": ModelConfig()}
    s, fx = serial(models, states={"b": READY})
    b1 = arrive(s, "b")
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    assert s.queued() == [a1, a2]
    err = fx.error_of(arrive(s, "a"))
    assert isinstance(err, ConcurrencyLimit) and err.headers() == {"Retry-After": "1"}
    done(s, fx, b1)
    assert s.active_swaps() == {"a": [a1, a2]}
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)
    complete(s, fx, "a")
    assert s.in_flight("a") == 1 and s.queued() == [a2]  # parallel 1
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)
    done(s, fx, a1)
    assert s.reserved("a") == 1
    assert fx.error_of(arrive(s, "a")) is None


def test_serial_joins_active_swap():
    """Requests for a model already loading join that swap instead of starting another."""
    s, fx = serial()
    rs = [arrive(s, "a") for _ in range(3)]
    assert fx.swaps == [("a", [])] and s.active_swaps() == {"a": rs}


def test_serial_failed_swap_errors_all_waiters():
    """A failed start answers every waiter 502 (504 on timeout) and frees their slots; the
    next request starts its own swap."""
    s, fx = serial()
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    b = arrive(s, "b")
    complete(s, fx, "a", error="exit 1: CUDA out of memory")
    for r in (a1, a2):
        assert isinstance(fx.error_of(r), SwapFailed) and fx.error_of(r).status == 502
    assert s.reserved("a") == 0 and fx.swaps[-1] == ("b", [])
    assert s.active_swaps() == {"b": [b]}
    complete(s, fx, "b", error="slow", timed_out=True)
    assert fx.error_of(b).status == 504


def test_serial_cancel_queued_request_never_loads():
    """A client that left while queued must never cause a load, and frees its slot."""
    s, fx = serial(states={"a": READY})
    a = arrive(s, "a")
    b = arrive(s, "b", priority=100)
    s.on_cancel(Cancelled(b, 0.0))
    assert s.queued() == [] and s.reserved("b") == 0
    done(s, fx, a)
    assert fx.swaps == []
    s.on_cancel(Cancelled(b, 0.0))  # twice: ignored
    assert s.reserved("b") == 0


def test_serial_cancel_swap_waiter_and_granted_is_ignored():
    """A cancelled swap waiter is dropped (the swap still completes, granting nobody); a
    Cancelled for a granted request changes nothing (its ServeDone follows)."""
    s, fx = serial()
    a1 = arrive(s, "a")
    s.on_cancel(Cancelled(a1, 0.0))
    assert s.active_swaps() == {"a": []} and s.reserved("a") == 0
    complete(s, fx, "a")
    assert fx.grants == []
    a2 = arrive(s, "a")
    s.on_cancel(Cancelled(a2, 0.0))
    assert s.in_flight("a") == 1 and s.reserved("a") == 1


def test_serial_grant_refused_client_gone_not_in_flight():
    """A grant to a departed client is not counted in flight, or A could never be evicted."""
    s, fx = serial()
    a = arrive(s, "a")
    fx.gone.add(a)
    complete(s, fx, "a")
    assert fx.refused == [(a, "a")] and s.in_flight("a") == 0 and s.reserved("a") == 0
    arrive(s, "b")
    assert fx.swaps[-1] == ("b", ["a"])


def test_serial_unload_queues_requests_then_reloads():
    """During an unload, requests for the model queue (no grant to a dying process), swaps
    that would evict it wait, and UnloadDone starts a fresh swap."""
    s, fx = serial(states={"a": READY})
    handle = object()
    s.on_unload(UnloadRequested(("a",), 0.0, handle))
    assert fx.stops == [(("a",), handle)]
    a = arrive(s, "a", priority=100)
    b = arrive(s, "b")
    assert fx.grants == [] and fx.swaps == [] and s.queued() == [a, b]
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert fx.swaps == [("a", [])] and s.queued() == [b]
    complete(s, fx, "a")
    assert fx.grants == [(a, "a")]


def test_serial_unload_racing_swap():
    """A swap that loses the race to an unload errors its waiters; one that wins requeues
    them for a fresh swap after the unload (never a grant to a process being stopped)."""
    s, fx = serial()
    a1 = arrive(s, "a")
    s.on_unload(UnloadRequested(("a",), 0.0))
    a2 = arrive(s, "a")
    assert s.active_swaps() == {"a": [a1]} and s.queued() == [a2]
    complete(s, fx, "a", error="stopped by unload")
    assert isinstance(fx.error_of(a1), SwapFailed) and s.queued() == [a2]
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert s.active_swaps() == {"a": [a2]}

    s2, fx2 = serial()
    b1 = arrive(s2, "b")
    s2.on_unload(UnloadRequested(("b",), 0.0))
    complete(s2, fx2, "b")
    assert fx2.grants == [] and s2.queued() == [b1]
    fx2.states["b"] = STOPPED
    s2.on_unload_done(UnloadDone(("b",), 1.0))
    complete(s2, fx2, "b")
    assert fx2.grants == [(b1, "b")]


def test_serial_shutdown_errors_everyone_and_later_requests():
    """Shutdown answers 503 to every queued and waiting request and to later ones; requests
    in flight still close with their ServeDone."""
    s, fx = serial(("a", "b", "p", "q"), groups=[PAIR], states={"a": READY})
    a = arrive(s, "a")
    waiting = [arrive(s, "p"), arrive(s, "q")]
    queued = [arrive(s, "b"), arrive(s, "a")]
    assert len(s.queued()) == 2 and len(s.active_swaps()) == 2
    s.on_shutdown(Shutdown(1.0))
    for r in waiting + queued:
        assert isinstance(fx.error_of(r), ShuttingDown)
    assert isinstance(fx.error_of(arrive(s, "b")), ShuttingDown)
    complete(s, fx, "p")
    done(s, fx, a)
    assert s.in_flight("a") == 0 and all(s.reserved(m) == 0 for m in "abpq")
    assert [r for r, _ in fx.grants] == [a]


def test_serial_invariant_violations_raise():
    """A ServeDone for a request never granted (or twice) and a duplicate arrival are shell
    bugs: raising beats guessing, which would free someone else's slot."""
    s, fx = serial(states={"a": READY})
    a = arrive(s, "a")
    q = arrive(s, "a")
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(q, 0.0))
    with pytest.raises(InvariantViolation):
        s.on_request(RequestArrived(q, 0.0))
    done(s, fx, a)
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(a, 0.0))
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(req("b"), 0.0))


def test_serial_stale_swap_done_is_ignored():
    """A SwapDone with no active swap must not grant anyone or crash the loop."""
    s, fx = serial(states={"a": READY})
    s.on_swap_done(SwapDone("a", 0.0))
    s.on_swap_done(SwapDone("nope", 0.0, error="x"))
    assert fx.grants == [] and fx.errors == []


def test_serial_positions_reported_in_score_order():
    """Queued clients hear their position ("Queue position: #N") in score order, when it
    changes and only then."""
    s, fx = serial(states={"a": READY})
    arrive(s, "a")
    b = arrive(s, "b")
    assert fx.positions == [(b, 1)]
    c = arrive(s, "c", priority=1)
    assert fx.positions[1:] == [(c, 1), (b, 2)]
    d = arrive(s, "b", priority=-1)
    assert fx.positions[3:] == [(d, 3)]
    s.on_cancel(Cancelled(c, 0.0))
    assert fx.positions[4:] == [(b, 1), (d, 2)]


def test_serial_positions_not_reported_when_the_config_says_no_one_listens():
    """A replay (scheduling/replay.py) has no client to tell; the same order, no reports."""
    s, fx = serial(states={"a": READY})
    s = Serial(replace(s.config, report_positions=False), fx)
    arrive(s, "a")
    b = arrive(s, "b")
    c = arrive(s, "c", priority=1)
    assert fx.positions == [] and s.queued() == [c, b]


def test_serial_satisfies_scheduler_shape():
    """The shell dispatches by these names and the bench and metrics read these."""
    s, _ = serial()
    for name in ("on_request", "on_cancel", "on_swap_done", "on_serve_done", "on_unload",
                 "on_unload_done", "on_settings_changed", "on_restart", "on_model_exited",
                 "on_shutdown",
                 "queued", "in_flight", "reserved", "active_swaps", "pick", "stats",
                 "waiting_by_band", "export_state", "from_state"):
        assert callable(getattr(s, name))
    assert isinstance(s.config, SchedulerConfig) and isinstance(s.stats(), SchedulerStats)
