"""A matrix set as it is typed in the admin: compiled with the rest of the matrix (the other
sets in definition order, the vars, the models) by scheduling/routing_checks.py, the
importer's rules, and the combinations it allows spelled out for the page.

The admin's check view answers `check_set` as JSON while the expression is typed
(scheduling/matrix_check.js), and the set's form runs it again on save, so what the page
showed is what a save accepts. The set is compiled even under the group router: a matrix
known to compile is one the settings page can switch to.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from django.db.models import QuerySet

from scheduling import routing_checks
from scheduling.core.matrix import MatrixError, parse_dsl
from scheduling.llamaswap.errors import ConfigError
from scheduling.routing_models import MatrixSet

#: combinations the check lists at most: a set of many `|` under `&` multiplies out, and the
#: page is for reading (the solver never enumerates them).
COMBINATIONS_SHOWN = 50


@dataclass(frozen=True)
class SetCheck:
    """What the page shows under a set's expression: `error`, or the `combinations` it allows
    (maximal ones, each sorted; `truncated` when there were more than COMBINATIONS_SHOWN)."""

    error: str = ""
    combinations: tuple[tuple[str, ...], ...] = ()
    truncated: bool = False
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"ok": not self.error, "error": self.error,
                "combinations": [list(c) for c in self.combinations],
                "truncated": self.truncated, "note": self.note}


def json_types(variables: Any, evict_costs: Any) -> str:
    """What is wrong with the matrix's JSON fields' types ("" when nothing): a form may hold
    any JSON, the checks expect objects."""
    if not isinstance(variables, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in variables.items()):
        return 'matrix vars must be an object of names to model ids, e.g. {"g": "gemma"}'
    if not isinstance(evict_costs, dict):
        return ('matrix evict costs must be an object of model ids or vars to positive '
                'integers, e.g. {"llama-70B": 30}')
    return ""


def _other_sets(pk: int | None) -> QuerySet[MatrixSet]:
    return MatrixSet.objects.all() if pk is None else MatrixSet.objects.exclude(pk=pk)


def _sets_with(name: str, dsl: str, position: int, pk: int | None) -> list[tuple[str, str]]:
    """The matrix's sets in definition order as they would be after saving this one."""
    rows = [(r.position, r.name, r.dsl) for r in _other_sets(pk)]
    rows.append((position, name, dsl))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [(n, d) for _, n, d in rows]


def _combinations(sets: Mapping[str, str], name: str, variables: Mapping[str, str]
                  ) -> tuple[list[frozenset[str]], bool]:
    """The maximal combinations set `name` allows (its subsets are allowed too), in the order
    the expression gives them; only for a matrix that compiled."""
    trees = {n: parse_dsl(d) for n, d in sets.items()}
    truncated = False
    memo: dict[str, list[frozenset[str]]] = {}

    def expand(node: Any) -> list[frozenset[str]]:
        nonlocal truncated
        if node.kind == "leaf":
            return [frozenset({variables.get(node.name, node.name)})]
        if node.kind == "ref":
            if node.name not in memo:
                memo[node.name] = expand(trees[node.name])
            return memo[node.name]
        parts = [expand(child) for child in node.children]
        if node.kind == "or":
            out = [c for part in parts for c in part]
        else:
            out = []
            for combo in itertools.product(*parts):
                out.append(frozenset().union(*combo))
                if len(out) >= COMBINATIONS_SHOWN * 20:
                    truncated = True
                    break
        return _maximal(out)

    return expand(trees[name]), truncated


def _maximal(combos: Iterable[frozenset[str]]) -> list[frozenset[str]]:
    unique = list(dict.fromkeys(combos))
    return [c for c in unique if not any(c < other for other in unique)]


def check_set(name: str, dsl: str, position: int = 0, pk: int | None = None) -> SetCheck:
    """Compile the matrix with this set as typed (module docstring)."""
    name = name.strip()
    if not name:
        return SetCheck(error="the set needs a name (`+name` refers to it)")
    if _other_sets(pk).filter(name=name).exists():
        return SetCheck(error=f"a matrix set named {name!r} already exists: pick another name")
    try:
        parse_dsl(dsl)
    except MatrixError as exc:  # in the model's clean() words, which a save shows
        return SetCheck(error=f"set {name!r}: {exc}")
    view = routing_checks.database_view()
    sets = tuple(_sets_with(name, dsl, position, pk))
    if wrong := json_types(view.matrix_vars, view.matrix_evict_costs):
        return SetCheck(error=wrong)
    try:
        # compiled even under the group router, so a set is right before the switch
        routing_checks.compile_matrix(replace(view, router="matrix", matrix_sets=sets))
        if view.router == "matrix":  # what else the sets decide (spillover coexistence)
            routing_checks.check(replace(view, matrix_sets=sets))
        combos, truncated = _combinations(dict(sets), name, view.matrix_vars)
    except ConfigError as exc:
        return SetCheck(error=exc.message)
    shown = tuple(tuple(sorted(c)) for c in combos[:COMBINATIONS_SHOWN])
    note = ""
    if view.router != "matrix":
        note = ("The router in force is group: the matrix applies once the settings page's "
                "router is matrix.")
    return SetCheck(combinations=shown, truncated=truncated or len(combos) > len(shown),
                    note=note)
