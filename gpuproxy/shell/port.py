"""The one door from the edge (consumers, views, the dashboard) into the running proxy.

Everything the edge may do to the scheduler and the upstreams is here: acquire a grant and
release it (cancelling the wait withdraws the request), post a control event (load, unload,
unload everything, restart), read the published snapshot, or post a read of the books to the
run loop (`inspect`). Nothing else reaches `Runtime.run_loop` or `Runtime.upstreams`: the
type checker holds the edge to this Protocol, which is what issue "Speed" puts across a process
boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from gpuproxy.observe.published import SchedulerSnapshot
    from gpuproxy.shell.run_loop import Grant, Waiting
    from gpuproxy.upstream.processes import UpstreamProcess
    from scheduling.catalog import Catalog
    from scheduling.core.effects import Scheduler

T = TypeVar("T")


class ProxyPort(Protocol):
    @property
    def catalog(self) -> Catalog:
        """The definitions in force: immutable, replaced whole on a reload."""
        ...

    async def acquire(self, model: str, priority: int = 0, deadline: float | None = None,
                      watch: Callable[[Waiting], None] | None = None) -> Grant:
        """Wait for the scheduler to grant `model`; `Grant.release()` once done. Raises the
        SchedulingError the scheduler chose; a cancelled wait withdraws the request."""
        ...

    async def load(self, model: str) -> str: ...

    async def unload(self, models: Iterable[str]) -> None: ...

    async def unload_all(self) -> None:
        """Stop every model loaded or loading when the scheduler handles it: one event."""
        ...

    def restart(self, models: Iterable[str]) -> None: ...

    def snapshot(self) -> SchedulerSnapshot:
        """What the run loop published after its last event."""
        ...

    async def inspect(self, read: Callable[[Scheduler, float], T]) -> T:
        """Run `read(scheduler, now)` on the run loop's task, between two events, and return
        its (immutable) result: the books as they are, read by their owner."""
        ...

    def upstream(self, model: str) -> UpstreamProcess | None:
        """The model's process if one was ever made (its state, pid, address)."""
        ...

    def upstream_process(self, model: str) -> UpstreamProcess:
        """The model's process, made on first use: for a granted request to reach."""
        ...

    def running(self) -> list[dict[str, Any]]:
        """llama-swap's `/running` records."""
        ...
