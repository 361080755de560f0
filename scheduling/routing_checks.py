"""The rules that tie the routing sections to the rest of a config, in one place: the importer
runs them on a parsed file, the admin's forms on the database with the edited row in it.

llama-swap applies them when it loads a config (`internal/config/load.go`, `matrix.go`,
`peer.go`, `selectors.go`), in this order, and so do we:
- the matrix, when it is the router in force, compiles against the defined models;
- every peer model's `<peer>/<model>` name is unambiguous and no model id, alias, selector
  or profile pin takes it (`ValidatePeerNamespace`);
- a selector: its id is no model id or alias, no target is a selector, a `warm` selector's
  targets are local, a `spillover` selector has `spillover >= 1`, no two targets resolve to
  the same model, and its local targets can run together (one matrix set holds them all, or
  one `swap: false` group);
- a profile's pins point at something.

One deliberate difference: a selector target or a pin that names nothing defined is a
warning, not an error, as group members, priorities and preload entries naming no model are
(docs/configuration.md). It is kept as written, so defining the model later brings it in.

Pure: plain data in (`RoutingView`), `ConfigError` or warnings out; `database_view` and
`check_candidate` read the tables for the admin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduling.catalog import find_peer_model
from scheduling.core.matrix import MatrixError, MatrixSwapper
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import (
    IMPLICIT_GROUP,
    ParsedConfig,
    ParsedPeer,
    ParsedProfile,
    ParsedSelector,
)

MATRIX_PATH = "routing.router.settings.matrix"


@dataclass(frozen=True)
class RoutingView:
    """What the checks need of a config, from a parsed file or from the database."""

    models: frozenset[str]  # every defined model id (enabled or not)
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> model id
    groups: Mapping[str, tuple[bool, frozenset[str]]] = field(default_factory=dict)
    router: str = "group"
    matrix_vars: Mapping[str, str] = field(default_factory=dict)
    matrix_evict_costs: Mapping[str, int] = field(default_factory=dict)
    matrix_sets: tuple[tuple[str, str], ...] = ()
    peers: tuple[ParsedPeer, ...] = ()
    selectors: tuple[ParsedSelector, ...] = ()
    profiles: tuple[ParsedProfile, ...] = ()

    def real_model(self, name: str) -> str | None:
        """A model id for a model id or alias (llama-swap's `RealModelName`)."""
        return name if name in self.models else self.aliases.get(name)

    def peer_model(self, name: str) -> tuple[str, str] | None:
        """(peer, model) for `<peer>/<model>`, else for a bare name exactly one peer lists
        (llama-swap's `ResolvePeerModel`: the qualified name wins)."""
        return find_peer_model(((p.peer_id, p.models) for p in self.peers), name)

    def resolve(self, name: str) -> str | None:
        """A selector target as the scheduler knows it: a local model id (aliases resolved)
        or `<peer>/<model>`; None when it names nothing (llama-swap's `ResolveBaseModel`:
        local names first)."""
        local = self.real_model(name)
        if local is not None:
            return local
        peer = self.peer_model(name)
        return f"{peer[0]}/{peer[1]}" if peer else None


def view_of(parsed: ParsedConfig) -> RoutingView:
    s = parsed.settings
    return RoutingView(
        models=frozenset(m.model_id for m in parsed.models),
        aliases={a: m.model_id for m in parsed.models for a in m.aliases if a != m.model_id},
        groups={g.group_id: (g.swap, frozenset(g.members)) for g in parsed.groups},
        router=s.router, matrix_vars=s.matrix_vars, matrix_evict_costs=s.matrix_evict_costs,
        matrix_sets=parsed.matrix_sets, peers=parsed.peers, selectors=parsed.selectors,
        profiles=parsed.profiles)


def check_parsed(parsed: ParsedConfig) -> list[str]:
    """`check` on a parsed file: what the importer runs before writing a row."""
    return check(view_of(parsed))


def compile_matrix(view: RoutingView) -> MatrixSwapper | None:
    """The matrix in force, compiled; None under the group router. ConfigError names the
    set, var or model that does not compile."""
    if view.router != "matrix":
        return None
    if not view.matrix_sets:
        raise ConfigError(f"{MATRIX_PATH}.sets", "matrix must define at least one set (a set "
                                                 "names models that may run together)")
    try:
        return MatrixSwapper.compile(view.matrix_sets, view.matrix_vars,
                                     view.matrix_evict_costs, view.models)
    except MatrixError as exc:
        raise ConfigError(MATRIX_PATH, f"{exc}; define the model under models:, or fix the "
                                       "set") from None


def check(view: RoutingView) -> list[str]:
    """Raise ConfigError for the first rule broken (llama-swap's order); return warnings
    for names that match nothing."""
    warnings: list[str] = []
    matrix = compile_matrix(view)
    _check_peer_namespace(view)
    selector_ids = {s.selector_id for s in view.selectors}
    for selector in view.selectors:
        warnings += _check_selector(view, selector, selector_ids, matrix)
    for profile in view.profiles:
        for pin, target in profile.pins.items():
            if target and view.resolve(target) is None and target not in selector_ids:
                warnings.append(
                    f"profiles.{profile.name}.pins.{pin}: {target!r} is not a model, alias, "
                    f"peer model or selector; while {profile.name!r} is active, requests for "
                    f"{pin!r} get 404 (define it, or fix the pin)")
    return warnings


def _check_peer_namespace(view: RoutingView) -> None:
    owner: dict[str, tuple[str, str]] = {}
    for peer in sorted(view.peers, key=lambda p: p.peer_id):
        for model in dict.fromkeys(peer.models):
            fqn = f"{peer.peer_id}/{model}"
            if fqn in owner:
                other = owner[fqn]
                raise ConfigError(f"peers.{peer.peer_id}.models",
                                  f"peer model name {fqn!r} is ambiguous between peers."
                                  f"{other[0]} model {other[1]!r} and peers.{peer.peer_id} "
                                  f"model {model!r}; rename a peer")
            owner[fqn] = (peer.peer_id, model)
    for fqn in sorted(owner):
        why = f"conflicts with fully qualified peer model name (of peers.{owner[fqn][0]})"
        if fqn in view.models:
            raise ConfigError(f"models.{fqn}", f"model ID {fqn!r} {why}; rename the model or "
                                               "the peer")
        if fqn in view.aliases:
            raise ConfigError(f"models.{view.aliases[fqn]}.aliases",
                              f"model {view.aliases[fqn]} alias {fqn!r} {why}")
        if any(s.selector_id == fqn for s in view.selectors):
            raise ConfigError(f"selectors.{fqn}", f"selector ID {fqn!r} {why}")
        for profile in view.profiles:
            if fqn in profile.pins:
                raise ConfigError(f"profiles.{profile.name}.pins.{fqn}",
                                  f"profile {profile.name} pin {fqn!r} {why}")


def _check_selector(view: RoutingView, s: ParsedSelector, selector_ids: set[str],
                    matrix: MatrixSwapper | None) -> list[str]:
    path = f"selectors.{s.selector_id}"
    if s.selector_id in view.models:
        raise ConfigError(path, f"name conflicts with model ID {s.selector_id!r}; rename the "
                                "selector")
    if s.selector_id in view.aliases:
        raise ConfigError(path, f"name conflicts with model alias {s.selector_id!r} (of "
                                f"{view.aliases[s.selector_id]!r}); rename the selector")
    if not s.targets:
        raise ConfigError(f"{path}.targets", "must contain at least one entry")
    warnings: list[str] = []
    resolved: list[str] = []
    local: list[str] = []
    for i, target in enumerate(s.targets):
        where = f"{path}.targets[{i}]"
        if target in selector_ids:
            raise ConfigError(where, f"references selector {target!r}; selector chaining is "
                                     "not supported (list its targets instead)")
        real = view.resolve(target)
        if real is None:
            warnings.append(f"{where}: {target!r} is not a model, alias or peer model; the "
                            "selector skips it until it is defined")
            continue
        is_local = view.real_model(target) is not None
        if s.strategy == "warm" and not is_local:
            raise ConfigError(where, "must resolve to a local model for strategy 'warm' "
                                     f"({target!r} is a peer's model; use pin or spillover)")
        resolved.append(real)
        if is_local:
            local.append(real)
    if s.strategy != "spillover":
        return warnings
    if s.spillover < 1:
        raise ConfigError(f"{path}.settings.spillover", "must be >= 1")
    seen: set[str] = set()
    for real in resolved:
        if real in seen:
            raise ConfigError(f"{path}.targets", f"contains duplicate resolved model {real!r}; "
                                                 "list each model once")
        seen.add(real)
    _check_coexistence(view, s.selector_id, local, matrix)
    return warnings


def _check_coexistence(view: RoutingView, selector_id: str, targets: Sequence[str],
                       matrix: MatrixSwapper | None) -> None:
    """A spillover selector runs its local targets side by side, so the router must let
    them (llama-swap's `validateSpilloverCoexistence`)."""
    path = f"selectors.{selector_id}.targets"
    if len(targets) <= 1:
        return
    if matrix is not None:
        if not matrix.can_contain_all(targets):
            raise ConfigError(path, "must all appear together in one expanded matrix set "
                                    f"({', '.join(targets)}); add a set that holds them")
        return
    group_of = {m: gid for gid, (_, members) in view.groups.items() for m in members}
    first = group_of.get(targets[0], IMPLICIT_GROUP)
    swap = view.groups[first][0] if first in view.groups else True
    if swap:
        raise ConfigError(path, "spillover targets must share a group with swap: false "
                                f"({targets[0]!r} is in {first!r}, where only one member "
                                "runs at a time)")
    for target in targets[1:]:
        if group_of.get(target, IMPLICIT_GROUP) != first:
            raise ConfigError(path, f"spillover targets must share one routing group "
                                    f"({targets[0]!r} is in {first!r}, {target!r} is not)")


# ---- the database, for the admin's forms ----------------------------------------------------

def database_view() -> RoutingView:
    """The routing as the database holds it now."""
    from scheduling.models import ModelDefinition, ModelGroup, ProxySettings
    from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

    settings = ProxySettings.load()
    defs = list(ModelDefinition.objects.values_list("model_id", "aliases",
                                                    "set_params_by_id", "group__group_id"))
    members: dict[str, set[str]] = {}
    for model_id, _, _, group_id in defs:
        if group_id:
            members.setdefault(group_id, set()).add(model_id)
    return RoutingView(
        models=frozenset(d[0] for d in defs),
        aliases={a: model_id for model_id, aliases, by_id, _ in defs
                 for a in [*(aliases or []), *(by_id or {})] if a != model_id},
        groups={g.group_id: (g.swap, frozenset(members.get(g.group_id, ())))
                for g in ModelGroup.objects.all()},
        router=settings.router, matrix_vars=dict(settings.matrix_vars or {}),
        matrix_evict_costs=dict(settings.matrix_evict_costs or {}),
        matrix_sets=tuple((m.name, m.dsl) for m in MatrixSet.objects.order_by("position",
                                                                              "name")),
        peers=tuple(peer_of(p) for p in Peer.objects.order_by("peer_id")),
        selectors=tuple(selector_of(s) for s in Selector.objects.order_by("selector_id")),
        profiles=tuple(profile_of(p) for p in Profile.objects.order_by("name")))


def peer_of(p: Any) -> ParsedPeer:
    return ParsedPeer(peer_id=p.peer_id, proxy=p.proxy, models=tuple(p.models_list or ()),
                      api_key=p.api_key, strip_params=p.strip_params,
                      set_params=dict(p.set_params or {}), timeouts=dict(p.timeouts or {}),
                      priority_forward=p.priority_forward)


def selector_of(s: Any) -> ParsedSelector:
    return ParsedSelector(selector_id=s.selector_id, strategy=s.strategy,
                          targets=tuple(s.targets or ()), spillover=s.spillover, name=s.name,
                          description=s.description, unlisted=s.unlisted,
                          metadata=dict(s.metadata or {}))


def profile_of(p: Any) -> ParsedProfile:
    return ParsedProfile(name=p.name, description=p.description,
                         pins={k: (v or None) for k, v in (p.pins or {}).items()})


def check_candidate(instance: Any, *, original_key: str | None = None) -> list[str]:
    """`check` on the database with `instance` (an unsaved MatrixSet, Peer, Selector,
    Profile or ProxySettings) in place of the row it edits, or added; for a form's `clean()`.
    `original_key` is the row's id before the edit (a rename replaces the old row)."""
    from scheduling.models import ProxySettings
    from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

    view = database_view()
    if isinstance(instance, ProxySettings):
        view = replace(view, router=instance.router,
                       matrix_vars=dict(instance.matrix_vars or {}),
                       matrix_evict_costs=dict(instance.matrix_evict_costs or {}))
    elif isinstance(instance, MatrixSet):
        old = original_key or instance.name
        rows = [(n, d) for n, d in view.matrix_sets if n != old]
        at = next((i for i, (n, _) in enumerate(view.matrix_sets) if n == old), len(rows))
        rows.insert(min(at, len(rows)), (instance.name, instance.dsl))
        view = replace(view, matrix_sets=tuple(rows))
    elif isinstance(instance, Peer):
        old = original_key or instance.peer_id
        view = replace(view, peers=(*[p for p in view.peers if p.peer_id != old],
                                    peer_of(instance)))
    elif isinstance(instance, Selector):
        old = original_key or instance.selector_id
        view = replace(view, selectors=(*[s for s in view.selectors if s.selector_id != old],
                                        selector_of(instance)))
    elif isinstance(instance, Profile):
        old = original_key or instance.name
        view = replace(view, profiles=(*[p for p in view.profiles if p.name != old],
                                       profile_of(instance)))
    else:
        raise TypeError(f"no routing check for {type(instance).__name__}")
    return check(view)
