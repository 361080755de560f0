"""The `Catalog` read from the database: the one place the proxy's model definitions meet the
ORM. `build_catalog` runs on the proxy's database thread (gpuproxy/shell/runtime.py)."""

from __future__ import annotations

from django.db.models import Count, Max

from scheduling.catalog import Catalog, CatalogModel
from scheduling.core.swapper import Group
from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings
from scheduling.ports import allocate_ports


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
    keys = tuple(ApiKey.objects.order_by("key_hash").values_list("key_hash", "name", "admin"))
    return (version, models["n"], models["last"], groups, keys)


def build_catalog() -> Catalog:
    """Read everything the proxy needs in one go. Runs in a worker thread (it uses the ORM).

    The fingerprint is read first: a change that lands while the rest is read makes the
    stored fingerprint stale, so the next poll reloads again rather than missing it.
    """
    stamp = fingerprint()
    settings = ProxySettings.load()
    defs = list(ModelDefinition.objects.filter(enabled=True).select_related("group"))
    ports = _allocate_ports(defs, settings.start_port)
    models: dict[str, CatalogModel] = {}
    aliases: dict[str, str] = {}
    for d in defs:
        spec = d.to_upstream_spec(settings, port=ports.get(d.model_id))
        models[d.model_id] = CatalogModel(
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
        )
        for alias in [*d.aliases, *(d.set_params_by_id or {})]:
            if alias != d.model_id:
                aliases[alias] = d.model_id
    groups = tuple(
        Group(g.group_id, frozenset(m.model_id for m in g.members.all() if m.model_id in models),
              swap=g.swap, exclusive=g.exclusive, persistent=g.persistent)
        for g in ModelGroup.objects.prefetch_related("members")
    )
    keys = list(ApiKey.objects.values_list("key_hash", "name", "admin"))
    api_keys = {digest: name for digest, name, _ in keys}
    admin_keys = frozenset(digest for digest, _, admin in keys if admin)
    return Catalog(
        models=models,
        aliases=aliases,
        groups=groups,
        api_keys=api_keys,
        admin_keys=admin_keys,
        preload=tuple(settings.preload),
        scheduler=settings.scheduler,
        aging_divisor=settings.aging_divisor,
        swap_affinity_bonus=settings.swap_affinity_bonus,
        include_aliases_in_list=settings.include_aliases_in_list,
        performance_monitoring=settings.performance_monitoring,
        performance_interval=settings.performance_interval,
        max_waiting=settings.max_waiting,
        max_waiting_per_band={b: n for b in ("interactive", "normal", "batch")
                              if (n := getattr(settings, f"max_waiting_{b}"))},
        queue_timeout=float(settings.queue_timeout),
        capture_buffer_mb=settings.capture_buffer_mb,
        fingerprint=stamp,
    )
