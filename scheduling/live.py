"""The running proxy as the admin and the save signals see it: a port the shell plugs into.

`scheduling` sits below the proxy in the layers (ARCHITECTURE.md), so its admin and signals
cannot import the shell. The shell attaches a `LiveProxy` when its runtime starts and detaches
it at shutdown (gpuproxy/shell/control.py); until then reads return nothing and actions raise
`ProxyNotRunning`. Everything here may be called from any thread: Django admin views are
synchronous and run in worker threads, while the proxy lives on the server's event loop.

A saved definition still reaches a proxy in another process through `transaction.on_commit`
+ PostgreSQL NOTIFY (scheduling/signals.py) or the proxy's periodic check.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Protocol


class ProxyNotRunning(RuntimeError):
    """No proxy (run loop) lives in this process, so there is nothing to act on."""

    def __init__(self) -> None:
        super().__init__("the proxy is not running in this process: start it with "
                         "`gpuproxy serve` (the admin acts on the proxy that serves it)")


@dataclass(frozen=True)
class ModelLive:
    """What the running proxy says about one model right now."""

    state: str  # one of gpuproxy.upstream.states.State's values (the shell fills it in)
    restart_needed: bool  # its definition changed; it restarts when idle
    in_flight: int
    # The last start failure in full (command, output tail, remedy), until a start succeeds:
    # for staff, who may read the command anyway; API clients get only the short form.
    last_error: str = ""


class LiveProxy(Protocol):
    """What a running proxy offers code off its event loop. Futures end on the loop's word."""

    def live_models(self) -> dict[str, ModelLive]: ...

    def load(self, model: str) -> concurrent.futures.Future[str]: ...

    def unload(self, models: list[str]) -> concurrent.futures.Future[None]: ...

    def restart(self, models: list[str]) -> concurrent.futures.Future[None]: ...

    def reload(self) -> None: ...


_lock = threading.Lock()
_attached: LiveProxy | None = None


def attach(proxy: LiveProxy) -> None:
    global _attached
    with _lock:
        _attached = proxy


def detach(proxy: LiveProxy) -> None:
    global _attached
    with _lock:
        if _attached is proxy:
            _attached = None


def _proxy() -> LiveProxy:
    proxy = _attached
    if proxy is None:
        raise ProxyNotRunning()
    return proxy


def running() -> bool:
    return _attached is not None


def live_models() -> dict[str, ModelLive]:
    """Every configured model's live state, from what the proxy published ({} without one)."""
    proxy = _attached
    return proxy.live_models() if proxy is not None else {}


def load(model: str) -> concurrent.futures.Future[str]:
    """Load `model` through the scheduler (like `POST /api/models/load`). The future ends
    with the model id when it is ready, or with the SchedulingError."""
    return _proxy().load(model)


def unload(models: list[str]) -> concurrent.futures.Future[None]:
    """Stop these models now, through the scheduler (like `POST /api/models/unload/…`)."""
    return _proxy().unload(models)


def restart(models: list[str]) -> concurrent.futures.Future[None]:
    """Restart these models when each is idle: never cutting off work in flight."""
    return _proxy().restart(models)


def reload() -> None:
    """Re-read the definitions now (a save committed in this process). No-op without a proxy."""
    proxy = _attached
    if proxy is not None:
        proxy.reload()
