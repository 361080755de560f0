"""Bounded queues in the core: a global and a per-band cap on waiting requests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.config import ModelConfig
from scheduling.core.effects import READY
from scheduling.core.errors import ConcurrencyLimit, QueueFull
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


# ---- concurrencyLimit: fifo keeps llama-swap's 10, serial leaves the bound to the queue caps --

def one_model(cls, limit: int, **caps):
    fx = FakeEffects({"a": READY})
    config = replace(make_config({"a": ModelConfig(concurrency_limit=limit)}),
                     scheduler="fifo" if cls is Fifo else "serial", **caps)
    return cls(config, fx), fx


def test_serial_without_a_concurrency_limit_queues_500_on_one_model():
    """The 20,000-request queue the settings promise, not llama-swap's 10 per model: under
    serial an unset (0) concurrencyLimit adds no cap of its own."""
    s, fx = one_model(Serial, 0, max_waiting=20_000)
    requests = [arrive(s, "a") for _ in range(500)]
    assert fx.errors == []
    assert s.in_flight("a") == 1 and s.reserved("a") == 500  # parallel 1: 499 wait here
    assert len(s.queued()) == 499 and requests[0] in {r for r, _ in fx.grants}


def test_serial_without_a_concurrency_limit_is_still_bounded_by_max_waiting():
    s, fx = one_model(Serial, 0, max_waiting=3)
    arrive(s, "a")  # granted
    waiting = [arrive(s, "a") for _ in range(3)]
    refused = arrive(s, "a")
    assert all(fx.error_of(r) is None for r in waiting)
    assert isinstance(fx.error_of(refused), QueueFull)


@pytest.mark.parametrize("cls", [Fifo, Serial])
def test_an_explicit_concurrency_limit_applies_under_both(cls):
    s, fx = one_model(cls, 3)
    admitted = [arrive(s, "a") for _ in range(3)]
    refused = arrive(s, "a")
    assert all(fx.error_of(r) is None for r in admitted)
    err = fx.error_of(refused)
    assert isinstance(err, ConcurrencyLimit) and (err.limit, err.status) == (3, 429)


def test_fifo_without_a_concurrency_limit_refuses_the_11th_as_llama_swap_does():
    """llama-swap's fifo.go: `limit := defaultConcurrencyLimit` (10) unless
    ConcurrencyLimit > 0, counting queued and served (`reserved`)."""
    s, fx = one_model(Fifo, 0)
    for _ in range(10):
        arrive(s, "a")
    assert fx.errors == [] and s.in_flight("a") == 10  # fifo forwards them all
    err = fx.error_of(arrive(s, "a"))
    assert isinstance(err, ConcurrencyLimit) and err.limit == 10
    assert err.headers() == {"Retry-After": "1"}


def test_switching_to_fifo_brings_the_10_back_and_to_serial_lifts_it():
    """A live switch hands the admitted requests over; the limit is the new policy's."""
    from scheduling.core.policies import make_scheduler

    s, fx = one_model(Serial, 0)
    for _ in range(12):
        arrive(s, "a")
    assert fx.errors == []
    f = make_scheduler(replace(s.config, scheduler="fifo"), fx, previous=s)
    assert f.reserved("a") == 12
    assert isinstance(fx.error_of(arrive(f, "a")), ConcurrencyLimit)  # 12 ≥ 10
    back = make_scheduler(replace(f.config, scheduler="serial"), fx, previous=f)
    assert fx.error_of(arrive(back, "a")) is None
