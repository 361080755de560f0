"""The running proxy's door for code that does not run on its event loop (scheduling/live.py).

`Control` is built with the runtime and attached to `scheduling.live` while it runs. Reads use
only what the loop *published* (immutable snapshots, plain values); actions are handed to the
loop with `run_coroutine_threadsafe`, where they become ordinary run-loop events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from gpuproxy.observe import published
from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.states import State
from scheduling.live import ModelLive, ProxyNotRunning

T = TypeVar("T")


class Control:
    def __init__(self, proxy: ProxyPort, request_reload: Callable[[], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._rt = proxy
        self._request_reload = request_reload
        self._loop = loop

    def live_models(self) -> dict[str, ModelLive]:
        if self._loop.is_closed():
            return {}
        snap = published.scheduler_snapshot()
        states = published.model_states()

        def last_error(model: str) -> str:
            proc = self._rt.upstream(model)
            error = proc.last_error if proc is not None else None  # an immutable exception
            return str(error) if error is not None else ""

        return {m: ModelLive(states.get(m, State.STOPPED.value), m in snap.restart_pending,
                             snap.in_flight.get(m, 0), last_error(m))
                for m in published.configured_models()}

    def _submit(self, make: Callable[[], Coroutine[Any, Any, T]]
                ) -> concurrent.futures.Future[T]:
        if self._loop.is_closed():  # a proxy that has stopped without detaching
            raise ProxyNotRunning()
        return asyncio.run_coroutine_threadsafe(make(), self._loop)

    def load(self, model: str) -> concurrent.futures.Future[str]:
        return self._submit(lambda: self._rt.load(model))

    def unload(self, models: list[str]) -> concurrent.futures.Future[None]:
        return self._submit(lambda: self._rt.unload(models))

    def restart(self, models: list[str]) -> concurrent.futures.Future[None]:
        async def go() -> None:
            self._rt.restart(models)

        return self._submit(go)

    def reload(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._request_reload)
