"""An immutable snapshot of the database's model definitions, for the async side.

The proxy never queries the ORM on a request's path: it reads a `Catalog` built in a worker
thread at start and rebuilt when definitions change. Everything in it is plain data, free of
Django; scheduling/catalog_db.py builds it from the ORM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from scheduling.affinity_budget import Budget, parse_budget
from scheduling.core.config import ModelConfig, SchedulerConfig, SelectorConfig
from scheduling.core.matrix import MatrixError, MatrixSwapper
from scheduling.core.swapper import Group, GroupSwapper, Swapper
from scheduling.spec import UpstreamSpec

logger = logging.getLogger("scheduling.catalog")


@dataclass(frozen=True)
class CatalogModel:
    model_id: str
    spec: UpstreamSpec
    name: str = ""
    description: str = ""
    aliases: tuple[str, ...] = ()
    unlisted: bool = False
    concurrency_limit: int = 0  # as written; 0 = not set (the scheduler applies its default)
    parallel: int = 1  # the upstream's slots: `parallel` if written, else read from the command
    ttl: int = 0  # effective idle TTL in seconds, 0 = never
    fifo_priority: int = 0
    use_model_name: str = ""
    strip_params: tuple[str, ...] = ()
    set_params: dict[str, Any] = field(default_factory=dict)
    set_params_by_id: dict[str, dict[str, Any]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)
    send_loading_state: bool = False
    vllm_priority: bool = False  # forward the priority in vLLM's `priority` body field
    stream_idle_timeout: float = 600.0  # seconds without a byte before the request is cut
    created: int = 0  # unix time of the definition's last change, for /v1/models
    nodes: tuple[str, ...] = ()  # the fleet's nodes that run it; () = every node


def url_host(url: str) -> str:
    """A peer's host and port, for messages, the dashboard and the admin: never a user or
    password a URL may carry (the config refuses them; this holds for any URL)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a bad port
        return "(not a URL)"
    if not host:
        return "(not a URL)"
    return f"{host}:{port}" if port else host


def find_peer_model(peers: Iterable[tuple[str, Iterable[str]]], name: str
                    ) -> tuple[str, str] | None:
    """llama-swap's `ResolvePeerModel`, for the catalog and the config checks alike: (peer id,
    its model) for `<peer>/<model>`, else for a bare name exactly one peer lists (the
    qualified name wins); None when nothing, or more than one, matches."""
    listed = [(pid, tuple(models)) for pid, models in peers]
    for qualified in (True, False):
        found = {(pid, m) for pid, models in listed for m in models
                 if (f"{pid}/{m}" if qualified else m) == name}
        if found:
            return found.pop() if len(found) == 1 else None
    return None


@dataclass(frozen=True)
class CatalogPeer:
    """`peers.<id>`: where its models are forwarded, never scheduled."""

    peer_id: str
    proxy: str  # base URL; the request path is appended
    # Injected as Bearer and x-api-key; "" sends none. Never in a repr (logs, tracebacks).
    api_key: str = field(default="", repr=False)
    models: tuple[str, ...] = ()
    strip_params: tuple[str, ...] = ()
    set_params: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)  # llama-swap's names, seconds
    priority_forward: str = "header"  # "header" | "vllm" | "service_tier" | "none"


@dataclass(frozen=True)
class CatalogSelector:
    """`selectors.<id>`: a virtual name; `targets` as written, `resolved` as the scheduler
    knows them (a local model id, or a peer's `<id>/<model>`)."""

    selector_id: str
    strategy: str  # "warm" | "pin" | "spillover"
    targets: tuple[str, ...] = ()
    resolved: tuple[str, ...] = ()
    spillover: int = 1
    name: str = ""
    description: str = ""
    unlisted: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CatalogProfile:
    name: str
    description: str = ""
    pins: dict[str, str | None] = field(default_factory=dict)  # None or "" disables the name


@dataclass(frozen=True)
class Route:
    """What a requested model name means (`Catalog.route`), decided in one place.

    kind: "model" (a local model id in `target`), "selector" (a selector id in `target`),
    "peer" (`peer_id` and `peer_model`; `target` is `<peer_id>/<peer_model>`),
    "fleet" (a model placed on other nodes of the fleet only: `target` its id, `nodes`
    them; never scheduled here), "disabled" (the active profile pins the name to nothing:
    404), "unknown" (404).
    """

    kind: str
    target: str
    requested: str
    pinned_by: str = ""  # the active profile whose pin rewrote the name
    peer_id: str = ""
    peer_model: str = ""
    nodes: tuple[str, ...] = ()  # "fleet": the nodes that serve it


@dataclass(frozen=True)
class Catalog:
    # The models this node runs: the only ones it starts, preloads, loads or swaps.
    models: dict[str, CatalogModel] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    node: str = ""  # this node's name (GPUPROXY_NODE)
    # Enabled models placed on other nodes only (model id -> their nodes), their aliases
    # (alias -> model id) and their entries, for `route` ("fleet") and /v1/models.
    elsewhere: dict[str, tuple[str, ...]] = field(default_factory=dict)
    elsewhere_aliases: dict[str, str] = field(default_factory=dict)
    elsewhere_models: dict[str, CatalogModel] = field(default_factory=dict)
    groups: tuple[Group, ...] = ()
    api_keys: dict[str, str] = field(default_factory=dict)  # sha256 -> key name
    admin_keys: frozenset[str] = frozenset()  # sha256 of the keys marked admin
    preload: tuple[str, ...] = ()
    scheduler: str = "serial"
    aging_divisor: float = 60.0
    swap_affinity_bonus: int = 10
    affinity_budget: str = ""  # "", "auto" or seconds (scheduling/affinity_budget.py)
    include_aliases_in_list: bool = False
    performance_monitoring: bool = True
    performance_interval: float = 5.0
    max_waiting: int = 0
    max_waiting_per_band: dict[str, int] = field(default_factory=dict)
    queue_timeout: float = 0.0  # default queue deadline in seconds; 0 = none
    capture_buffer_mb: int = 0  # `captureBuffer`: memory for /api/captures; 0 = off
    router: str = "group"  # `routing.router.use`: "group" | "matrix"
    matrix_vars: dict[str, str] = field(default_factory=dict)
    matrix_evict_costs: dict[str, int] = field(default_factory=dict)
    matrix_sets: tuple[tuple[str, str], ...] = ()  # (name, DSL) in definition order
    # every defined model id, disabled ones too: a set may name one, and disabling a model
    # must not make the matrix fail to compile
    matrix_models: frozenset[str] = frozenset()
    peers: dict[str, CatalogPeer] = field(default_factory=dict)
    selectors: dict[str, CatalogSelector] = field(default_factory=dict)
    profiles: dict[str, CatalogProfile] = field(default_factory=dict)
    active_profile: str = ""  # "" = none
    trusted_peer_keys: frozenset[str] = frozenset()  # sha256 of keys marked trusted peer
    # (min, max, default) per key that sets any of them (sha256 -> range), and the global one
    # for the others and for requests without a key; None: no bound / no default
    priority_ranges: dict[str, tuple[int | None, int | None, int | None]] = field(
        default_factory=dict)
    priority_range: tuple[int | None, int | None, int | None] = (None, None, None)
    fingerprint: tuple = ()  # what `fingerprint()` read when this catalog was built

    def resolve(self, name: str) -> str | None:
        """A model id for a requested name (id or alias), or None when nothing matches."""
        if name in self.models:
            return name
        return self.aliases.get(name)

    def peer_model(self, name: str) -> tuple[str, str] | None:
        """(peer id, its model) for `<peer>/<model>`, or for a bare name exactly one peer
        serves (llama-swap's `ResolvePeerModel`: the qualified name first); else None. A
        local id or alias shadowing a bare name is the caller's check (`route`)."""
        return find_peer_model(((pid, p.models) for pid, p in self.peers.items()), name)

    def route(self, name: str, *, profiles: bool = True) -> Route:
        """What `name` means, in llama-swap's order: the active profile's pin first (a pin
        to nothing disables the name), then a selector, a local model id or alias, then a
        peer's model (qualified, or bare when exactly one peer has it and nothing local
        shadows it)."""
        pinned_by = ""
        if profiles and self.active_profile:
            prof = self.profiles.get(self.active_profile)
            if prof is not None and name in prof.pins:
                pin = prof.pins[name]
                if not pin:
                    return Route("disabled", name, name, pinned_by=prof.name)
                pinned_by, name = prof.name, pin
        requested = name
        if name in self.selectors:
            return Route("selector", name, requested, pinned_by)
        local = self.resolve(name)
        if local is not None:
            return Route("model", local, requested, pinned_by)
        fleet = name if name in self.elsewhere else self.elsewhere_aliases.get(name)
        if fleet is not None:
            return Route("fleet", fleet, requested, pinned_by, nodes=self.elsewhere[fleet])
        peer = self.peer_model(name)
        if peer is not None:
            return Route("peer", f"{peer[0]}/{peer[1]}", requested, pinned_by,
                         peer_id=peer[0], peer_model=peer[1])
        return Route("unknown", name, requested, pinned_by)

    def upstream_pin(self, rest: str) -> tuple[str, str, str] | None:
        """`/upstream/<rest>` under the active profile, as llama-swap's `upstreamProfilePin`
        (ids may hold slashes): the longest pin that is `rest` or leads it, as (the pin,
        `rest` with the pin's target in its place or "" for a pin to nothing, the profile);
        None when no pin applies."""
        prof = self.profiles.get(self.active_profile) if self.active_profile else None
        if prof is None:
            return None
        pin = max((p for p in prof.pins if rest == p or rest.startswith(p + "/")),
                  key=len, default="")
        if not pin:
            return None
        target = prof.pins[pin]
        return pin, (target + rest[len(pin):] if target else ""), prof.name

    def swapper(self) -> Swapper:
        """The router in force: groups, or the matrix's sets. A matrix that does not compile
        (the admin and the importer refuse one, so this is a bug) runs every model alone,
        as a target in no set does, and says so in the log."""
        if self.router == "matrix":
            try:
                return MatrixSwapper.compile(self.matrix_sets, self.matrix_vars,
                                             self.matrix_evict_costs,
                                             self.matrix_models | self.models.keys())
            except MatrixError as exc:
                logger.error("the matrix does not compile (%s): every model runs alone", exc)
                return MatrixSwapper.compile((), {}, {}, self.models)
        return GroupSwapper(self.groups, self.models)

    def budget(self) -> Budget:
        """The affinity budget in force; a stored value that does not parse (the settings
        page and the importer refuse one) is off, and says so in the log."""
        try:
            return parse_budget(self.affinity_budget)
        except ValueError as exc:
            logger.error("the affinity budget is off: %s", exc)
            return Budget()

    def scheduler_config(self) -> SchedulerConfig:
        budget = self.budget()
        return SchedulerConfig(
            models={m.model_id: ModelConfig(m.concurrency_limit, m.parallel, m.fifo_priority,
                                            revision=m.spec.revision())
                    for m in self.models.values()},
            swapper=self.swapper(),
            scheduler=self.scheduler,
            aging_divisor=self.aging_divisor,
            swap_affinity_bonus=self.swap_affinity_bonus,
            affinity_budget=budget.seconds,
            affinity_budget_swaps=budget.swaps,
            max_waiting=self.max_waiting,
            max_waiting_per_band=dict(self.max_waiting_per_band),
            selectors={sid: SelectorConfig(sel.strategy, self._targets(sel), sel.spillover)
                       for sid, sel in self.selectors.items()},
            peer_models=frozenset(f"{pid}/{m}" for pid, peer in self.peers.items()
                                  for m in peer.models),
            elsewhere={**{alias: self.elsewhere[mid]
                          for alias, mid in self.elsewhere_aliases.items()},
                       **self.elsewhere},
        )

    def _targets(self, sel: CatalogSelector) -> tuple[str, ...]:
        """A selector's targets as the scheduler knows them: `resolved` when the builder
        filled it, else each written target resolved here (a local id or alias, else a
        peer's `<id>/<model>`); one that resolves to nothing is kept, and the core never
        picks it while it is not defined."""
        if sel.resolved:
            return sel.resolved
        out = []
        for t in sel.targets:
            peer = self.peer_model(t)
            out.append(self.resolve(t) or (f"{peer[0]}/{peer[1]}" if peer else t))
        return tuple(out)
