"""In-memory log history and live fan-out for `/logs` and `/logs/stream` (llama-swap parity).

There is one ring buffer for the proxy's own log lines and one per upstream model for its
stdout/stderr. Streams subscribe with an asyncio.Queue; publishing never blocks: a subscriber
that cannot keep up loses lines (counted in the line it gets next) rather than slowing an
upstream's output pump.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator

HISTORY_LINES = 2000
SUBSCRIBER_QUEUE = 1000

PROXY = "proxy"


class LogBuffer:
    """A bounded history of lines plus live subscribers; safe to publish from any thread."""

    def __init__(self, source: str, history: int = HISTORY_LINES) -> None:
        self.source = source
        self._lines: deque[str] = deque(maxlen=history)
        self._subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[str]]] = set()
        self._lock = threading.Lock()

    def publish(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            subscribers = list(self._subscribers)
        for loop, queue in subscribers:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                _offer(queue, line)
            else:
                with contextlib.suppress(RuntimeError):  # loop closed
                    loop.call_soon_threadsafe(_offer, queue, line)

    def history(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def tail(self, n: int = 20) -> list[str]:
        with self._lock:
            return list(self._lines)[-n:]

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[str]]:
        queue: asyncio.Queue[str] = asyncio.Queue(SUBSCRIBER_QUEUE)
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._subscribers.add(entry)
        try:
            yield queue
        finally:
            with self._lock:
                self._subscribers.discard(entry)


def _offer(queue: asyncio.Queue[str], line: str) -> None:
    with contextlib.suppress(asyncio.QueueFull):
        queue.put_nowait(line)


class LogRegistry:
    """All buffers by source name: `proxy` plus one per model id."""

    def __init__(self) -> None:
        self._buffers: dict[str, LogBuffer] = {PROXY: LogBuffer(PROXY)}
        self._lock = threading.Lock()

    def get(self, source: str) -> LogBuffer:
        with self._lock:
            buf = self._buffers.get(source)
            if buf is None:
                buf = self._buffers[source] = LogBuffer(source)
            return buf

    def existing(self, source: str) -> LogBuffer | None:
        with self._lock:
            return self._buffers.get(source)

    def all(self) -> list[LogBuffer]:
        with self._lock:
            return list(self._buffers.values())


registry = LogRegistry()


class ProxyLogHandler(logging.Handler):
    """Copies the proxy's log records into the `proxy` buffer for `/logs`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            registry.get(PROXY).publish(self.format(record))
        except Exception:  # a log handler must never raise into the caller
            self.handleError(record)
