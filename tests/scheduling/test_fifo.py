"""The fifo scheduler against llama-swap's fifo.go / fifo_test.go behaviour.

Method (as in fifo_test.go): call the `on_*` handlers directly and synchronously, as the run
loop would. A swap completes when a test delivers its SwapDone (`fx.finish_swap` sets the
states the shell would leave), a request completes when a test delivers its ServeDone. No
event loop, database or sleep. Models a, b, c are ungrouped: the implicit `(default)` group
is swap + exclusive, so they are mutually exclusive, one at a time.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import READY, STOPPED
from scheduling.core.errors import (
    ConcurrencyLimit,
    ModelNotFound,
    ShuttingDown,
    SwapFailed,
)
from scheduling.core.events import (
    Cancelled,
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
from scheduling.core.ledger import InvariantViolation
from scheduling.core.swapper import Group
from tests.scheduling.fakes import (
    FakeEffects,
    StubSwapper,
    arrive,
    make_config,
    req,
    serve_done,
    serve_done_all,
)

PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)
SWAP1 = Group("one", frozenset({"a1", "a2"}), swap=True, exclusive=False)
SWAP2 = Group("two", frozenset({"b1", "b2"}), swap=True, exclusive=False)


def fifo(models=("a", "b", "c"), groups=(), states=None, swapper=None) -> tuple[Fifo, FakeEffects]:
    fx = FakeEffects(states)
    return Fifo(make_config(models, groups, swapper), fx), fx


def cancel(s: Fifo, r) -> None:
    s.on_cancel(Cancelled(r, 0.0))


def complete(s: Fifo, fx: FakeEffects, model: str, **kw) -> None:
    s.on_swap_done(fx.finish_swap(model, **kw))


# ---- (1) unknown, (2) admission -----------------------------------------------------------


def test_fifo_unknown_model_is_404():
    """An undefined model must be answered 404 at once, not queued or swapped for."""
    s, fx = fifo()
    r = arrive(s, "ghost")
    err = fx.error_of(r)
    assert isinstance(err, ModelNotFound) and err.status == 404
    assert fx.swaps == [] and s.queued() == [] and s.reserved("ghost") == 0


def test_fifo_concurrency_limit_default_10():
    """Without concurrencyLimit the 11th admitted request gets 429 + Retry-After (llama-swap
    default 10, #263)."""
    s, fx = fifo(states={"a": READY})
    for _ in range(10):
        arrive(s, "a")
    assert fx.served("a") == 10
    r = arrive(s, "a")
    err = fx.error_of(r)
    assert isinstance(err, ConcurrencyLimit)
    assert (err.status, err.limit, err.headers()) == (429, 10, {"Retry-After": "1"})
    assert s.reserved("a") == 10 and s.in_flight("a") == 10


def test_fifo_concurrency_limit_custom():
    """A model's own concurrencyLimit applies, counting swap waiters, not just served ones."""
    s, fx = fifo({"a": ModelConfig(concurrency_limit=2)})
    arrive(s, "a")  # starts the swap
    arrive(s, "a")  # joins
    r = arrive(s, "a")
    assert isinstance(fx.error_of(r), ConcurrencyLimit)
    assert fx.error_of(r).limit == 2
    assert fx.swaps_for("a") == 1 and len(s.active_swaps()["a"]) == 2


def test_fifo_limit_counts_queued_waiting_and_serving():
    """The slot is held while queued, while waiting on the swap and while served: a limit
    that forgot any stage would over-admit."""
    limits = {"a": ModelConfig(concurrency_limit=2), "b": ModelConfig()}
    s, fx = fifo(limits, states={"b": READY})
    b1 = arrive(s, "b")  # b serving, so a (which evicts b) must queue
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    assert s.queued() == [a1, a2] and s.reserved("a") == 2
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)  # queued count

    serve_done(s, fx, b1)  # b idle: a starts, both a requests wait on the swap
    assert s.active_swaps() == {"a": [a1, a2]}
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)  # waiting count

    complete(s, fx, "a")
    assert s.in_flight("a") == 2
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)  # serving count

    serve_done(s, fx, a1)  # serve done frees the slot
    assert s.reserved("a") == 1
    a6 = arrive(s, "a")
    assert fx.error_of(a6) is None and s.in_flight("a") == 2


def test_fifo_limit_released_on_cancel_and_error():
    """Cancel and a failed swap must give the slot back, or a model would lock itself out."""
    s, fx = fifo({"a": ModelConfig(concurrency_limit=1)})
    a1 = arrive(s, "a")
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)
    cancel(s, a1)
    assert s.reserved("a") == 0
    a3 = arrive(s, "a")  # joins the still running swap
    assert s.active_swaps() == {"a": [a3]}
    complete(s, fx, "a", error="exit 1")
    assert isinstance(fx.error_of(a3), SwapFailed) and s.reserved("a") == 0
    a4 = arrive(s, "a")
    assert fx.error_of(a4) is None and s.reserved("a") == 1


def test_fifo_zero_limit_means_default():
    """concurrencyLimit 0 (unset in some configs) must not refuse everything."""
    s, fx = fifo({"a": ModelConfig(concurrency_limit=0)}, states={"a": READY})
    for _ in range(10):
        arrive(s, "a")
    assert fx.served("a") == 10
    assert isinstance(fx.error_of(arrive(s, "a")), ConcurrencyLimit)


# ---- (3) join, (5) fast path, (8) start ---------------------------------------------------


def test_fifo_on_demand_start_then_serve():
    """A stopped model is loaded with one swap and the request served only after SwapDone."""
    s, fx = fifo()
    arrive(s, "a")
    assert fx.swaps == [("a", [])] and fx.served("a") == 0
    complete(s, fx, "a")
    assert fx.served("a") == 1 and s.in_flight("a") == 1 and s.active_swaps() == {}


def test_fifo_join_in_flight_swap():
    """Requests for a model already loading must join that swap, not start a second one."""
    s, fx = fifo()
    for _ in range(3):
        arrive(s, "a")
    assert fx.swaps_for("a") == 1 and len(s.active_swaps()["a"]) == 3
    complete(s, fx, "a")
    assert fx.served("a") == 3


def test_fifo_queue_collation_abcabc():
    """A B C A B C over mutually exclusive models: one swap per model, served A A B B C C
    (llama-swap's TestFIFO_QueueCollation) instead of six swaps."""
    s, fx = fifo()
    for m in "abcabc":
        arrive(s, m)
    for m in "abc":
        complete(s, fx, m)
        assert serve_done_all(s, fx, m) == 2
    assert [m for m, _ in fx.swaps] == ["a", "b", "c"]
    assert fx.served_order() == list("aabbcc")
    assert s.queued() == [] and s.active_swaps() == {}


def test_fifo_queue_collation_abca():
    """A B C A: the late A joins A's swap ahead of the queued B and C (served A A B C)."""
    s, fx = fifo()
    for m in "abca":
        arrive(s, m)
    for m in "abc":
        complete(s, fx, m)
        serve_done_all(s, fx, m)
    assert fx.served_order() == list("aabc")
    assert [m for m, _ in fx.swaps] == ["a", "b", "c"]


def test_fifo_fast_path_bypasses_queue():
    """A request for the ready model is granted at once even with others queued (llama-swap
    parity; the serial scheduler bounds the resulting starvation)."""
    s, fx = fifo(states={"a": READY})
    arrive(s, "a")
    b = arrive(s, "b")  # evicts busy a: queued
    a2 = arrive(s, "a")
    assert s.queued() == [b]
    assert fx.grants[-1] == (a2, "a") and fx.swaps == []


def test_fifo_ignores_parallel_slots():
    """fifo forwards every granted request (the upstream queues them); `parallel` is the
    serial scheduler's business, so parallel=1 must not hold requests back here."""
    s, fx = fifo({"a": ModelConfig(parallel=1)}, states={"a": READY})
    for _ in range(3):
        arrive(s, "a")
    assert fx.served("a") == 3 and s.in_flight("a") == 3


# ---- (6) collisions, (7) never evict a busy model -----------------------------------------


def test_fifo_never_evicts_model_with_requests_in_flight():
    """B, which evicts A, must wait for every A request to finish: stopping A would cut
    its clients off mid-response."""
    s, fx = fifo(states={"a": READY})
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    b = arrive(s, "b")
    assert s.queued() == [b] and fx.swaps == []
    serve_done(s, fx, a1)
    assert fx.swaps == []
    serve_done(s, fx, a2)
    assert fx.swaps == [("b", ["a"])] and s.active_swaps() == {"b": [b]}


def test_fifo_queue_on_eviction_collision():
    """B arriving while A loads must queue (it would stop A's swap target), and then also
    wait for A's request to be served (TestFIFO_QueueOnEvictionCollision)."""
    s, fx = fifo()
    a = arrive(s, "a")
    arrive(s, "b")
    assert fx.swaps_for("b") == 0
    complete(s, fx, "a")
    assert fx.served("a") == 1 and fx.swaps_for("b") == 0
    serve_done(s, fx, a)
    assert fx.swaps[-1] == ("b", ["a"])


def test_fifo_model_being_evicted_gets_no_fast_path():
    """A request for a ready model that an active swap is stopping must not be granted to
    the dying process. Here the swapper alone would allow it: loading p (non-exclusive group)
    never evicts a (llama-swap's gotcha), yet a's swap is stopping p."""
    s, fx = fifo(("a", "p", "q"), groups=[PAIR], states={"p": READY})
    arrive(s, "a")  # exclusive a evicts idle p
    assert fx.swaps == [("a", ["p"])]
    p = arrive(s, "p")  # p still reads READY and evicts nothing, but is being stopped
    assert fx.grants == [] and s.queued() == [p]
    complete(s, fx, "a")
    assert fx.swaps[-1] == ("p", [])  # reloads beside a once a's swap is done
    complete(s, fx, "p")
    assert fx.grants[-1] == (p, "p")


def test_fifo_same_group_request_waits_for_evicting_swap():
    """A request for the model a swap is evicting queues behind that swap and its serving."""
    s, fx = fifo(states={"a": READY})
    arrive(s, "b")  # a idle: b starts, evicting a
    assert fx.swaps == [("b", ["a"])]
    a = arrive(s, "a")
    assert fx.grants == [] and s.queued() == [a]
    complete(s, fx, "b")
    assert s.queued() == [a]  # b now serving
    serve_done_all(s, fx, "b")
    assert fx.swaps[-1] == ("a", ["b"])


def test_fifo_parallel_swaps_when_evict_sets_disjoint():
    """Models in a non-swap, non-exclusive group load side by side, not one after another."""
    s, fx = fifo(("p", "q"), groups=[PAIR])
    arrive(s, "p")
    arrive(s, "q")
    assert fx.swaps == [("p", []), ("q", [])]
    assert set(s.active_swaps()) == {"p", "q"}


def test_fifo_parallel_swaps_with_disjoint_nonempty_evictions():
    """Two swaps that stop different models do not wait for each other."""
    s, fx = fifo(("a1", "a2", "b1", "b2"), groups=[SWAP1, SWAP2],
                 states={"a1": READY, "b1": READY})
    arrive(s, "a2")
    arrive(s, "b2")
    assert fx.swaps == [("a2", ["a1"]), ("b2", ["b1"])]


def test_fifo_overlapping_evict_sets_queue():
    """Two swaps that would both stop the same model must not run together."""
    s, fx = fifo(("x", "y", "z"), swapper=StubSwapper({"x": ["z"], "y": ["z"]}))
    arrive(s, "x")
    y = arrive(s, "y")
    assert fx.swaps == [("x", ["z"])] and s.queued() == [y]
    complete(s, fx, "x")
    assert fx.swaps[-1] == ("y", ["z"])


def test_fifo_drain_promotes_multiple():
    """One SwapDone can unblock several queued requests; all start in the same drain."""
    s, fx = fifo(("a", "b", "c"), swapper=StubSwapper({"a": ["b", "c"]}))
    arrive(s, "a")
    arrive(s, "b")
    arrive(s, "c")
    assert fx.swaps_for("b") == 0 and fx.swaps_for("c") == 0
    complete(s, fx, "a")
    assert fx.swaps_for("b") == 1 and fx.swaps_for("c") == 1 and fx.served("a") == 1


def test_fifo_blocked_items_keep_order_behind_a_startable_one():
    """A drain starts what it can and leaves the blocked requests in their order."""
    s, fx = fifo(("a", "b", "c", "x"), states={"a": READY, "x": READY},
                 swapper=StubSwapper({"b": ["a"], "c": ["x"]}))
    a, x = arrive(s, "a"), arrive(s, "x")
    b1, c, b2 = arrive(s, "b"), arrive(s, "c"), arrive(s, "b")
    assert s.queued() == [b1, c, b2]
    serve_done(s, fx, x)
    assert fx.swaps == [("c", ["x"])] and s.queued() == [b1, b2]
    assert (fx.position(b1), fx.position(b2)) == (1, 2)
    serve_done(s, fx, a)
    assert s.active_swaps() == {"c": [c], "b": [b1, b2]} and s.queued() == []


# ---- queue order and positions ------------------------------------------------------------


def test_fifo_queue_order_by_priority_then_arrival():
    """Queue order is fifo priority + request priority, higher first, ties by arrival: a
    wrong key would serve batch work before interactive work."""
    models = {"a": ModelConfig(), "b": ModelConfig(), "c": ModelConfig(fifo_priority=5),
              "d": ModelConfig()}
    s, fx = fifo(models, states={"a": READY})
    a = arrive(s, "a")  # everyone else must evict busy a
    b1 = arrive(s, "b")
    c1 = arrive(s, "c")  # 5
    d1 = arrive(s, "d", priority=10)  # 10
    b2 = arrive(s, "b", priority=5)  # 5, after c1
    b3 = arrive(s, "b")  # 0, after b1
    assert s.queued() == [d1, c1, b2, b1, b3]
    serve_done(s, fx, a)
    assert fx.swaps[-1][0] == "d" and s.queued() == [c1, b2, b1, b3]


def test_fifo_position_changed_reported():
    """Queued clients hear their position when queued and whenever it changes (the
    loading stream's "Queue position: #N"), and only then."""
    s, fx = fifo(states={"a": READY})
    arrive(s, "a")
    b = arrive(s, "b")
    assert fx.positions == [(b, 1)]
    c = arrive(s, "c", priority=1)  # jumps ahead of b
    assert fx.positions[1:] == [(c, 1), (b, 2)]
    d = arrive(s, "b")  # behind: only d hears
    assert fx.positions[3:] == [(d, 3)]
    cancel(s, c)
    assert fx.positions[4:] == [(b, 1), (d, 2)]
    assert [fx.position(r) for r in s.queued()] == [1, 2]


def test_fifo_positions_not_reported_when_the_config_says_no_one_listens():
    """A replay (scheduling/replay.py) has no client to tell; the same order, no reports."""
    s, fx = fifo(states={"a": READY})
    s = Fifo(dataclasses.replace(s.config, report_positions=False), fx)
    arrive(s, "a")
    b = arrive(s, "b")
    c = arrive(s, "c", priority=1)
    assert fx.positions == [] and s.queued() == [c, b]


# ---- cancellation and departed clients ----------------------------------------------------


def test_fifo_cancel_queued_request_never_loads():
    """A client that left while queued must never cause a model load later."""
    s, fx = fifo(states={"a": READY})
    a = arrive(s, "a")
    b = arrive(s, "b")
    cancel(s, b)
    assert s.queued() == [] and s.reserved("b") == 0
    serve_done(s, fx, a)
    assert fx.swaps == [] and fx.grants == [(a, "a")]


def test_fifo_cancel_swap_waiter_swap_still_completes():
    """A cancelled waiter is dropped from its swap, which still completes (parity), and it
    is never granted."""
    s, fx = fifo()
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    cancel(s, a1)
    assert s.active_swaps() == {"a": [a2]} and s.reserved("a") == 1
    complete(s, fx, "a")
    assert fx.grants == [(a2, "a")]

    c = arrive(s, "c")  # sole waiter leaves: the swap still finishes, nobody is granted
    serve_done(s, fx, a2)
    cancel(s, c)
    assert s.active_swaps() == {"c": []} and s.reserved("c") == 0
    complete(s, fx, "c")
    assert fx.served("c") == 0 and s.active_swaps() == {}


def test_fifo_cancel_is_idempotent_and_ignores_granted():
    """A late Cancelled (already granted, twice, or unknown) must not free a slot twice."""
    s, fx = fifo(states={"a": READY})
    a = arrive(s, "a")
    cancel(s, a)
    assert s.in_flight("a") == 1 and s.reserved("a") == 1
    cancel(s, req("a"))
    b = arrive(s, "b")
    cancel(s, b)
    cancel(s, b)
    assert s.reserved("b") == 0
    serve_done(s, fx, a)
    assert s.reserved("a") == 0


def test_fifo_grant_refused_client_gone_not_in_flight():
    """GrantServe False (client gone) must not count in flight, or later evictions of that
    model would wait forever (TestFIFO_GrantServeFalseDoesNotLeakInFlight)."""
    s, fx = fifo()
    a = arrive(s, "a")
    fx.gone.add(a)
    complete(s, fx, "a")
    assert fx.refused == [(a, "a")] and s.in_flight("a") == 0 and s.reserved("a") == 0
    arrive(s, "b")
    assert fx.swaps[-1] == ("b", ["a"])


def test_fifo_fast_path_refused_releases_slot():
    """A fast-path grant to a departed client gives its slot back."""
    s, fx = fifo({"a": ModelConfig(concurrency_limit=1)}, states={"a": READY})
    r = req("a")
    fx.gone.add(r)
    s.on_request(RequestArrived(r, 0.0))
    assert s.reserved("a") == 0 and s.in_flight("a") == 0
    assert fx.error_of(arrive(s, "a")) is None


# ---- swap outcomes --------------------------------------------------------------------------


def test_fifo_failed_swap_errors_all_waiters_502():
    """A failed start answers every waiter 502 with the failure and frees their slots."""
    s, fx = fifo()
    a1, a2 = arrive(s, "a"), arrive(s, "a")
    b = arrive(s, "b")
    complete(s, fx, "a", error="exit status 1: CUDA out of memory")
    for r in (a1, a2):
        err = fx.error_of(r)
        assert isinstance(err, SwapFailed)
        assert (err.status, err.code) == (502, "start_failed")
        assert "CUDA" in err.message
    assert fx.served("a") == 0 and s.reserved("a") == 0
    assert fx.swaps[-1] == ("b", []) and s.active_swaps() == {"b": [b]}


def test_fifo_timed_out_swap_is_504():
    """A start that hit healthCheckTimeout is a 504, not a 502."""
    s, fx = fifo()
    a = arrive(s, "a")
    complete(s, fx, "a", error="not ready after 120s", timed_out=True)
    err = fx.error_of(a)
    assert (err.status, err.code) == (504, "start_timeout")


def test_fifo_swap_done_without_active_swap_is_ignored():
    """A stale SwapDone must not grant anyone or crash the loop."""
    s, fx = fifo(states={"a": READY})
    s.on_swap_done(SwapDone("a", 0.0))
    s.on_swap_done(SwapDone("nope", 0.0, error="x"))
    assert fx.grants == [] and fx.errors == []


# ---- unload -----------------------------------------------------------------------------------


def test_fifo_unload_ready_idle_model():
    """An unload stops the model; a request during the unload queues (no grant to a dying
    process) and starts a fresh swap once UnloadDone arrives."""
    s, fx = fifo(states={"a": READY})
    handle = object()
    s.on_unload(UnloadRequested(("a",), 0.0, handle))
    assert fx.stops == [(("a",), handle)]
    a = arrive(s, "a")
    assert fx.grants == [] and fx.swaps == [] and s.queued() == [a]
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert fx.swaps == [("a", [])] and s.queued() == []
    complete(s, fx, "a")
    assert fx.grants == [(a, "a")]


def test_fifo_unload_blocks_swaps_that_would_evict_it():
    """No swap may start around a pending stop: B (which evicts A) waits for A's unload."""
    s, fx = fifo(states={"a": READY})
    s.on_unload(UnloadRequested(("a",), 0.0))
    b = arrive(s, "b")
    assert fx.swaps == [] and s.queued() == [b]
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert fx.swaps == [("b", [])]


def test_fifo_unload_aborts_active_swap_errors_waiters():
    """Unloading a model that is loading: the shell's stop aborts the swap, whose
    SwapDone(error) errors its waiters; a request arriving meanwhile queues for a fresh swap
    instead of joining the doomed one."""
    s, fx = fifo()
    a1 = arrive(s, "a")
    s.on_unload(UnloadRequested(("a",), 0.0))
    a2 = arrive(s, "a")
    assert s.active_swaps() == {"a": [a1]} and s.queued() == [a2]
    complete(s, fx, "a", error="stopped by unload")
    assert isinstance(fx.error_of(a1), SwapFailed)
    assert s.queued() == [a2] and fx.swaps_for("a") == 1
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert fx.swaps_for("a") == 2 and s.active_swaps() == {"a": [a2]}


def test_fifo_swap_success_during_unload_requeues_waiters():
    """A swap that won the race against an unload must not hand its waiters a process that
    is being stopped: they go back to the queue and reload after the unload."""
    s, fx = fifo()
    a1 = arrive(s, "a")
    s.on_unload(UnloadRequested(("a",), 0.0))
    complete(s, fx, "a")
    assert fx.grants == [] and s.queued() == [a1] and s.reserved("a") == 1
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert fx.swaps_for("a") == 2
    complete(s, fx, "a")
    assert fx.grants == [(a1, "a")]


def test_fifo_overlapping_unloads_block_until_both_done():
    """Two unloads of one model: the block lifts only after the second UnloadDone."""
    s, fx = fifo(states={"a": READY})
    s.on_unload(UnloadRequested(("a",), 0.0))
    s.on_unload(UnloadRequested(("a", "b"), 0.0))
    a = arrive(s, "a")
    s.on_unload_done(UnloadDone(("a",), 1.0))
    assert s.queued() == [a]
    s.on_unload_done(UnloadDone(("a", "b"), 1.0))
    assert s.queued() == [] and fx.grants == [(a, "a")]  # still READY in this fake


# ---- settings, tick, shutdown ------------------------------------------------------------


def test_fifo_settings_change_removes_model_404_and_resorts():
    """After an admin deletes a model its queued requests get 404 (not a hang), and the
    queue follows the new priorities at once, not only for later arrivals."""
    s, fx = fifo(("a", "b", "c", "d"), states={"a": READY})
    a = arrive(s, "a")  # everyone else evicts busy a
    b = arrive(s, "b")
    c1 = arrive(s, "c")
    d = arrive(s, "d")
    c2 = arrive(s, "c")
    assert isinstance(fx.error_of(arrive(s, "e")), ModelNotFound)  # not defined yet
    assert s.queued() == [b, c1, d, c2]
    new = make_config({"a": ModelConfig(), "c": ModelConfig(), "d": ModelConfig(fifo_priority=3),
                       "e": ModelConfig(fifo_priority=1)})
    s.on_settings_changed(SettingsChanged(new, 1.0))
    assert s.config is new
    assert isinstance(fx.error_of(b), ModelNotFound) and s.reserved("b") == 0
    assert s.queued() == [d, c1, c2]
    assert [fx.position(r) for r in (d, c1, c2)] == [1, 2, 3]
    e = arrive(s, "e")
    assert s.queued() == [d, e, c1, c2]
    serve_done(s, fx, a)
    assert fx.swaps[-1] == ("d", ["a"])


def test_fifo_settings_change_errors_swap_waiters_of_removed_model():
    """Waiters of a swap to a removed model get 404; the swap record stays until SwapDone
    so nothing else starts around it; then the next model's swap evicts the undefined one
    (no separate stop needed)."""
    s, fx = fifo()
    a = arrive(s, "a")
    s.on_settings_changed(SettingsChanged(make_config(["b"]), 1.0))
    assert isinstance(fx.error_of(a), ModelNotFound) and s.reserved("a") == 0
    b = arrive(s, "b")  # would evict the still-loading, now undefined a
    assert s.queued() == [b] and s.active_swaps() == {"a": []}
    complete(s, fx, "a")
    assert fx.swaps[-1] == ("b", ["a"]) and fx.stops == []


def test_fifo_time_alone_does_nothing():
    """fifo has no aging: an event that changes nothing else (a restart of a model that is
    not running), handled long after the arrivals, must not reorder, start or answer
    anything."""
    s, fx = fifo(states={"a": READY})
    arrive(s, "a")
    b = arrive(s, "b")
    fx.clear()
    s.on_restart(RestartRequested(("b",), 1e6))
    assert s.now == 1e6 and s.restart_pending() == frozenset()
    assert s.queued() == [b] and (fx.swaps, fx.grants, fx.errors, fx.positions) == ([], [], [], [])


def test_fifo_shutdown_errors_everyone_and_later_requests():
    """Shutdown answers every queued and waiting request 503 and refuses later ones, so no
    client hangs on a dead loop (TestFIFO_OnShutdown_FailsAllWaiters)."""
    s, fx = fifo(("a", "b", "c", "p", "q"), groups=[PAIR])
    waiting = [arrive(s, "p"), arrive(s, "p"), arrive(s, "q")]
    queued = [arrive(s, "a"), arrive(s, "b")]
    assert len(s.queued()) == 2
    s.on_shutdown(Shutdown(1.0))
    for r in waiting + queued:
        err = fx.error_of(r)
        assert isinstance(err, ShuttingDown) and err.status == 503
    later = arrive(s, "a")
    assert isinstance(fx.error_of(later), ShuttingDown)
    assert s.queued() == [] and all(s.reserved(m) == 0 for m in "abcpq")
    complete(s, fx, "p")  # a late SwapDone grants nobody
    assert fx.grants == []


def test_fifo_shutdown_keeps_in_flight_accounting():
    """Requests in flight at shutdown still close cleanly with their ServeDone."""
    s, fx = fifo(states={"a": READY})
    a = arrive(s, "a")
    s.on_shutdown(Shutdown(1.0))
    serve_done(s, fx, a)
    assert s.in_flight("a") == 0 and s.reserved("a") == 0


# ---- invariants -------------------------------------------------------------------------------


def test_fifo_serve_done_for_ungranted_request_raises():
    """A ServeDone for a request never granted is a shell bug; guessing would drive the
    in-flight count negative and let a busy model be evicted."""
    s, _ = fifo()
    queued = arrive(s, "a")
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(queued, 0.0))
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(req("b"), 0.0))


def test_fifo_double_serve_done_raises():
    """A second ServeDone for one request must raise, not free someone else's slot."""
    s, fx = fifo(states={"a": READY})
    a = arrive(s, "a")
    arrive(s, "a")
    serve_done(s, fx, a)
    with pytest.raises(InvariantViolation):
        s.on_serve_done(ServeDone(a, 0.0))
    assert s.in_flight("a") == 1


def test_fifo_duplicate_arrival_raises():
    """One request delivered twice would hold two slots and be answered twice."""
    s, _ = fifo()
    r = arrive(s, "a")
    with pytest.raises(InvariantViolation):
        s.on_request(RequestArrived(r, 0.0))


def test_fifo_satisfies_scheduler_shape():
    """The shell dispatches by these names; a rename would only fail at runtime."""
    s, _ = fifo()
    for name in ("on_request", "on_cancel", "on_swap_done", "on_serve_done", "on_unload",
                 "on_unload_done", "on_settings_changed", "on_restart", "on_model_exited",
                 "on_shutdown"):
        assert callable(getattr(s, name))
    assert isinstance(s.config, SchedulerConfig)


def test_fifo_imports_without_django_or_asyncio():
    """The core must stay pure (style anchor 1): importing it pulls in neither."""
    code = ("import sys, scheduling.core.fifo; "
            "print(','.join(m for m in ('django', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, cwd=str(Path(__file__).parents[2]),
                         check=True)
    assert out.stdout.strip() == ""
