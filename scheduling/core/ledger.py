"""Slot bookkeeping that every policy keeps the same way: admission reservations, requests
in flight, and the grant itself. The policies (fifo.py, serial.py) differ in whom they pick,
never in how a pick is accounted, so that part lives here once.
"""

from __future__ import annotations

from scheduling.core.effects import Effects
from scheduling.core.errors import SchedulingError
from scheduling.core.events import Request
from scheduling.core.stats import SchedulerStats


class InvariantViolation(AssertionError):
    """The shell sent events that contradict the scheduler's books (a bug, not an outcome):
    a ServeDone for a request never granted, a slot released twice, a request arriving
    twice. Raised, not asserted, so `python -O` keeps the check."""


class Ledger:
    """Mixed into a policy, which sets these attributes in its constructor."""

    _fx: Effects
    _holders: set[Request]  # requests holding an admission slot
    _reserved: dict[str, int]  # model -> slots held (queued + waiting + in flight)
    _serving: dict[Request, str]  # granted request -> model, until its ServeDone
    _in_flight: dict[str, int]  # model -> granted requests not yet done
    _stats: SchedulerStats

    def in_flight(self, model: str) -> int:
        """Granted requests for `model` whose ServeDone has not arrived."""
        return self._in_flight.get(model, 0)

    def reserved(self, model: str) -> int:
        """Admission slots held for `model`: queued + waiting on a swap + in flight."""
        return self._reserved.get(model, 0)

    def stats(self) -> SchedulerStats:
        """A copy of the counters (see SchedulerStats)."""
        return self._stats.copy()

    def _deliver(self, req: Request, model: str) -> None:
        """Grant `req` (its Dispatch already written). Only a grant the client received
        counts in flight: counting a refused one would strand the count and block every
        later eviction of `model`."""
        if self._fx.grant_serve(req, model):
            self._serving[req] = model
            self._in_flight[model] = self._in_flight.get(model, 0) + 1
            assert req.dispatch is not None
            self._stats.dispatched[req.dispatch.band] += 1
        else:
            self._release(req)

    def _finish_serving(self, req: Request) -> str:
        """Account a ServeDone; returns the model it was served by."""
        model = self._serving.pop(req, None)
        if model is None:
            raise InvariantViolation(
                f"ServeDone for request seq={req.seq} ({req.model!r}), which is not "
                "being served (never granted, or done twice)")
        left = self._in_flight.get(model, 0) - 1
        if left < 0:
            raise InvariantViolation(f"in-flight count of {model!r} would go negative")
        if left:
            self._in_flight[model] = left
        else:
            del self._in_flight[model]
        self._release(req)
        return model

    def _fail(self, req: Request, error: SchedulingError) -> None:
        self._release(req)
        self._fx.grant_error(req, error)

    def _reserve(self, req: Request) -> None:
        self._holders.add(req)
        self._reserved[req.model] = self._reserved.get(req.model, 0) + 1

    def _release(self, req: Request) -> None:
        if req not in self._holders:
            raise InvariantViolation(f"releasing a slot request seq={req.seq} never reserved")
        self._holders.remove(req)
        left = self._reserved[req.model] - 1
        if left:
            self._reserved[req.model] = left
        else:
            del self._reserved[req.model]
