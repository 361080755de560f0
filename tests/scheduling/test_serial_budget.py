"""Serial's affinity budget (issue 23; scheduling/core/budget.py), by hand.

Method as in test_serial.py: the `on_*` handlers are called directly with a FakeEffects, time
is the `now` each event carries; the longer traces go through the product's replay
(scheduling/replay.py: a virtual clock, swaps and services of fixed length), whose timeline
each test works out by hand in its docstring. Models a, b, c are ungrouped, hence one at a
time.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from scheduling.core.effects import READY
from scheduling.core.events import Cancelled, SettingsChanged
from scheduling.core.serial import Serial
from scheduling.replay import Row, replay
from tests.scheduling.fakes import FakeEffects, arrive, make_config
from tests.scheduling.test_serial import complete, done


def config(budget=0.0, swaps=0.0, assumed=10.0, bonus=10, divisor=60.0, models=("a", "b", "c")):
    return replace(make_config(models), scheduler="serial", swap_affinity_bonus=bonus,
                   aging_divisor=divisor, affinity_budget=budget, affinity_budget_swaps=swaps,
                   assumed_swap_cost=assumed, report_positions=True)


def trap(b_at: float = 1.0, until: float = 200.0) -> list[Row]:
    """The starvation trap in miniature: a steady stream to a (every 4 s, 5 s each: a always
    has one queued when it finishes one) and one b at `b_at`."""
    rows = [Row(4.0 * i, "a", 0, 5.0) for i in range(int(until / 4))]
    rows.append(Row(b_at, "b", 0, 5.0))
    return sorted(rows, key=lambda r: r.arrival)


def b_job(run):
    return next(j for j in run.jobs if j.row.model == "b")


def test_trap_without_a_budget_b_waits_for_the_whole_stream():
    """As today (the budget is off by default): every a of the stream arrived within
    bonus x divisor = 600 s of b, so each outscores it; the 50 a's take 250 s, then b's swap
    (10 s): b is granted at 260, having waited 259 s, and the counter never moves."""
    run = replay(trap(), config(), swap_cost=10.0, preload=["a"])
    j = b_job(run)
    assert j.granted == 260.0
    assert j.dispatch is not None and not j.dispatch.budget_override
    assert run.stats is not None and run.stats.affinity_budget_overrides == 0
    assert run.swaps == 1


def test_trap_with_a_budget_b_waits_the_budget_then_its_swap():
    """Budget 20 s. a0 runs 0-5. At 5 the pick is a1 (arrived 4) over b (arrived 1): b lost
    it only because of affinity; its clock starts at 5. It loses again at 10, 15 and 20
    (5, 10, 15 s < 20). At 25 it would lose a fifth time at 20 s >= 20: that pick is made
    again with b's model ranked as loaded, so b (older) wins, its swap runs 25-35 and it is
    granted at 35: kept back by affinity from 5 to 25, exactly the budget. Then the a's get
    their model back: a swap at 40, when b is done."""
    run = replay(trap(), config(budget=20.0), swap_cost=10.0, preload=["a"])
    j = b_job(run)
    assert j.granted == 35.0
    assert j.dispatch is not None and j.dispatch.budget_override
    assert j.dispatch.affinity == 10.0  # its model was lifted (and loaded by then)
    assert [(t, m) for t, m, _ in run.swap_log] == [(25.0, "b"), (40.0, "a")]
    assert run.stats is not None and run.stats.affinity_budget_overrides == 1
    others = [x for x in run.jobs if x is not j]
    assert not any(x.dispatch.budget_override for x in others)


def test_trap_budget_bound_is_budget_plus_the_service_running():
    """Budget 18 s: b's clock starts at 5 as above; at 20 it has lost for 15 s < 18, so a4
    runs 20-25; at 25 (20 s >= 18) it goes: kept back 20 s = budget + 2 s, within the budget
    plus one service (5 s), since picks come only when a service ends."""
    run = replay(trap(), config(budget=18.0), swap_cost=10.0, preload=["a"])
    assert b_job(run).granted == 35.0


def test_auto_budget_is_k_times_the_waiting_models_measured_swap():
    """`auto` with k = 2 and an assumed swap of 100 s. b is loaded first (its swap 0-7, so b's
    measured cost is 7 s, and its budget 14 s); a's load (7-14) makes a loaded; the stream to
    a starts at 14, one every 4 s, 5 s each, and a second b arrives at 15. By hand: a(14)
    runs 14-19; at 19 b (15) loses to a(18): clock at 19; 24: 5 s, 29: 10 s; at 34 it has
    lost for 15 s >= 14: it goes, swap 34-41. c, never loaded, has the assumed cost (100 s):
    a c at 15 instead waits well past 14 s of lost picks."""
    rows = [Row(0.0, "b", 0, 0.0), Row(7.0, "a", 0, 0.0)]
    stream = [Row(14.0 + 4 * i, "a", 0, 5.0) for i in range(60)]  # busy until 314
    with_b = sorted([*rows, *stream, Row(15.0, "b", 0, 5.0)], key=lambda r: r.arrival)
    run = replay(with_b, config(swaps=2, assumed=100.0), swap_cost=7.0)
    second_b = [j for j in run.jobs if j.row.model == "b"][1]
    assert second_b.granted == 41.0
    with_c = sorted([*rows, *stream, Row(15.0, "c", 0, 5.0)], key=lambda r: r.arrival)
    run = replay(with_c, config(swaps=2, assumed=100.0), swap_cost=7.0)
    c = next(j for j in run.jobs if j.row.model == "c")
    # 200 s of lost picks from 19: the pick at 219 (200 s) lets it go, swap 219-226
    assert c.granted == 226.0


def test_swap_cost_is_measured_from_the_events_nows():
    """The cost is SwapDone's now minus the now of the event that started the swap; a failed
    swap measures nothing."""
    fx = FakeEffects()
    s = Serial(config(swaps=6), fx)
    b = arrive(s, "b", now=3.0)
    assert fx.swaps == [("b", [])]
    complete(s, fx, "b", now=11.5)
    assert s.swap_costs() == {"b": 8.5}
    done(s, fx, b, now=12.0)
    arrive(s, "c", now=20.0)
    complete(s, fx, "c", now=90.0, error="it crashed")
    assert s.swap_costs() == {"b": 8.5}


def test_abca_is_still_aabc_with_a_budget_longer_than_the_reorder():
    """`A B C A` at equal priority with a budget of 30 s: the second A outscores B at the
    pick at t=2 (B's clock starts at 2; 2 s of lost picks, far below 30), so the order is
    still A A B C, with the same two swaps as without a budget."""
    fx = FakeEffects({"a": READY})
    s = Serial(config(budget=30.0), fx)
    a1, b, c, a2 = (arrive(s, m, now=0.0) for m in "abca")
    done(s, fx, a1, now=2.0)
    assert fx.grants[-1] == (a2, "a")
    done(s, fx, a2, now=4.0)
    assert fx.swaps == [("b", ["a"])]
    complete(s, fx, "b", now=14.0)
    done(s, fx, b, now=16.0)
    complete(s, fx, "c", now=26.0)
    assert [r for r, _ in fx.grants] == [a1, a2, b, c]
    assert s.stats().affinity_budget_overrides == 0


def test_abca_with_a_short_budget_b_goes_once_it_is_spent():
    """The same with a budget of 1 s: B loses the pick at 2 to a2 (its clock starts at 2), a
    third A arrives at 3, and at 4 B would lose again after 2 s >= 1: that pick is made again
    with b ranked as loaded, and B, the oldest, goes (its swap evicts the idle a). c (0) is
    then ahead of a3 (3): a, being evicted, has no affinity. B's grant records the lift,
    which ends with it."""
    fx = FakeEffects({"a": READY})
    s = Serial(config(budget=1.0), fx)
    a1, b, c, a2 = (arrive(s, m, now=0.0) for m in "abca")
    done(s, fx, a1, now=2.0)
    assert fx.grants[-1] == (a2, "a") and s.budget_lifted() == frozenset()
    a3 = arrive(s, "a", now=3.0)
    done(s, fx, a2, now=4.0)
    assert fx.swaps == [("b", ["a"])] and s.budget_lifted() == {"b"}
    assert s.queued() == [c, a3]
    assert s.stats().affinity_budget_overrides == 1
    complete(s, fx, "b", now=14.0)
    assert fx.grants[-1] == (b, "b")
    assert b.dispatch is not None and b.dispatch.budget_override
    assert s.budget_lifted() == frozenset()
    assert not any(r.dispatch.budget_override for r in (a1, a2))


def test_cancelling_the_lifted_request_ends_its_lift():
    """b's budget runs out and its swap starts; when b's client leaves, the lift ends (the
    swap keeps going, as in llama-swap), so nothing ranks b's model as loaded any more."""
    fx = FakeEffects({"a": READY})
    s = Serial(config(budget=5.0), fx)
    a1 = arrive(s, "a", now=0.0)
    b = arrive(s, "b", now=1.0)
    a2 = arrive(s, "a", now=2.0)
    done(s, fx, a1, now=3.0)  # a2 wins over the older b by affinity: b's clock starts at 3
    assert fx.grants[-1] == (a2, "a")
    a3 = arrive(s, "a", now=4.0)
    assert s.queued() == [a3, b]
    done(s, fx, a2, now=9.0)  # b would lose again after 6 s >= 5: it goes
    assert fx.swaps == [("b", ["a"])] and s.budget_lifted() == {"b"}
    s.on_cancel(Cancelled(b, 9.5))
    assert s.budget_lifted() == frozenset()
    assert s.active_swaps() == {"b": []}


def test_turning_the_budget_off_ends_a_lift():
    """A settings change to no budget forgets every lost pick and lift: ranks are the seed's
    again (here b waits behind the a's affinity)."""
    fx = FakeEffects({"a": READY})
    s = Serial(config(budget=5.0), fx)
    a1 = arrive(s, "a", now=0.0)
    b = arrive(s, "b", now=1.0)
    a2 = arrive(s, "a", now=2.0)
    done(s, fx, a1, now=3.0)
    a3 = arrive(s, "a", now=4.0)
    s.on_settings_changed(SettingsChanged(config(), 5.0))
    done(s, fx, a2, now=9.0)  # with the budget on, b would go here (see above)
    assert fx.grants[-1] == (a3, "a") and fx.swaps == []
    assert s.queued() == [b]


@pytest.mark.parametrize("assumed", [0.0, -3.0, math.nan])
def test_auto_without_a_usable_assumed_cost_assumes_ten_seconds(assumed):
    """An assumed swap cost that is not a positive number (which the importer refuses) is
    10 s, not 0 (a budget of 0 would ignore affinity at the first lost pick): k = 2 on the
    trap is then the 20 s budget worked out above, b granted at 35."""
    run = replay(trap(), config(swaps=2, assumed=assumed), swap_cost=10.0, preload=["a"])
    assert b_job(run).granted == 35.0


def test_auto_budget_of_a_selectors_request_is_its_targets_measured_swap():
    """`auto` for a request to a selector (pin to b) is k x the swap cost measured for b, the
    model it runs on: swap costs are kept per model, never per selector (it once fell back to
    the assumed cost, 100 s here, and waited 204.5 s where the direct request waited 8)."""
    from scheduling.core.config import SelectorConfig
    from scheduling.core.events import Request
    from tests.scheduling.test_serial_budget_properties import Box, box_config

    def waited(late_model: str) -> float:
        cfg = replace(box_config(swaps=2.0, assumed=100.0),
                      selectors={"sb": SelectorConfig("pin", ("b",))})
        fx = Box(2.0, None)
        fx.s = Serial(cfg, fx)
        reqs = [Request(1, "b", 0.0, 0), Request(2, "a", 0.5, 0)]
        reqs += [Request(3 + i, "a", 5.0 + i, 0) for i in range(300)]
        late = Request(1000, late_model, 6.0, 0)
        for r in [*reqs, late]:
            fx.service[r] = 1.5 if r.model == "a" else 1.0
            fx.at(r.arrived, "arrive", r)
        fx.run()
        assert fx.s.swap_costs()["b"] == 2.0
        return fx.left[late] - 6.0

    direct = waited("b")
    assert direct < 20
    assert waited("sb") == direct
