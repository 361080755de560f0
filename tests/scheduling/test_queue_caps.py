"""Bounded queues in the core: a global and a per-band cap on waiting requests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.effects import READY
from scheduling.core.errors import QueueFull
from scheduling.core.fifo import Fifo
from scheduling.core.serial import Serial
from tests.scheduling.fakes import FakeEffects, arrive, make_config


def scheduler(cls, **caps):
    fx = FakeEffects({"a": READY})
    config = replace(make_config(["a", "b"]), scheduler="fifo" if cls is Fifo else "serial",
                     **caps)
    return cls(config, fx), fx


@pytest.mark.parametrize("cls", [Fifo, Serial])
def test_the_global_cap_refuses_beyond_it_and_frees_nothing(cls):
    s, fx = scheduler(cls, max_waiting=2)
    busy = arrive(s, "a")  # granted: not waiting
    assert fx.grants == [(busy, "a")]
    waiting = [arrive(s, "b"), arrive(s, "b")]  # b must evict a, which is busy: they wait
    refused = arrive(s, "b")
    assert isinstance(fx.error_of(refused), QueueFull)
    assert fx.error_of(refused).headers() == {"Retry-After": "5"}
    assert all(fx.error_of(r) is None for r in waiting)
    assert s.reserved("b") == 2  # the refused one holds nothing


@pytest.mark.parametrize("cls", [Fifo, Serial])
def test_a_band_cap_refuses_only_its_band(cls):
    s, fx = scheduler(cls, max_waiting_per_band={"batch": 1})
    arrive(s, "a")  # in flight; b's requests wait for it
    arrive(s, "b", priority=-100)
    full = arrive(s, "b", priority=-100)
    other = arrive(s, "b", priority=100)
    assert isinstance(fx.error_of(full), QueueFull) and "batch band" in str(fx.error_of(full))
    assert fx.error_of(other) is None


@pytest.mark.parametrize("cls", [Fifo, Serial])
def test_no_cap_by_default(cls):
    s, fx = scheduler(cls)
    arrive(s, "a")
    for _ in range(5):
        arrive(s, "b")
    assert fx.errors == []
