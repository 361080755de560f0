"""Which running models must stop before a target can load: llama-swap's matrix swapper.

The matrix lists the combinations of models that may run together, as named set expressions
(`internal/matrix/dsl.go`, `program.go`): `a & b` (together), `a | b` (either), parentheses,
`+name` (another set's expression inlined). Every set also allows its subsets. For a target
not running, each set that can contain it is costed by the `evict_costs` (default 1) of the
running models it leaves out; the cheapest wins, ties to the set defined first (a set's
references count as defined before it, as llama-swap orders them). A target in no set runs
alone: everything else stops. A target already running evicts nothing.

Pure and quiet like `swapper.py`: no logging, no clock. Answers are cached per (target,
running set), since the schedulers ask again on every queue drain; `decision` gives the
schedulers what to log once per swap (set, expression, evicted, cost).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

VAR_NAME = re.compile(r"^[a-zA-Z0-9.-]{1,32}$")


class MatrixError(ValueError):
    """A matrix that cannot be compiled; the message names the set, var or model."""


@dataclass(frozen=True)
class Decision:
    evict: tuple[str, ...]  # running models to stop, in the order given
    target_set: tuple[str, ...]  # the chosen combination's models, sorted
    set_name: str = ""  # "" when the target runs alone (in no set) or nothing had to stop
    dsl: str = ""
    cost: int = 0


# ---- the DSL -----------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<op>[&|()])|\+(?P<ref>[\w.-]*)|(?P<ident>[\w.-]+)|(?P<bad>\S))")


@dataclass(frozen=True)
class _Node:
    kind: str  # "leaf" | "ref" | "and" | "or"
    name: str = ""
    children: tuple[_Node, ...] = ()


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m is not None  # `bad` matches any non-space character
        if m.group("bad") is not None:
            raise MatrixError(f"unexpected character {m.group('bad')!r} at position "
                              f"{m.start('bad')}")
        if m.group("ref") is not None:
            if not m.group("ref"):
                raise MatrixError(f"expected set name after '+' at position {m.end()}")
            out.append(("ref", m.group("ref")))
        elif m.group("op") is not None:
            out.append((m.group("op"), m.group("op")))
        else:
            out.append(("ident", m.group("ident")))
        pos = m.end()
    out.append(("eof", ""))
    return out


def parse_dsl(text: str) -> _Node:
    """The expression's tree; MatrixError says what is wrong and where."""
    if not text.strip():
        raise MatrixError("empty expression")
    toks = _tokens(text)
    pos = 0

    def peek() -> str:
        return toks[pos][0]

    def take() -> tuple[str, str]:
        nonlocal pos
        t = toks[pos]
        if t[0] != "eof":
            pos += 1
        return t

    def or_expr() -> _Node:
        kids = [and_expr()]
        while peek() == "|":
            take()
            kids.append(and_expr())
        return kids[0] if len(kids) == 1 else _Node("or", children=tuple(kids))

    def and_expr() -> _Node:
        kids = [atom()]
        while peek() == "&":
            take()
            kids.append(atom())
        return kids[0] if len(kids) == 1 else _Node("and", children=tuple(kids))

    def atom() -> _Node:
        kind, val = take()
        if kind == "ident":
            return _Node("leaf", val)
        if kind == "ref":
            return _Node("ref", val)
        if kind == "(":
            inner = or_expr()
            if take()[0] != ")":
                raise MatrixError("missing closing parenthesis")
            return inner
        raise MatrixError(f"unexpected token {val!r}" if val else "unexpected end")

    root = or_expr()
    if peek() != "eof":
        raise MatrixError(f"unexpected token {toks[pos][1]!r} after expression")
    return root


def _names(node: _Node, kind: str) -> list[str]:
    if node.kind == kind:
        return [node.name]
    return [n for c in node.children for n in _names(c, kind)]


# ---- the solver --------------------------------------------------------------------------

# One reachable combination, projected on the models a query cares about: (the relevant
# models in it, every model it names). Combinations equal on the relevant models collapse.
_State = tuple[frozenset[str], frozenset[str]]


def _frontier(states: list[_State], cand: _State) -> list[_State]:
    """Keep only maximal relevant masks (llama-swap's addToFrontier): a superset always
    costs no more, since every relevant model is the target or has a positive cost."""
    for s in states:
        if cand[0] <= s[0]:
            return states
    return [s for s in states if not s[0] <= cand[0]] + [cand]


class MatrixSwapper:
    """The `Swapper` for `routing.router.use: matrix` (module docstring)."""

    def __init__(self, sets: list[tuple[str, str, _Node]], trees: dict[str, _Node],
                 costs: dict[str, int]) -> None:
        """Use `compile`; this takes its checked parts."""
        self._sets = sets  # (name, dsl, tree with names resolved), in llama-swap's order
        self._trees = trees  # name -> tree, for `+ref`
        self._costs = costs  # model id -> cost
        self._support = [frozenset(_names(self._expand(root), "leaf"))
                         for _, _, root in sets]
        self._solve = lru_cache(maxsize=4096)(self._solve_uncached)

    @classmethod
    def compile(cls, sets: Sequence[tuple[str, str]], variables: Mapping[str, str],
                evict_costs: Mapping[str, int], models: Iterable[str]) -> MatrixSwapper:
        """Parse and check the sets (names resolved through `variables`, then model ids),
        the vars and the costs, as llama-swap's `ValidateMatrix` does; MatrixError names
        what is wrong. No sets at all is allowed here (every model runs alone); the config
        readers require at least one, as llama-swap does."""
        known = frozenset(models)
        for var, model in variables.items():
            if not VAR_NAME.match(var):
                raise MatrixError(f"var key {var!r} must contain only alphanumeric, '-' or "
                                  "'.' characters and be 1-32 characters long")
            if model not in known:
                raise MatrixError(f"var key {var!r} references unknown model {model!r}")

        def resolve(ident: str) -> str | None:
            if ident in variables:
                return variables[ident]
            return ident if ident in known else None

        costs: dict[str, int] = {}
        for key, cost in evict_costs.items():
            if not isinstance(cost, int) or isinstance(cost, bool) or cost <= 0:
                raise MatrixError(f"evict_cost for {key!r} must be a positive integer, "
                                  f"got {cost!r}")
            real = resolve(key)
            if real is None:
                raise MatrixError(f"evict_costs: unknown var or model {key!r}")
            costs[real] = cost
        names = [name for name, _ in sets]
        if len(set(names)) != len(names):
            raise MatrixError("set names must be unique")
        trees: dict[str, _Node] = {}
        deps: dict[str, list[str]] = {}
        for name, dsl in sets:
            try:
                root = parse_dsl(dsl)
            except MatrixError as exc:
                raise MatrixError(f"set {name!r}: {exc}") from None

            def link(node: _Node, name: str = name) -> _Node:
                if node.kind == "leaf":
                    real = resolve(node.name)
                    if real is None:
                        raise MatrixError(f"set {name!r}: unknown var or model {node.name!r}")
                    return _Node("leaf", real)
                if node.kind == "ref":
                    if node.name not in names:
                        raise MatrixError(f"set {name!r} references undefined set "
                                          f"{node.name!r}")
                    return node
                return _Node(node.kind, children=tuple(link(c) for c in node.children))

            trees[name] = link(root)
            deps[name] = list(dict.fromkeys(_names(root, "ref")))
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str) -> None:
            if state.get(name) == 1:
                raise MatrixError(f"circular reference detected involving set {name!r}")
            if state.get(name) == 2:
                return
            state[name] = 1
            for d in deps[name]:
                visit(d)
            state[name] = 2
            order.append(name)

        for name in names:
            visit(name)
        dsl_of = dict(sets)
        return cls([(n, dsl_of[n], trees[n]) for n in order], trees, costs)

    def _expand(self, node: _Node) -> _Node:
        """The tree with references inlined (for the support sets only)."""
        if node.kind == "ref":
            return self._expand(self._trees[node.name])
        if node.kind == "leaf":
            return node
        return _Node(node.kind, children=tuple(self._expand(c) for c in node.children))

    # ---- the Swapper protocol ----------------------------------------------------------

    def eviction_for(self, target: str, running: Iterable[str]) -> list[str]:
        """The running models that must stop before `target` loads, sorted."""
        return sorted(self.decision(target, running).evict)

    def explain(self, target: str, running: Iterable[str]) -> str:
        """The decision in words, for the one log line per swap."""
        d = self.decision(target, running)
        if not d.set_name:
            return "in no matrix set: runs alone" if d.evict else "no matrix set needed"
        return (f"matrix set {d.set_name!r} ({d.dsl}) keeps {', '.join(d.target_set)}; "
                f"eviction cost {d.cost}")

    def can_contain_all(self, models: Iterable[str]) -> bool:
        """Whether one combination holds every one of `models` (a spillover selector's
        targets must, as llama-swap checks)."""
        want = frozenset(models)
        if not want:
            return True
        for i, (_, _, root) in enumerate(self._sets):
            if not want <= self._support[i]:
                continue
            if any(want <= mask for mask, _ in self._evaluate(root, want, {})):
                return True
        return False

    def decision(self, target: str, running: Iterable[str]) -> Decision:
        return self._solve(target, tuple(sorted(set(running))))

    # ---- solving -------------------------------------------------------------------------

    def _evaluate(self, node: _Node, relevant: frozenset[str],
                  memo: dict[int, list[_State]]) -> list[_State]:
        key = id(node)
        if key in memo:
            return memo[key]
        states: list[_State] = []
        if node.kind == "leaf":
            states = [(frozenset({node.name}) & relevant, frozenset({node.name}))]
        elif node.kind == "ref":
            states = self._evaluate(self._trees[node.name], relevant, memo)
        elif node.kind == "or":
            for child in node.children:
                for st in self._evaluate(child, relevant, memo):
                    states = _frontier(states, st)
        else:
            states = [(frozenset(), frozenset())]
            for child in node.children:
                combined: list[_State] = []
                right = self._evaluate(child, relevant, memo)
                for left in states:
                    for r in right:
                        combined = _frontier(combined, (left[0] | r[0], left[1] | r[1]))
                states = combined
        memo[key] = states
        return states

    def _solve_uncached(self, target: str, running: tuple[str, ...]) -> Decision:
        if target in running:
            return Decision((), running)
        others = tuple(m for m in running if m != target)
        relevant = frozenset((target, *others))
        memo: dict[int, list[_State]] = {}
        best: tuple[int, int, _State] | None = None
        for i, (_, _, root) in enumerate(self._sets):
            if target not in self._support[i]:
                continue
            for st in self._evaluate(root, relevant, memo):
                if target not in st[0]:
                    continue
                cost = sum(self._costs.get(m, 1) for m in others if m not in st[0])
                if best is None or cost < best[0]:
                    best = (cost, i, st)
        if best is None:
            return Decision(others, (target,))
        cost, i, (mask, named) = best
        name, dsl, _ = self._sets[i]
        return Decision(tuple(m for m in others if m not in mask), tuple(sorted(named)),
                        name, dsl, cost)
