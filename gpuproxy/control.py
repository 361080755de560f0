"""Doors into the running proxy for code that does not run on its event loop.

Django admin views are synchronous and run in worker threads, while the scheduler, the
upstream processes and the perf monitor belong to the one event loop `runtime.get()` created.
Everything here is safe to call from any thread: reads use only what the loop *published*
(immutable snapshots, plain values), and actions are handed to the loop with
`run_coroutine_threadsafe`, where they become ordinary run-loop events.

When no proxy runs in this process (a `manage.py shell`, a test without a server), reads
return nothing and actions raise `ProxyNotRunning`; a saved definition still reaches a proxy
in another process through `transaction.on_commit` + PostgreSQL NOTIFY (scheduling/signals.py)
or its periodic check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from gpuproxy import metrics


class ProxyNotRunning(RuntimeError):
    """No proxy (run loop) lives in this process, so there is nothing to act on."""

    def __init__(self) -> None:
        super().__init__("the proxy is not running in this process: start it with "
                         "`gpuproxy serve` (the admin acts on the proxy that serves it)")


@dataclass(frozen=True)
class ModelLive:
    """What the running proxy says about one model right now."""

    state: str  # stopped | starting | ready | stopping | failed
    restart_needed: bool  # its definition changed; it restarts when idle
    in_flight: int
    # The last start failure in full (command, output tail, remedy), until a start succeeds:
    # for staff, who may read the command anyway; API clients get only the short form.
    last_error: str = ""


def _loop_and_runtime() -> tuple[asyncio.AbstractEventLoop, Any] | None:
    from gpuproxy import runtime

    rt, loop = runtime._runtime, runtime._loop
    if rt is None or loop is None or loop.is_closed():
        return None
    return loop, rt


def running() -> bool:
    return _loop_and_runtime() is not None


def live_models() -> dict[str, ModelLive]:
    """Every configured model's live state, from published data (no hop to the loop)."""
    target = _loop_and_runtime()
    if target is None:
        return {}
    upstreams = target[1].upstreams
    snap = metrics.scheduler_snapshot()
    states = metrics.model_states()

    def last_error(model: str) -> str:
        proc = upstreams.existing(model)
        error = proc.last_error if proc is not None else None  # an immutable exception
        return str(error) if error is not None else ""

    return {m: ModelLive(states.get(m, "stopped"), m in snap.restart_pending,
                         snap.in_flight.get(m, 0), last_error(m))
            for m in metrics.configured_models()}


def _submit(make: Callable[[Any], Coroutine[Any, Any, Any]]) -> concurrent.futures.Future:
    target = _loop_and_runtime()
    if target is None:
        raise ProxyNotRunning()
    loop, rt = target
    return asyncio.run_coroutine_threadsafe(make(rt), loop)


def load(model: str) -> concurrent.futures.Future:
    """Load `model` through the scheduler (like `POST /api/models/load`). The future ends
    with the model id when it is ready, or with the SchedulingError."""

    return _submit(lambda rt: rt.run_loop.load(model))


def unload(models: list[str]) -> concurrent.futures.Future:
    """Stop these models now, through the scheduler (like `POST /api/models/unload/…`)."""

    async def go(rt: Any) -> None:
        await rt.run_loop.unload(models)

    return _submit(go)


def restart(models: list[str]) -> concurrent.futures.Future:
    """Restart these models when each is idle: never cutting off work in flight."""

    async def go(rt: Any) -> None:
        rt.run_loop.restart(models)

    return _submit(go)


def reload() -> None:
    """Re-read the definitions now (a save committed in this process). No-op without a proxy."""
    target = _loop_and_runtime()
    if target is not None:
        loop, rt = target
        loop.call_soon_threadsafe(rt.request_reload)
