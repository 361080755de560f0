"""The `Catalog` read from the database: the one place the proxy's model definitions meet the
ORM. `build_catalog` runs on the proxy's database thread (gpuproxy/shell/runtime.py)."""

from __future__ import annotations

import hashlib
import json

from django.conf import settings as django_settings
from django.db.models import Count, Max

from scheduling.catalog import (
    Catalog,
    CatalogModel,
    CatalogPeer,
    CatalogProfile,
    CatalogSelector,
)
from scheduling.core.swapper import Group
from scheduling.llamaswap.parsed import PEER_TIMEOUTS
from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings
from scheduling.nodes import placed_on
from scheduling.ports import allocate_ports
from scheduling.routing_checks import RoutingView, peer_of, selector_of
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

_RANGE = ("priority_min", "priority_max", "priority_default")


def _allocate_ports(defs: list[ModelDefinition], start: int) -> dict[str, int]:
    """Ports for `${PORT}` left in commands (models added in admin), by scheduling/ports.py's
    rule, past the ports other models already have; no upper bound is applied here."""
    wanting = [d.model_id for d in defs
               if d.port is None and ("${PORT}" in d.cmd or "${PORT}" in d.proxy)]
    return allocate_ports(wanting, start, taken={d.port for d in defs if d.port})


def fingerprint() -> tuple:
    """A cheap summary that changes whenever anything the catalog holds changes.

    Polled by the running proxy so that a re-import or a save from another process applies
    without a restart (the admin issue adds PostgreSQL NOTIFY on top of this).
    """
    version = ProxySettings.objects.filter(pk=1).values_list("version", flat=True).first()
    models = ModelDefinition.objects.aggregate(n=Count("id"), last=Max("updated_at"))
    groups = tuple(ModelGroup.objects.order_by("group_id").values_list(
        "group_id", "swap", "exclusive", "persistent"))
    keys = tuple(ApiKey.objects.order_by("key_hash").values_list(
        "key_hash", "name", "admin", "trusted_peer", *_RANGE))
    return (version, models["n"], models["last"], groups, keys, _routing_digest())


def _routing_digest() -> str:
    """The routing tables in one SHA-256: every column, so any admin edit shows, and no
    peer's key kept in the fingerprint itself."""
    rows = [list(MatrixSet.objects.order_by("position", "name").values_list(
                "name", "dsl", "position")),
            list(Peer.objects.order_by("peer_id").values()),
            list(Selector.objects.order_by("selector_id").values()),
            list(Profile.objects.order_by("name").values())]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def _strip_params(text: str) -> tuple[str, ...]:
    """llama-swap's `SanitizedStripParams`: trimmed, no blanks, no duplicates, never
    `model`, sorted."""
    return tuple(sorted({p.strip() for p in text.split(",")} - {"", "model"}))


def build_catalog() -> Catalog:
    """Read everything the proxy needs in one go. Runs in a worker thread (it uses the ORM).

    The fingerprint is read first: a change that lands while the rest is read makes the
    stored fingerprint stale, so the next poll reloads again rather than missing it.

    A model placed on other nodes only (`nodes`) stays out of `models`, so nothing here can
    start, preload, load or swap it; it is in `elsewhere`, for routing and /v1/models.
    """
    node = str(getattr(django_settings, "GPUPROXY_NODE", ""))
    stamp = fingerprint()
    settings = ProxySettings.load()
    defs = list(ModelDefinition.objects.filter(enabled=True).select_related("group"))
    ports = _allocate_ports(defs, settings.start_port)
    models: dict[str, CatalogModel] = {}
    aliases: dict[str, str] = {}
    elsewhere: dict[str, CatalogModel] = {}
    elsewhere_aliases: dict[str, str] = {}
    for d in defs:
        spec = d.to_upstream_spec(settings, port=ports.get(d.model_id))
        here = placed_on(d.nodes or (), node)
        (models if here else elsewhere)[d.model_id] = CatalogModel(
            model_id=d.model_id,
            spec=spec,
            name=d.name,
            description=d.description,
            aliases=tuple(d.aliases),
            unlisted=d.unlisted,
            concurrency_limit=d.concurrency_limit,
            parallel=d.slots.parallel,
            ttl=int(spec.ttl),
            fifo_priority=d.fifo_priority,
            use_model_name=d.use_model_name,
            strip_params=tuple(p.strip() for p in d.strip_params.split(",") if p.strip()),
            set_params=dict(d.set_params or {}),
            set_params_by_id=dict(d.set_params_by_id or {}),
            metadata=dict(d.metadata or {}),
            capabilities=dict(d.capabilities or {}),
            send_loading_state=(settings.send_loading_state if d.send_loading_state is None
                                else d.send_loading_state),
            created=int(d.updated_at.timestamp()) if d.updated_at else 0,
            vllm_priority=d.vllm_priority,
            stream_idle_timeout=float(d.stream_idle_timeout),
            nodes=tuple(d.nodes or ()),
        )
        for alias in [*d.aliases, *(d.set_params_by_id or {})]:
            if alias != d.model_id:
                (aliases if here else elsewhere_aliases)[alias] = d.model_id
    groups = tuple(
        Group(g.group_id, frozenset(m.model_id for m in g.members.all() if m.model_id in models),
              swap=g.swap, exclusive=g.exclusive, persistent=g.persistent)
        for g in ModelGroup.objects.prefetch_related("members")
    )
    keys = list(ApiKey.objects.values_list("key_hash", "name", "admin", "trusted_peer"))
    api_keys = {digest: name for digest, name, _, _ in keys}
    admin_keys = frozenset(digest for digest, _, admin, _ in keys if admin)
    ranges = {digest: (lo, hi, default) for digest, lo, hi, default
              in ApiKey.objects.values_list("key_hash", *_RANGE)
              if (lo, hi, default) != (None, None, None)}
    peer_rows = list(Peer.objects.order_by("peer_id"))
    peers = {p.peer_id: CatalogPeer(
        peer_id=p.peer_id, proxy=p.proxy, api_key=p.api_key,
        models=tuple(dict.fromkeys(p.models_list or ())),
        strip_params=_strip_params(p.strip_params),
        set_params={k: v for k, v in (p.set_params or {}).items() if k != "model"},
        timeouts={k: float(v) for k, v in {**PEER_TIMEOUTS, **(p.timeouts or {})}.items()},
        priority_forward=p.priority_forward) for p in peer_rows}
    # Selector targets resolve against the models in force: a disabled or undefined target
    # is left out, and a selector with none left is not offered at all (404, as any name).
    view = RoutingView(models=frozenset(models), aliases=aliases,
                       peers=tuple(peer_of(p) for p in peer_rows))
    selectors: dict[str, CatalogSelector] = {}
    for row in Selector.objects.order_by("selector_id"):
        sel = selector_of(row)
        resolved = tuple(dict.fromkeys(r for t in sel.targets if (r := view.resolve(t))))
        if resolved:
            selectors[sel.selector_id] = CatalogSelector(
                selector_id=sel.selector_id, strategy=sel.strategy, targets=sel.targets,
                resolved=resolved, spillover=sel.spillover, name=sel.name,
                description=sel.description, unlisted=sel.unlisted, metadata=sel.metadata)
    profiles = {p.name: CatalogProfile(name=p.name, description=p.description,
                                       pins={k: v or None for k, v in (p.pins or {}).items()})
                for p in Profile.objects.order_by("name")}
    return Catalog(
        models=models,
        aliases=aliases,
        node=node,
        elsewhere={mid: m.nodes for mid, m in elsewhere.items()},
        elsewhere_aliases=elsewhere_aliases,
        elsewhere_models=elsewhere,
        groups=groups,
        api_keys=api_keys,
        admin_keys=admin_keys,
        preload=tuple(settings.preload),
        scheduler=settings.scheduler,
        aging_divisor=settings.aging_divisor,
        swap_affinity_bonus=settings.swap_affinity_bonus,
        affinity_budget=settings.affinity_budget,
        include_aliases_in_list=settings.include_aliases_in_list,
        performance_monitoring=settings.performance_monitoring,
        performance_interval=settings.performance_interval,
        max_waiting=settings.max_waiting,
        max_waiting_per_band={b: n for b in ("interactive", "normal", "batch")
                              if (n := getattr(settings, f"max_waiting_{b}"))},
        queue_timeout=float(settings.queue_timeout),
        capture_buffer_mb=settings.capture_buffer_mb,
        router=settings.router,
        matrix_vars=dict(settings.matrix_vars or {}),
        matrix_evict_costs=dict(settings.matrix_evict_costs or {}),
        matrix_sets=tuple(MatrixSet.objects.order_by("position", "name").values_list(
            "name", "dsl")),
        matrix_models=frozenset(ModelDefinition.objects.values_list("model_id", flat=True)),
        peers=peers,
        selectors=selectors,
        profiles=profiles,
        active_profile=settings.active_profile if settings.active_profile in profiles else "",
        trusted_peer_keys=frozenset(digest for digest, _, _, peer in keys if peer),
        priority_ranges=ranges,
        priority_range=settings.priority_range(),
        fingerprint=stamp,
    )
