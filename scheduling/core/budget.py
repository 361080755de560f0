"""Serial's affinity budget (issue 23): affinity may hold a request back, but not for ever.

The swap-affinity bonus saves swaps by serving the loaded model's requests first; its price
is bounded only by bonus x agingDivisor (600 s with the defaults), while what it can save is
one swap. That is a rent-or-buy choice: holding a request back ("renting") is worth it only
while the time it costs stays within a few swap-times ("buying" the swap). So, with a budget:

    once a waiting request has lost picks only because of the affinity term for at least
    the budget, affinity is ignored for it until it is served (granted) or leaves the
    queue (cancelled, failed).

Definitions, as serial.py applies them:
  - *lost a pick only because of affinity*: at a pick (a walk step that grants a request or
    starts a swap for it), among the candidates (the queued requests of the models not yet
    blocked in that walk), the winner by (priority + aging, seq), i.e. without affinity, is
    this request, and the winner with affinity is another. The same test moves the
    `pick_changed_by_affinity` counter.
  - *for at least the budget*: the clock starts at its first such lost pick (it never
    restarts while it waits) and the budget is spent at a later pick it would lose the same
    way at `now - first >= budget`. That pick is not made: the walk starts again.
  - *affinity is ignored for it*: its model is ranked as if it were loaded (it gets the
    bonus too), so the affinity term no longer separates it from the loaded model, and the
    walk that follows serves it first (it was the best without affinity). The rest of the
    box keeps its affinity. Ignoring affinity for the whole box instead (bonus 0 while it
    waits) gives the same figures on the issue's three traces but, on a saturated mixed
    workload, turns the box into bonus 0 for as long as the request is held back by higher
    bands: +55% swaps there against +10% this way (bench/README.md, "affinity budget").
  - the bound it gives: on a one-at-a-time box, a request is kept back by affinity at most
    the budget plus the service running when the budget ran out (the next pick comes when
    it ends); then its swap starts.

The budget is `SchedulerConfig.affinity_budget` seconds, or with `affinity_budget_swaps` = k
(the `auto` form), k x the swap cost of the waiting request's model, measured here: from the
`now` of the event whose walk started a swap to that model to the `now` of its successful
SwapDone (no clock reads), the latest measurement per model. The waiting request's model,
not the loaded one: that swap is what serving it costs and what affinity avoids by holding it
back (the swap back to the loaded model is its twin); it is also the one known when the rule
is applied. Before a model's first measured swap, `assumed_swap_cost` stands in.

Pure: standard library only. Not handed over on a policy switch: a new serial starts with no
lost picks and no measurements.
"""

from __future__ import annotations

import math

from scheduling.core.config import SchedulerConfig
from scheduling.core.events import Request

DEFAULT_ASSUMED_SWAP_COST = 10.0  # seconds, when the config gives no usable value


def _positive(x: object) -> float:
    """A usable number of seconds or swaps; anything else (negative, NaN, not a number) is
    off rather than a surprise."""
    return float(x) if isinstance(x, int | float) and math.isfinite(x) and x > 0 else 0.0


class AffinityBudget:
    """The budget's books: first lost pick per waiting request, the requests whose budget
    ran out (their models rank as loaded while they wait), and the measured swap costs."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._seconds = 0.0
        self._swaps = 0.0
        self._assumed = DEFAULT_ASSUMED_SWAP_COST
        self._first_lost: dict[Request, float] = {}
        self._overriding: set[Request] = set()
        self._swap_started: dict[str, float] = {}
        self._swap_cost: dict[str, float] = {}
        self.configure(config)

    def configure(self, config: SchedulerConfig) -> bool:
        """Adopt a config; returns True if this ended an override (the budget was turned
        off while one lasted): ranks change."""
        self._seconds = _positive(config.affinity_budget)
        self._swaps = _positive(config.affinity_budget_swaps)
        self._assumed = _positive(config.assumed_swap_cost) or DEFAULT_ASSUMED_SWAP_COST
        if self.on:
            return False
        self._first_lost.clear()
        was = bool(self._overriding)
        self._overriding.clear()
        return was

    @property
    def on(self) -> bool:
        return self._swaps > 0 or self._seconds > 0

    @property
    def overriding(self) -> bool:
        """Whether a request's budget ran out and it still waits."""
        return bool(self._overriding)

    def budget_for(self, req: Request, model: str | None = None) -> float:
        """Seconds `req` may lose picks to affinity (0 when the budget is off); `auto` is
        k x the swap cost of `model`, the model it would run on (a selector's request: the
        target its selector picks now), else its own."""
        if self._swaps > 0:
            return self._swaps * self.swap_cost(model or req.model)
        return self._seconds

    def swap_cost(self, model: str) -> float:
        """The latest measured swap cost of `model`, else the assumed one."""
        return self._swap_cost.get(model, self._assumed)

    def swap_costs(self) -> dict[str, float]:
        """Every measured swap cost (model -> seconds); read-only for metrics and tests."""
        return dict(self._swap_cost)

    def lost(self, req: Request, now: float, model: str | None = None) -> bool:
        """`req` lost a pick only because of affinity at `now`: note its first such pick;
        True when this spent its budget: it joins the overriding requests, and the pick must
        be decided again. False for one already overriding (it cannot lose twice). `model`:
        the model it would run on, for `auto` (`budget_for`)."""
        first = self._first_lost.setdefault(req, now)
        if req not in self._overriding and now - first >= self.budget_for(req, model):
            self._overriding.add(req)
            return True
        return False

    def lifted(self) -> set[str]:
        """The models (or selectors) of the requests whose budget ran out."""
        return {r.model for r in self._overriding}

    def forget(self, req: Request) -> bool:
        """`req` no longer waits (granted, cancelled, failed); True if that ended its
        override (ranks change)."""
        self._first_lost.pop(req, None)
        if req in self._overriding:
            self._overriding.remove(req)
            return True
        return False

    def swap_started(self, model: str, now: float) -> None:
        self._swap_started[model] = now

    def swap_done(self, model: str, now: float) -> None:
        """A swap to `model` succeeded at `now`: its cost is measured."""
        started = self._swap_started.pop(model, None)
        if started is not None and now >= started:
            self._swap_cost[model] = now - started
