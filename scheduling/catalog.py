"""An immutable snapshot of the database's model definitions, for the async side.

The proxy never queries the ORM on a request's path: it reads a `Catalog` built in a worker
thread at start and rebuilt when definitions change. Everything in it is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db.models import Count, Max

from gpuproxy.spec import UpstreamSpec
from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.swapper import Group, GroupSwapper
from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings


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


@dataclass(frozen=True)
class Catalog:
    models: dict[str, CatalogModel] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    groups: tuple[Group, ...] = ()
    api_keys: dict[str, str] = field(default_factory=dict)  # sha256 -> key name
    admin_keys: frozenset[str] = frozenset()  # sha256 of the keys marked admin
    preload: tuple[str, ...] = ()
    scheduler: str = "serial"
    aging_divisor: float = 60.0
    swap_affinity_bonus: int = 10
    include_aliases_in_list: bool = False
    performance_monitoring: bool = True
    performance_interval: float = 5.0
    max_waiting: int = 0
    max_waiting_per_band: dict[str, int] = field(default_factory=dict)
    queue_timeout: float = 0.0  # default queue deadline in seconds; 0 = none
    fingerprint: tuple = ()  # what `fingerprint()` read when this catalog was built

    def resolve(self, name: str) -> str | None:
        """A model id for a requested name (id or alias), or None when nothing matches."""
        if name in self.models:
            return name
        return self.aliases.get(name)

    def swapper(self) -> GroupSwapper:
        return GroupSwapper(self.groups, self.models)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            models={m.model_id: ModelConfig(m.concurrency_limit, m.parallel, m.fifo_priority,
                                            revision=m.spec.revision())
                    for m in self.models.values()},
            swapper=self.swapper(),
            scheduler=self.scheduler,
            aging_divisor=self.aging_divisor,
            swap_affinity_bonus=self.swap_affinity_bonus,
            max_waiting=self.max_waiting,
            max_waiting_per_band=dict(self.max_waiting_per_band),
        )


def _allocate_ports(defs: list[ModelDefinition], start: int) -> dict[str, int]:
    """Ports for `${PORT}` left in commands (models added in admin), in sorted id order."""
    taken = {d.port for d in defs if d.port}
    ports: dict[str, int] = {}
    candidate = start
    for d in sorted(defs, key=lambda d: d.model_id):
        if d.port is None and ("${PORT}" in d.cmd or "${PORT}" in d.proxy):
            while candidate in taken:
                candidate += 1
            ports[d.model_id] = candidate
            taken.add(candidate)
    return ports


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
        fingerprint=stamp,
    )
