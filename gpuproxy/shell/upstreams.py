"""The upstream processes by model id, and the catalog they are defined by.

A registry, not a decision maker: which model loads when, and what must stop first, is the
scheduler's call (through `gpuproxy/shell/run_loop.py`). This class only creates one
`UpstreamProcess` per model on first use, keeps their specs current, and lists them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from activity import events
from gpuproxy.observe import metrics
from gpuproxy.upstream.logbuffer import registry as log_registry
from gpuproxy.upstream.orphans import ProcessRecords
from gpuproxy.upstream.processes import State, UpstreamProcess
from scheduling.catalog import Catalog

logger = logging.getLogger("gpuproxy.shell.upstreams")


class Upstreams:
    def __init__(self, load_catalog: Callable[[], Awaitable[Catalog]],
                 records: ProcessRecords | None = None) -> None:
        self._load_catalog = load_catalog
        self._records = records
        self.catalog = Catalog()
        self._processes: dict[str, UpstreamProcess] = {}
        # Called with the model id the moment one of its processes exits (any exit: crash,
        # stop, TTL); the run loop sets it to post ModelExited, so the scheduler learns it
        # from an event instead of reading process states.
        self.on_exit: Callable[[str], None] | None = None
        # Called after any process changed state (the hub tells the request processes).
        self.on_state: list[Callable[[], None]] = []
        # Given each model event's row (`activity.events.row`); the runtime sets it to the
        # events writer's O(1) submit. Why a stop or a load was asked is the run loop's to
        # say (`cause`); the process only knows what happened.
        self.on_event: Callable[[dict[str, Any]], None] | None = None
        # model -> (reason, detail, request_id)
        self._stop_cause: dict[str, tuple[str, str, str]] = {}
        self._load_cause: dict[str, tuple[str, str, str]] = {}
        self._run_cause: dict[str, tuple[str, str, str]] = {}  # the run now started's

    async def refresh(self) -> tuple[Catalog, list[str]]:
        """Re-read the definitions. Returns the catalog and the models that were removed
        (or disabled) while their process exists; the caller unloads those when idle."""
        catalog = await self._load_catalog()
        self.catalog = catalog
        metrics.models_configured(catalog.models)
        for model_id, proc in self._processes.items():
            if model_id in catalog.models:
                proc.update_spec(catalog.models[model_id].spec)
        return catalog, [m for m in self._processes if m not in catalog.models]

    def existing(self, model_id: str) -> UpstreamProcess | None:
        return self._processes.get(model_id)

    def process(self, model_id: str) -> UpstreamProcess:
        proc = self._processes.get(model_id)
        if proc is None:
            spec = self.catalog.models[model_id].spec
            proc = self._processes[model_id] = UpstreamProcess(
                spec, log_registry.get(model_id), on_state=self._state_changed,
                records=self._records, on_exit=self._exited, on_event=self._event)
        return proc

    def cause(self, model_id: str, reason: str, detail: str = "", *, load: bool = False,
              request_id: str = "") -> None:
        """Why the next stop (or, with `load`, the next start) of `model_id` happens: an
        `activity.events` reason (and the request a load is for), kept for the events it
        brings."""
        (self._load_cause if load else self._stop_cause)[model_id] = (reason, detail,
                                                                      request_id)

    def _event(self, model_id: str, kind: str, pid: int | None, seconds: float | None,
               detail: str) -> None:
        if kind == events.IDLE_UNLOAD:
            reason, why, rid = events.TTL, "", ""
        elif kind == events.CRASH:
            reason, why, rid = events.CRASHED, "", ""
        elif kind == events.UNLOAD:
            reason, why, rid = self._stop_cause.pop(model_id, ("", "", ""))
        elif kind == events.LOAD:
            reason, why, rid = self._run_cause[model_id] = self._load_cause.pop(
                model_id, (events.REQUEST, "", ""))
        else:  # ready, start_failed: the cause of the start (one that never spawned has none)
            cause = self._run_cause.pop(model_id, None)
            reason, why, rid = cause or self._load_cause.pop(model_id, (events.REQUEST, "", ""))
        if self.on_event is not None:
            self.on_event(events.row(model_id, kind, pid=pid, seconds=seconds, reason=reason,
                                     detail="; ".join(t for t in (detail, why) if t),
                                     request_id=rid or None))

    def restarting(self, model_id: str, reason: str) -> None:
        """A restart begins: its own event, then the stop and the start carry its reason."""
        self.cause(model_id, reason, "restart")
        self.cause(model_id, reason, "restart", load=True)
        if self.on_event is not None:
            self.on_event(events.row(model_id, events.RESTART, reason=reason))

    def _state_changed(self, model_id: str, state: State) -> None:
        metrics.model_state_changed(model_id, state.value)
        for listener in self.on_state:
            listener()

    def _exited(self, model_id: str) -> None:
        if self.on_exit is not None:
            self.on_exit(model_id)

    def running_ids(self) -> list[str]:
        return sorted(m for m, p in self._processes.items()
                      if p.state not in (State.STOPPED, State.FAILED))

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
        procs = list(self._processes.values())
        live = self.running_ids()  # a process object for a model that is stopped is no upstream
        if live:
            logger.info("shutting down: stopping %d upstream(s): %s", len(live), ", ".join(live))
        for model_id in live:
            self.cause(model_id, events.SHUTDOWN)
        await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)
