"""Which running models must stop before a target can load: llama-swap's group swapper.

Pure and quiet: no logging, no mutation, no Django. It is asked again on every queue drain, so
it must be cheap and give the same answer for the same input.

Rules (llama-swap `groupSwapper`), with tg = the target's group:
  - a running model in the same group is evicted when tg has `swap`;
  - a running model in another group is evicted when tg is `exclusive` and that other group
    is not `persistent`.
Models in no group form the implicit group `(default)`, swap and exclusive: one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

DEFAULT_GROUP = "(default)"


class Swapper(Protocol):
    """What the schedulers ask of a router: `GroupSwapper` here, `MatrixSwapper`
    (scheduling/core/matrix.py). Pure, and the same answer for the same input."""

    def eviction_for(self, target: str, running: Iterable[str]) -> list[str]:
        """The running models that must stop before `target` loads, sorted."""
        ...

    def explain(self, target: str, running: Iterable[str]) -> str:
        """Why, in words, for the one log line per swap."""
        ...


@dataclass(frozen=True)
class Group:
    group_id: str
    members: frozenset[str]
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False


class GroupSwapper:
    def __init__(self, groups: Iterable[Group], models: Iterable[str]) -> None:
        self._group_of: dict[str, Group] = {}
        for group in groups:
            for member in group.members:
                self._group_of[member] = group
        ungrouped = frozenset(m for m in models if m not in self._group_of)
        if ungrouped:
            default = Group(DEFAULT_GROUP, ungrouped)
            for member in ungrouped:
                self._group_of[member] = default

    def group_of(self, model: str) -> Group:
        return self._group_of[model]

    def eviction_for(self, target: str, running: Iterable[str]) -> list[str]:
        """The running models that must stop before `target` loads, sorted for determinism."""
        tg = self._group_of[target]
        evict = []
        for other in running:
            if other == target:
                continue
            og = self._group_of.get(other)
            if og is None:  # no longer defined (deleted in admin): nothing protects it
                evict.append(other)
            elif og is tg:
                if tg.swap:
                    evict.append(other)
            elif tg.exclusive and not og.persistent:
                evict.append(other)
        return sorted(set(evict))

    def explain(self, target: str, running: Iterable[str]) -> str:
        return f"group {self._group_of[target].group_id!r}"
