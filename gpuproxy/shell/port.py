"""The one door from the edge (consumers, views, the dashboard) into the running proxy.

Everything the edge may do to the scheduler and the upstreams is here: acquire a grant and
release it (cancelling the wait withdraws the request), post a control event (load, unload,
unload everything, restart), read the published snapshot, post a read of the books to the
run loop (`inspect`), and read what the whole proxy observed (logs, metrics, the requests in
flight). Nothing else reaches `Runtime.run_loop` or `Runtime.upstreams`: the type checker
holds the edge to this Protocol.

Two classes implement it: `Runtime` (gpuproxy/shell/runtime.py), the scheduler in this
process, and `RemoteRuntime` (gpuproxy/shell/remote.py), a request process's client of the
scheduler process under `serve --workers N` (docs/scheduler-design.md §8).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from gpuproxy.shell.run_loop import Waiting
    from gpuproxy.upstream.states import State
    from scheduling.catalog import Catalog
    from scheduling.core.effects import Scheduler
    from scheduling.core.events import Dispatch
    from scheduling.spec import UpstreamSpec

T = TypeVar("T")

# A log feed: the history asked for, then every new line (`ProxyPort.log_feed`).
LogFeed = AbstractAsyncContextManager[tuple[list[str], "asyncio.Queue[str]"]]


class Granted(Protocol):
    """A request allowed to reach its upstream; `release()` exactly once when done."""

    model: str
    swap_wait: float | None  # seconds it waited for a model load, if it did

    @property
    def dispatch(self) -> Dispatch | None: ...

    def release(self) -> None: ...


class UpstreamView(Protocol):
    """What the edge reads of one model's process: `UpstreamProcess` itself in the scheduler's
    process, a mirror of it in a request process."""

    @property
    def state(self) -> State: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def spec(self) -> UpstreamSpec: ...

    @property
    def last_error(self) -> BaseException | None: ...

    async def exit_reported(self, pid: int | None, within: float) -> bool: ...


class ProxyPort(Protocol):
    @property
    def catalog(self) -> Catalog:
        """The definitions in force: immutable, replaced whole on a reload."""
        ...

    async def acquire(self, model: str, priority: int = 0, deadline: float | None = None,
                      watch: Callable[[Waiting], None] | None = None, *,
                      age: float = 0.0, request_id: str = "") -> Granted:
        """Wait for the scheduler to grant `model`; `Grant.release()` once done. Raises the
        SchedulingError the scheduler chose; a cancelled wait withdraws the request. `age`:
        seconds it already waited on the trusted peer that forwarded it (it queues as that
        much older). `request_id`: its activity row's, named by the load it causes (a model
        event)."""
        ...

    async def load(self, model: str) -> str: ...

    async def unload(self, models: Iterable[str]) -> None: ...

    async def unload_all(self) -> None:
        """Stop every model loaded or loading when the scheduler handles it: one event."""
        ...

    def restart(self, models: Iterable[str]) -> None: ...

    async def inspect(self, read: Callable[[Scheduler, float], T]) -> T:
        """Run `read(scheduler, now)` on the run loop's task, between two events, and return
        its (immutable) result: the books as they are, read by their owner."""
        ...

    def upstream(self, model: str) -> UpstreamView | None:
        """The model's process if one was ever made (its state, pid, address)."""
        ...

    def upstream_process(self, model: str) -> UpstreamView:
        """The model's process, made on first use: for a granted request to reach."""
        ...

    def running(self) -> list[dict[str, Any]]:
        """llama-swap's `/running` records."""
        ...

    def log_feed(self, sources: list[str], history: bool) -> LogFeed:
        """The upstreams' (and the proxy's) output: what is kept, then what comes."""
        ...

    async def metrics_text(self, accept: str) -> tuple[bytes, str]:
        """The Prometheus exposition of the whole proxy, and its content type."""
        ...

    async def requests_view(self) -> dict[str, Any]:
        """The dashboard's requests: `in_flight` and `recent` (every request process's),
        `history` (the scheduler's minutes)."""
        ...

    async def cancel_request(self, request_id: str) -> bool:
        """End one request in flight on an operator's word, whichever process serves it."""
        ...

    async def performance(self, after: dt.datetime | None) -> dict[str, Any] | None:
        """`/api/performance`'s body from the one performance monitor (the scheduler
        process's), samples after `after` or all; None while monitoring is off."""
        ...

    def watch_changes(self, on: bool) -> None:
        """A dashboard opened (True) or closed here: it wakes on `published.on_change`, which
        the scheduler's events must reach in this process."""
        ...

    def database_problem(self) -> str | None:
        """None while the database answers; else what is wrong, in words for `/health`."""
        ...
