"""`UnloadRequested(..., everything=True)`: "unload all" resolved by the core when it handles
the event, not by the caller beforehand.

A caller that read the running list and then posted an unload for it gated a mutation on a
stale read: a model that started loading in between was missed, and one that stopped in
between was stopped again. Here the list is the books' at handling time: every process the
shell reports running (not stopped or failed) plus every active swap's target.
"""

from __future__ import annotations

import pytest

from scheduling.core.effects import READY, STARTING, STOPPED, STOPPING
from scheduling.core.errors import SwapFailed
from scheduling.core.events import UnloadDone, UnloadRequested
from scheduling.core.fifo import Fifo
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, arrive, make_config

POLICIES = [Fifo, Serial]
PAIR = Group("pair", frozenset({"a", "p"}), swap=False, exclusive=False)


def unload_all(s, now: float = 1.0, handle: object = "caller", models=()) -> None:
    s.on_unload(UnloadRequested(tuple(models), now, handle, everything=True))


@pytest.mark.parametrize("policy", POLICIES)
def test_unload_all_stops_what_runs_when_it_is_handled(policy) -> None:
    """The list is read as the event is handled: a model that became ready after the caller
    asked is stopped, one that stopped meanwhile is not; starting and stopping processes
    count as running, as in the shell's running list."""
    fx = FakeEffects({"a": READY, "b": STOPPED, "c": STARTING, "d": STOPPING})
    s = policy(make_config(["a", "b", "c", "d"]), fx)
    fx.states["b"] = READY  # loaded after the caller decided to unload everything
    fx.states["a"] = STOPPED  # stopped on its own (TTL) before the event was handled
    unload_all(s)
    assert fx.stops == [(("b", "c", "d"), "caller")]


@pytest.mark.parametrize("policy", POLICIES)
def test_unload_all_includes_a_model_still_loading_and_errors_its_waiters(policy) -> None:
    """A swap in progress counts: its target is unloaded (its process may not exist yet);
    the shell's stop aborts the load and the waiters get SwapFailed, as for an explicit
    unload of that model."""
    fx = FakeEffects()
    s = policy(make_config(["a", "b"]), fx)
    w = arrive(s, "a")
    assert fx.swaps == [("a", [])] and fx.running_models() == []
    unload_all(s)
    assert fx.stops == [(("a",), "caller")]
    s.on_unload_done(UnloadDone(("a",), 2.0))
    s.on_swap_done(fx.finish_swap("a", now=2.0, error="stopped by an unload"))
    assert isinstance(fx.error_of(w), SwapFailed)


@pytest.mark.parametrize("policy", POLICIES)
def test_unload_all_holds_every_model_it_stops_until_unload_done(policy) -> None:
    """Every resolved model is unloading until the UnloadDone naming it: a request for one
    queues (no grant to a process being stopped) and gets a fresh load afterwards."""
    fx = FakeEffects({"a": READY, "p": READY})
    s = policy(make_config(["a", "p", "b"], groups=[PAIR]), fx)
    unload_all(s)
    (models, handle), = fx.stops
    assert models == ("a", "p") and handle == "caller"
    r = arrive(s, "a", now=1.5)
    assert fx.grants == [] and fx.swaps == [] and s.queued() == [r]
    fx.states.update(a=STOPPED, p=STOPPED)
    s.on_unload_done(UnloadDone(models, 2.0))
    assert fx.swaps == [("a", [])]
    s.on_swap_done(fx.finish_swap("a", now=3.0))
    assert fx.grants == [(r, "a")]


@pytest.mark.parametrize("policy", POLICIES)
def test_unload_all_with_nothing_running_still_answers_the_caller(policy) -> None:
    """Nothing to stop: the shell is still asked (with no models), so it answers the
    caller's handle and posts an UnloadDone, which changes nothing."""
    fx = FakeEffects()
    s = policy(make_config(["a"]), fx)
    unload_all(s)
    assert fx.stops == [((), "caller")]
    s.on_unload_done(UnloadDone((), 2.0))
    r = arrive(s, "a", now=3.0)
    assert fx.swaps == [("a", [])] and s.active_swaps() == {"a": [r]}


@pytest.mark.parametrize("policy", POLICIES)
def test_unload_all_adds_the_named_models_once(policy) -> None:
    """Named models are stopped too (even if not running), each once, in sorted order."""
    fx = FakeEffects({"a": READY})
    s = policy(make_config(["a", "b"]), fx)
    unload_all(s, models=("b", "a"))
    assert fx.stops == [(("a", "b"), "caller")]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_plain_unload_still_stops_only_what_it_names(policy) -> None:
    """Without `everything`, the list is the caller's, as given."""
    fx = FakeEffects({"a": READY, "b": READY})
    s = policy(make_config(["a", "b"], groups=[Group("ab", frozenset({"a", "b"}), swap=False,
                                                      exclusive=False)]), fx)
    s.on_unload(UnloadRequested(("b",), 1.0, "caller"))
    assert fx.stops == [(("b",), "caller")]
