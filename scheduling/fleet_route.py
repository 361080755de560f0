"""Which node of the fleet serves a request (issue 24, item 4a): here, another node, or none.

A plain function of what the caller read, so that it can be tested against every fleet a
property test can draw: no database, no clock, no Django. Its input is a snapshot of the
fleet view (each node's last heartbeat, judged up or not by the reader), never a live read,
so one decision sees one consistent fleet. Forwarding goes at most one hop: the caller never
asks for a request that arrived from another node.

The rules (docs/fleet.md, "Forwarding between nodes"):
- a model this node does not serve goes to a serving node that is up, one that has it
  loaded first (no load to wait for), the shortest queue among those; with none up, nobody
  serves it (`NoneUp` names the nodes and what each is);
- a model this node serves stays here unless another serving node that is up has at least
  `margin` fewer requests waiting (all its models together: one box's GPUs serve them all),
  margin None turning that off. Ties go to the loaded node, then to the node name, so that
  two readers of one snapshot agree.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeView:
    """One node as the snapshot has it."""

    node: str
    url: str  # "" for a node that advertises none (older than forwarding): never chosen
    status: str  # "up", "draining", "down" or "stopped": only "up" takes a request
    loaded: frozenset[str] = frozenset()
    waiting: int = 0  # requests waiting on the node, every model and band together

    @property
    def up(self) -> bool:
        return self.status == "up" and bool(self.url)


@dataclass(frozen=True)
class NoneUp:
    """No node that serves the model is up: what each of them is, for the 503's message."""

    model: str
    nodes: tuple[tuple[str, str], ...]  # (node, status), status "unknown" for no row

    @property
    def message(self) -> str:
        if not self.nodes:
            return (f"model {self.model!r} is served by no node of this fleet that is known "
                    "(no node publishes a heartbeat with an address to forward to)")
        said = ", ".join(f"{n} ({s})" for n, s in self.nodes)
        return (f"model {self.model!r} is not served by this node, and no node that serves it "
                f"is up: {said}; start one of them or wait until its heartbeat is back")


def _best(candidates: Sequence[NodeView], model: str) -> NodeView:
    """The shortest queue, a node with the model loaded first among equals, then by name."""
    return min(candidates, key=lambda n: (n.waiting, model not in n.loaded, n.node))


def choose(model: str, here: str, serves_here: bool, serving: Collection[str],
           nodes: Sequence[NodeView], margin: int | None) -> NodeView | NoneUp | None:
    """The node to forward to, `NoneUp` when the model is not served here and no node that
    serves it is up, or None to serve here.

    `serving`: the nodes the model is placed on, empty for every node. `nodes`: the snapshot,
    this node's row among them (its `waiting` is what a shorter queue is measured against;
    without it nothing local is forwarded)."""
    def serves(name: str) -> bool:
        return not serving or name in serving

    others = [n for n in nodes if n.node != here and serves(n.node)]
    up = [n for n in others if n.up]
    if not serves_here:
        if not up:
            seen = {n.node: (n.status if n.url else f"{n.status}, no address") for n in others}
            named = sorted(set(serving) - {here}) if serving else sorted(seen)
            return NoneUp(model, tuple((n, seen.get(n, "unknown")) for n in named))
        loaded = [n for n in up if model in n.loaded]
        return _best(loaded or up, model)
    if margin is None or not up:
        return None
    mine = next((n for n in nodes if n.node == here), None)
    if mine is None:
        return None
    best = _best(up, model)
    return best if mine.waiting - best.waiting >= margin else None
