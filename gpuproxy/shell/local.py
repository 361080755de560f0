"""What this process observed, for whichever door asks: its log buffers, its Prometheus
registry, its requests in flight and finished, the database's health in words. The
scheduler's `Runtime` answers with these directly; under `serve --workers N` the hub and each
request process answer their parts with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from activity.writer import writer as activity_writer
from gpuproxy.observe import inflight, published
from gpuproxy.observe.history import HISTORY
from gpuproxy.observe.perf import history as perf_history
from gpuproxy.shell.instance import DatabaseStatus
from gpuproxy.upstream.logbuffer import registry as log_registry


def describe_database(status: DatabaseStatus | None) -> str | None:
    """None while the database answers; else what is wrong, since when, and what that means
    for requests, in words for a person."""
    if status is None:
        return None
    buffered = activity_writer().buffered
    return (f"database unreachable since {status.since.isoformat().replace('+00:00', 'Z')} "
            f"({status.detail}); requests are served, activity rows are buffered "
            f"({buffered} waiting)")


@contextlib.asynccontextmanager
async def local_log_feed(sources: list[str], history: bool
                         ) -> AsyncIterator[tuple[list[str], asyncio.Queue[str]]]:
    """This process's log buffers: their history (if asked), then their new lines, merged
    into one queue; a reader that falls behind by 1,000 lines loses lines, never the loop."""
    buffers = [log_registry.get(s) for s in sources]
    queue: asyncio.Queue[str] = asyncio.Queue(1000)
    with contextlib.ExitStack() as stack:
        queues = [stack.enter_context(b.subscribe()) for b in buffers]
        pumps = [asyncio.ensure_future(_forward(q, queue)) for q in queues]
        try:
            past = [line for b in buffers for line in b.history()] if history else []
            yield past, queue
        finally:
            for pump in pumps:
                pump.cancel()


async def _forward(src: asyncio.Queue[str], dst: asyncio.Queue[str]) -> None:
    while True:
        line = await src.get()
        with contextlib.suppress(asyncio.QueueFull):
            dst.put_nowait(line)


async def local_metrics_text(accept: str) -> tuple[bytes, str]:
    """This process's registry, rendered on a worker thread so a scrape never holds the
    event loop (the collectors read only published snapshots)."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept)
    return await asyncio.to_thread(encoder, REGISTRY), content_type


def local_requests() -> dict[str, Any]:
    """The requests this process serves now and served last (the dashboard's lists)."""
    return {"in_flight": inflight.snapshot(), "recent": HISTORY.recent_rows()}


def local_performance(after: dt.datetime | None) -> dict[str, Any] | None:
    """This process's performance monitor's last hour; None when it has none or it is off
    (under `serve --workers N` only the scheduler process samples: one `nvidia-smi` per box)."""
    monitor = published.perf_monitor()
    if monitor is None or not monitor.enabled:
        return None
    return perf_history.performance(monitor.history(), after)
