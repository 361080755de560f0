"""An immutable snapshot of the database's model definitions, for the async side.

The proxy never queries the ORM on a request's path: it reads a `Catalog` built in a worker
thread at start and rebuilt when definitions change. Everything in it is plain data, free of
Django; scheduling/catalog_db.py builds it from the ORM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.swapper import Group, GroupSwapper
from scheduling.spec import UpstreamSpec


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
    capture_buffer_mb: int = 0  # `captureBuffer`: memory for /api/captures; 0 = off
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
