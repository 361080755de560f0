"""The core learns of an upstream's exit from an event (`ModelExited`), not from reading the
process state: the shell's read can lag (the process's owner has not handled the exit yet),
and a request granted to a dead process gets "connect failed" instead of a restart.
"""

from __future__ import annotations

import pytest

from scheduling.core.effects import READY
from scheduling.core.events import ModelExited, SwapDone
from scheduling.core.fifo import Fifo
from scheduling.core.serial import Serial
from tests.scheduling.fakes import FakeEffects, arrive, make_config, serve_done

POLICIES = [Fifo, Serial]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_arrival_after_an_exit_loads_the_model_again(policy) -> None:
    fx = FakeEffects({"m": READY})  # the shell's advisory read has not caught up
    s = policy(make_config(["m"]), fx)

    s.on_model_exited(ModelExited("m", 1.0))
    r = arrive(s, "m", now=1.5)

    assert fx.grants == [], "granted to a process that has exited"
    assert fx.swaps == [("m", [])]
    s.on_swap_done(SwapDone("m", 2.0))
    assert fx.grants == [(r, "m")]
    serve_done(s, fx, r, now=2.5)

    later = arrive(s, "m", now=3.0)
    assert fx.grants[-1] == (later, "m"), "after the reload it is served at once again"
    assert fx.swaps == [("m", [])]


def test_requests_queued_behind_a_crashed_model_start_its_restart_at_once() -> None:
    """Serial keeps requests beyond `parallel` queued; the exit restarts the model for them
    without waiting for the request in flight (which the crash cut) to be released."""
    fx = FakeEffects({"m": READY})
    s = Serial(make_config(["m"]), fx)
    first = arrive(s, "m", now=0.0)
    queued = arrive(s, "m", now=0.1)
    assert fx.grants == [(first, "m")] and fx.swaps == []

    s.on_model_exited(ModelExited("m", 1.0))

    assert fx.swaps == [("m", [])], "the exit alone starts the reload"
    s.on_swap_done(SwapDone("m", 2.0))
    serve_done(s, fx, first, now=2.1)
    assert fx.grants[-1] == (queued, "m")


@pytest.mark.parametrize("policy", POLICIES)
def test_an_exit_of_a_model_nobody_waits_for_changes_nothing(policy) -> None:
    fx = FakeEffects({"m": READY, "other": READY})
    s = policy(make_config(["m", "other"]), fx)

    s.on_model_exited(ModelExited("m", 1.0))

    assert (fx.swaps, fx.grants, fx.errors, fx.stops) == ([], [], [], [])
