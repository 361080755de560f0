"""Live definition changes in the core: a running model whose process definition changed
restarts once idle, a removed one stops once idle, and an admin's restart waits likewise.
Nothing in flight is ever cut off, and requests that arrive meanwhile wait for the restart.

Both policies share this (scheduling/core/ledger.py), so every test runs on both.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.effects import READY, STOPPED
from scheduling.core.errors import ModelNotFound
from scheduling.core.events import (
    RestartRequested,
    ServeDone,
    SettingsChanged,
    UnloadDone,
)
from scheduling.core.fifo import Fifo
from scheduling.core.policies import make_scheduler
from scheduling.core.serial import Serial
from scheduling.core.swapper import Group
from tests.scheduling.fakes import FakeEffects, arrive, make_config

POLICIES = [Fifo, Serial]


PAIR = Group("pair", frozenset({"a", "b"}), swap=False, exclusive=False)  # may co-run


def cfg(kind: str, revisions: dict[str, str] | None = None, models=("a", "b"),
        parallel: int = 1, groups=()) -> SchedulerConfig:
    mcs = {m: ModelConfig(parallel=parallel, revision=(revisions or {}).get(m, ""))
           for m in models}
    return replace(make_config(mcs, groups=groups), scheduler=kind)


def kind_of(cls) -> str:
    return "fifo" if cls is Fifo else "serial"


def loaded(cls, model: str = "a", parallel: int = 1):
    """A scheduler with `model` loaded and one request of it in flight."""
    fx = FakeEffects({model: READY})
    s = cls(cfg(kind_of(cls), parallel=parallel), fx)
    r = arrive(s, model)
    assert fx.grants == [(r, model)]
    return s, fx, r


def done(s, fx: FakeEffects, r, now: float = 0.0) -> None:
    fx.closed.add(r)
    s.on_serve_done(ServeDone(r, now))


@pytest.mark.parametrize("cls", POLICIES)
def test_changed_definition_restarts_only_when_idle(cls):
    s, fx, busy = loaded(cls)
    s.on_settings_changed(SettingsChanged(cfg(kind_of(cls), {"a": "v2"}), 1.0))
    assert fx.swaps == [] and fx.stops == []  # the request in flight is not cut off
    assert s.restart_pending() == frozenset({"a"})
    later = arrive(s, "a", now=2.0)  # waits: the old process takes nothing new
    assert fx.grants == [(busy, "a")]
    done(s, fx, busy, 3.0)
    assert fx.swaps == [("a", ["a"])]  # restart: stop a, start it again
    assert s.restart_pending() == frozenset()
    assert s.active_swaps() == {"a": [later]}
    s.on_swap_done(fx.finish_swap("a", now=4.0))
    assert fx.grants[-1] == (later, "a")


@pytest.mark.parametrize("cls", POLICIES)
def test_parallel_slots_do_not_feed_a_model_waiting_to_restart(cls):
    """With free slots left, new requests still wait: otherwise a busy model never idles."""
    s, fx, _ = loaded(cls, parallel=4)
    s.on_settings_changed(SettingsChanged(cfg(kind_of(cls), {"a": "v2"}, parallel=4), 1.0))
    arrive(s, "a", now=2.0)
    assert len(fx.grants) == 1


@pytest.mark.parametrize("cls", POLICIES)
def test_unchanged_definition_does_not_restart(cls):
    s, fx, busy = loaded(cls)
    s.on_settings_changed(SettingsChanged(cfg(kind_of(cls)), 1.0))  # same revisions
    done(s, fx, busy, 2.0)
    assert fx.swaps == [] and s.restart_pending() == frozenset()
    arrive(s, "a", now=3.0)
    assert len(fx.grants) == 2


@pytest.mark.parametrize("cls", POLICIES)
def test_removed_model_stops_when_idle_and_new_requests_get_404(cls):
    s, fx, busy = loaded(cls)
    s.on_settings_changed(SettingsChanged(cfg(kind_of(cls), models=("b",)), 1.0))
    assert fx.stops == []
    late = arrive(s, "a", now=2.0)
    assert isinstance(fx.error_of(late), ModelNotFound)
    done(s, fx, busy, 3.0)  # its ServeDone is still accepted
    assert fx.stops == [(("a",), None)]
    fx.states["a"] = STOPPED
    s.on_unload_done(UnloadDone(("a",), 4.0))
    assert s.in_flight("a") == 0 and s.reserved("a") == 0


@pytest.mark.parametrize("cls", POLICIES)
def test_admin_restart_of_an_idle_model_is_immediate_and_of_a_stopped_one_nothing(cls):
    fx = FakeEffects({"a": READY})
    s = cls(cfg(kind_of(cls)), fx)
    s.on_restart(RestartRequested(("a", "b", "ghost"), 1.0))  # b stopped, ghost undefined
    assert fx.swaps == [("a", ["a"])]
    assert s.restart_pending() == frozenset()


@pytest.mark.parametrize("cls", POLICIES)
def test_a_model_that_stops_by_itself_needs_no_restart(cls):
    """TTL or a crash stops it while the restart waits: the next start uses the new
    definition anyway, and the waiting requests start it the normal way."""
    s, fx, busy = loaded(cls)
    s.on_restart(RestartRequested(("a",), 1.0))
    waiting = arrive(s, "a", now=2.0)
    fx.states["a"] = STOPPED  # the process exited
    done(s, fx, busy, 3.0)
    assert s.restart_pending() == frozenset()
    assert fx.swaps == [("a", [])]  # a plain start, not a restart
    s.on_swap_done(fx.finish_swap("a", now=4.0))
    assert fx.grants[-1] == (waiting, "a")


@pytest.mark.parametrize("cls", POLICIES)
def test_eviction_by_a_waiting_request_beats_the_restart(cls):
    """b's request needs a gone; once a is idle the walk evicts it for b, so no restart."""
    s, fx, busy = loaded(cls)
    s.on_settings_changed(SettingsChanged(cfg(kind_of(cls), {"a": "v2"}), 1.0))
    other = arrive(s, "b", now=2.0)
    done(s, fx, busy, 3.0)
    assert fx.swaps == [("b", ["a"])]
    s.on_swap_done(fx.finish_swap("b", now=4.0))
    assert fx.grants[-1] == (other, "b") and s.restart_pending() == frozenset()


def test_a_pending_restart_survives_a_policy_switch():
    """fifo → serial while a restart waits: the new policy keeps it, and also notices a
    definition that changed in the same save."""
    fx = FakeEffects({"a": READY, "b": READY})
    s = Fifo(cfg("fifo", parallel=2, groups=[PAIR]), fx)
    ra = arrive(s, "a")
    s.on_restart(RestartRequested(("a",), 1.0))
    new = cfg("serial", {"b": "v2"}, parallel=2, groups=[PAIR])
    s2 = make_scheduler(new, fx, s)
    assert isinstance(s2, Serial)
    assert fx.swaps == [("b", ["b"])]  # b is idle: restarted at once
    assert s2.restart_pending() == frozenset({"a"})  # a waits for its request
    fx.closed.add(ra)
    s2.on_serve_done(ServeDone(ra, 2.0))
    assert ("a", ["a"]) in fx.swaps
