"""The process-wide objects of a running proxy, bound to the server's event loop.

Database work from async code runs on one dedicated thread, never on asgiref's shared
thread-sensitive executor: a hung query there stalls every Channels consumer
(`django-stack-notes.md` §6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from django.db import close_old_connections

from gpuproxy.upstreams import Upstreams

T = TypeVar("T")

_db_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuproxy-db")
_upstreams: Upstreams | None = None
_loop: asyncio.AbstractEventLoop | None = None


async def run_db(fn: Callable[[], T]) -> T:
    """Run ORM code on the dedicated database thread and return its result."""

    def call() -> T:
        close_old_connections()
        try:
            return fn()
        finally:
            close_old_connections()

    return await asyncio.get_running_loop().run_in_executor(_db_executor, call)


async def _load_catalog():
    from scheduling.catalog import build_catalog

    return await run_db(build_catalog)


def upstreams() -> Upstreams:
    """The proxy's upstreams, created for the running loop on first use."""
    global _upstreams, _loop
    loop = asyncio.get_running_loop()
    if _upstreams is None or _loop is not loop:
        _upstreams = Upstreams(_load_catalog)
        _loop = loop
    return _upstreams


async def shutdown() -> None:
    """Stop every upstream; safe to call when nothing was started."""
    global _upstreams, _loop
    if _upstreams is not None:
        await _upstreams.shutdown()
    _upstreams = None
    _loop = None
