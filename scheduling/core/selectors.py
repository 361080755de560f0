"""Selectors (llama-swap's `internal/server/selector.go`): one requested name, several
targets, the target chosen by the scheduler when it dispatches the request.

llama-swap picks the target when the request arrives, from the processes' states read at
that moment; a request that then waits behind a swap keeps that choice even when, by the
time it could go, another target is ready. Here the choice is made where the scheduler
decides to dispatch (fifo's `_place`, serial's walk), from its own books at that moment:
which target is loaded, loading or being stopped, and how many requests each holds. Until
then the request is held under the selector id (its admission slot too), and a request that
cannot go stays unbound, to be decided again at the next drain.

`choose` is the strategy itself, a pure function of what the books say about each target;
`SelectorBooks` is the part of the books (`Ledger`) that reads them for it and moves a
request from its selector to its target.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduling.core.config import SchedulerConfig, SelectorConfig
from scheduling.core.effects import READY, STARTING, STOPPING, Effects
from scheduling.core.events import Request
from scheduling.core.handover import Swap

# What a target is, for a strategy (besides READY, STARTING, STOPPING from effects.py).
COLD = "cold"  # not loaded: using it needs a load
PEER = "peer"  # a peer's model: never loaded here, always available

# A strategy's answer: the target (None: every target is being stopped; wait), and whether
# spillover's round robin decided it (its turn then advances once the request is bound).
Choice = tuple[str | None, bool]


def choose(sel: SelectorConfig, condition: Callable[[str], str],
           reserved: Callable[[str], int], turn: int) -> Choice:
    """The target `sel` picks now. `condition(t)`: READY, STARTING, STOPPING, COLD or PEER;
    `reserved(t)`: requests queued, waiting or in flight on t; `turn`: the selector's round
    robin counter.

    - pin: the first target;
    - warm: the first READY target, else the first STARTING one, else the first (loaded);
    - spillover: targets READY or STARTING (or holding requests) are active, the rest cold,
      those being stopped neither; while the least busy active target holds fewer than
      `spillover` requests it gets the request (ties in turn), else the first cold target
      starts, else (all active, all full) the least busy active one, ties in turn.
    """
    targets = sel.targets
    if not targets:
        return None, False
    if sel.strategy == "warm":
        for wanted in (READY, STARTING):
            for t in targets:
                if condition(t) == wanted:
                    return t, False
        return targets[0], False
    if sel.strategy != "spillover":  # pin
        return targets[0], False
    active: list[str] = []
    cold: list[str] = []
    for t in targets:
        c = condition(t)
        if c == STOPPING:
            continue
        if c in (READY, STARTING) or reserved(t) > 0:
            active.append(t)
        else:
            cold.append(t)
    if not active:
        return (cold[0], False) if cold else (None, False)
    least = min(reserved(t) for t in active)
    if least >= max(sel.spillover, 1) and cold:
        return cold[0], False
    tied = [t for t in active if reserved(t) == least]
    return tied[turn % len(tied)], True


class SelectorBooks:
    """The selector side of `Ledger`: what a target is now, the strategy's pick, and the
    move of a request (and its admission slot) from its selector to its target."""

    _config: SchedulerConfig
    _fx: Effects
    _active: dict[str, Swap]
    _reserved: dict[str, int]
    _exited: set[str]
    _turns: dict[str, int]  # selector id -> spillover's round robin counter

    def _held(self, model: str) -> bool:
        raise NotImplementedError

    def _being_evicted(self, model: str) -> bool:
        raise NotImplementedError

    def _unbound(self, req: Request) -> SelectorConfig | None:
        """`req`'s selector when it is a selector request not yet bound to a target."""
        return self._config.selectors.get(req.model) if not req.selector else None

    def _condition(self, target: str) -> str:
        """What `target` is for a strategy, from the books now: an explicit unload, a
        pending stop or an eviction make it STOPPING; an active swap STARTING; READY only
        when nothing of that holds and its process has not exited since it loaded."""
        if target in self._config.peer_models:
            return PEER
        if target not in self._config.models:
            return STOPPING  # not defined (a stale target): never chosen while others exist
        if self._held(target) or self._being_evicted(target):
            return STOPPING
        if target in self._active:
            return STARTING
        state = self._fx.model_state(target)
        if state == READY and target in self._exited:
            return COLD
        return state if state in (READY, STARTING, STOPPING) else COLD

    def selector_pick(self, selector_id: str) -> str | None:
        """The target `selector_id` would get if dispatched now (for the dashboard), None
        when it names no usable target or is not defined. Read-only."""
        try:
            return self._pick(selector_id)[0]
        except (KeyError, ValueError):
            return None

    def _pick(self, selector_id: str) -> Choice:
        """The target selector `selector_id` picks now (no side effect)."""
        sel = self._config.selectors[selector_id]
        usable = tuple(t for t in sel.targets
                       if t in self._config.models or t in self._config.peer_models)
        if usable != sel.targets:
            sel = SelectorConfig(sel.strategy, usable, sel.spillover)
        return choose(sel, self._condition, lambda t: self._reserved.get(t, 0),
                      self._turns.get(selector_id, 0))

    def _defined(self, name: str) -> bool:
        """A model, or a selector with at least one target still defined."""
        if name in self._config.models:
            return True
        sel = self._config.selectors.get(name)
        return sel is not None and any(
            t in self._config.models or t in self._config.peer_models for t in sel.targets)

    def _bind(self, req: Request, target: str, turned: bool = False) -> None:
        """`req` becomes a request for `target`: its slot moves with it, and spillover's
        turn advances when the round robin chose it."""
        selector_id = req.model
        self._rebook(req, target)
        req.selector = selector_id
        if turned:
            self._turns[selector_id] = self._turns.get(selector_id, 0) + 1

    def _unbind(self, req: Request) -> None:
        """Undo `_bind` for a request that could not go after all (fifo's placement)."""
        self._rebook(req, req.selector)
        req.selector = ""

    def _rebook(self, req: Request, model: str) -> None:
        left = self._reserved[req.model] - 1
        if left:
            self._reserved[req.model] = left
        else:
            del self._reserved[req.model]
        req.model = model
        self._reserved[model] = self._reserved.get(model, 0) + 1

    def _affine_selectors(self, affine: set[str]) -> None:
        """Serial: give each selector's queued requests the affinity of the target its
        strategy would pick now (docs/scheduler-design.md, "Selectors")."""
        for selector_id in self._config.selectors:
            affine.discard(selector_id)
            if self._pick(selector_id)[0] in affine:
                affine.add(selector_id)
