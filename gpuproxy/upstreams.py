"""The set of upstream processes and the catalog they come from: load, unload, list, shut down.

One `UpstreamProcess` per model id, created on first use. A load asks the group swapper which
running models must stop first, stops them in parallel, then waits for the target to be ready.
Loads are serialised by one lock for now; the scheduler's run loop (next issue) takes over that
ordering and this class becomes the effects it calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gpuproxy.logbuffer import registry as log_registry
from gpuproxy.processes import State, UpstreamProcess
from scheduling.catalog import Catalog

logger = logging.getLogger("gpuproxy.upstreams")


class ModelNotFound(LookupError):
    """The requested name is neither a model id nor an alias."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return (f"model {self.name!r} is not defined; GET /v1/models lists the models and "
                "aliases this proxy serves")


class Upstreams:
    def __init__(self, load_catalog: Callable[[], Awaitable[Catalog]]) -> None:
        self._load_catalog = load_catalog
        self.catalog = Catalog()
        self._processes: dict[str, UpstreamProcess] = {}
        self._swap_lock = asyncio.Lock()
        self._loaded = False
        self._closing = False

    async def refresh(self) -> Catalog:
        """Re-read the definitions; processes of removed models are stopped."""
        catalog = await self._load_catalog()
        self.catalog = catalog
        self._loaded = True
        gone = [m for m in self._processes if m not in catalog.models]
        for model_id, proc in list(self._processes.items()):
            if model_id in catalog.models:
                proc.update_spec(catalog.models[model_id].spec)
        if gone:
            await asyncio.gather(*(self._processes.pop(m).close() for m in gone))
        return catalog

    async def ensure_catalog(self) -> Catalog:
        if not self._loaded:
            await self.refresh()
        return self.catalog

    def resolve(self, name: str) -> str:
        model_id = self.catalog.resolve(name)
        if model_id is None:
            raise ModelNotFound(name)
        return model_id

    def process(self, model_id: str) -> UpstreamProcess:
        proc = self._processes.get(model_id)
        if proc is None:
            spec = self.catalog.models[model_id].spec
            proc = self._processes[model_id] = UpstreamProcess(
                spec, log_registry.get(model_id))
        return proc

    def running_ids(self) -> list[str]:
        return sorted(m for m, p in self._processes.items()
                      if p.state not in (State.STOPPED, State.FAILED))

    async def load(self, name: str) -> str:
        """Make `name` ready, stopping what its group rules say must go. Raises StartFailed."""
        await self.ensure_catalog()
        model_id = self.resolve(name)
        async with self._swap_lock:
            evict = self.catalog.swapper().eviction_for(model_id, self.running_ids())
            if evict:
                logger.info("loading model %r: unloading %s first", model_id,
                            ", ".join(repr(m) for m in evict))
                await asyncio.gather(*(self._processes[m].stop() for m in evict))
            await self.process(model_id).ensure_ready()
        return model_id

    async def unload(self, name: str) -> str:
        await self.ensure_catalog()
        model_id = self.resolve(name)
        proc = self._processes.get(model_id)
        if proc is not None:
            await proc.stop()
        return model_id

    async def unload_all(self) -> None:
        """Stop everything, smallest unload timeout first (llama-swap's order)."""
        by_timeout: dict[float, list[UpstreamProcess]] = {}
        for proc in self._processes.values():
            by_timeout.setdefault(proc.spec.unload_timeout, []).append(proc)
        for timeout in sorted(by_timeout):
            await asyncio.gather(*(p.stop() for p in by_timeout[timeout]))

    def running(self) -> list[dict[str, Any]]:
        """llama-swap's `/running` records, for every process that is not stopped."""
        out = []
        for model_id in self.running_ids():
            proc = self._processes[model_id]
            meta = self.catalog.models.get(model_id)
            out.append({
                "model": model_id,
                "state": str(proc.state),
                "cmd": proc.spec.cmd,
                "proxy": proc.spec.proxy,
                "ttl": meta.ttl if meta else int(proc.spec.ttl),
                "name": meta.name if meta else "",
                "description": meta.description if meta else "",
                "pid": proc.pid,
            })
        return out

    async def shutdown(self) -> None:
        """Stop every upstream and end their owner tasks; used when the proxy exits."""
        self._closing = True
        procs = list(self._processes.values())
        if procs:
            logger.info("shutting down: stopping %d upstream(s)", len(procs))
        await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)
