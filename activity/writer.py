"""The activity writer: requests hand finished rows to a memory buffer; one background task
writes them in batches on its own thread, so the database is never on a request's path.

- `submit(row)` is synchronous and O(1): it appends to a deque and never touches the database.
  Over `max_buffer` rows (env `GPUPROXY_ACTIVITY_BUFFER`, default 100k) the OLDEST row is
  dropped and counted.
- One task (started with `start()` on the running loop) wakes every `interval` seconds or as
  soon as `batch_size` rows are buffered, and writes them (a COPY on PostgreSQL, a prepared
  INSERT elsewhere: `_insert`) on a DEDICATED one-thread executor (never asgiref's shared
  thread-sensitive executor: `django-stack-notes.md` §6), returning the connection to the
  pool after each batch.
- Database down: the batch goes back to the front of the buffer (respecting the cap), the
  error is counted and logged once, and the task retries with exponential backoff
  (0.25 s -> 10 s); once the database answers again everything buffered is written.
- A row may carry its request's capture (`activity/captures.py`, under `captures.ROW_KEY`):
  stored after its batch's rows, by the same thread; dropped, not retried, if that fails,
  and dropped from every buffered row while the database is down.
- `flush(timeout)` writes everything buffered (graceful shutdown); `close(timeout)` flushes and
  stops the task.
- One class, two instances: `writer()` for the request log, `event_writer()` for the model
  events (`activity.models.ModelEvent`, rows from `activity/events.py`): the same buffering,
  batching and outage handling, each with its own buffer, so a flood of requests cannot push
  out a crash's row.
- Every row gets this process's node (`GPUPROXY_NODE`, the `node` column) unless it names one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    close_old_connections,
    connections,
    transaction,
)

from activity import captures, partitions

logger = logging.getLogger("activity.writer")

DEFAULT_MAX_BUFFER = 100_000
DEFAULT_BATCH_SIZE = 500
DEFAULT_INTERVAL = 0.25
MIN_BACKOFF = 0.25
MAX_BACKOFF = 10.0
DROP_LOG_EVERY = 1000

# The Python types that PostgreSQL's driver takes for a column as they are (`_params`).
_DATETIME = (dt.datetime,)
_PLAIN: dict[str, tuple[type, ...]] = {
    "CharField": (str,), "TextField": (str,),
    "IntegerField": (int,), "BigIntegerField": (int,), "SmallIntegerField": (int,),
    "PositiveIntegerField": (int,), "PositiveSmallIntegerField": (int,),
    "PositiveBigIntegerField": (int,),
    "FloatField": (float,), "BooleanField": (bool,), "UUIDField": (uuid.UUID,),
    "DateTimeField": _DATETIME,
}


def _configured_max_buffer() -> int:
    from django.conf import settings

    return int(settings.GPUPROXY_ACTIVITY_BUFFER)


def _configured_node() -> str:
    from django.conf import settings

    return str(settings.GPUPROXY_NODE)


class ActivityWriter:
    def __init__(self, *, max_buffer: int | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 interval: float = DEFAULT_INTERVAL, using: str = "default",
                 min_backoff: float = MIN_BACKOFF, max_backoff: float = MAX_BACKOFF,
                 model: str = "RequestLog", node: str | None = None) -> None:
        self.model_name = model  # a class of activity.models: the table this one fills
        self.node = node if node is not None else _configured_node()
        self.max_buffer = max_buffer if max_buffer is not None else _configured_max_buffer()
        self.batch_size = max(batch_size, 1)
        self.interval = interval
        self.using = using
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff

        self._buf: deque[dict[str, Any]] = deque()
        self._inflight = 0  # rows taken out of the buffer by the batch being written
        self._dropped = 0
        self._written = 0
        self._write_errors = 0
        self._rejected = 0  # rows the database refused as data (bad value): never retried
        self._batches = 0

        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None  # enough rows for a batch, or close/flush
        self._urgent: asyncio.Event | None = None  # flush/close: cut a backoff short
        self._lock: asyncio.Lock | None = None  # one batch in flight at a time
        self._closing = False
        self._failing = False
        self._backoff = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._char_limits: dict[str, int] | None = None
        self._sql: str | None = None  # the prepared INSERT (see _statement)
        self._copy_sql = ""  # and the COPY of the same columns
        self._plain: list[tuple[type, ...]] | None = None  # see _params
        self._fields: list[tuple[str, Any]] = []

    # ---- counters -----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Rows accepted but not yet in the table (including the batch being written)."""
        return len(self._buf) + self._inflight

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def written(self) -> int:
        return self._written

    @property
    def write_errors(self) -> int:
        return self._write_errors

    @property
    def rejected(self) -> int:
        return self._rejected

    @property
    def batches(self) -> int:
        return self._batches

    # ---- the request side ---------------------------------------------------------------

    def submit(self, row: dict[str, Any]) -> None:
        """Hand one finished row to the writer: O(1), never blocks, never raises for a full
        buffer (the oldest row is dropped and counted instead)."""
        buf = self._buf
        buf.append(row)
        if len(buf) > self.max_buffer:
            buf.popleft()
            self._count_drops(1)
        if len(buf) >= self.batch_size and self._wake is not None:
            self._notify(self._wake)

    def _notify(self, event: asyncio.Event) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:  # submitted from another thread
            loop.call_soon_threadsafe(event.set)

    def _count_drops(self, n: int) -> None:
        before = self._dropped
        self._dropped += n
        if before == 0 or before // DROP_LOG_EVERY != self._dropped // DROP_LOG_EVERY:
            logger.warning(
                "activity writer: buffer full (%d rows), dropped the oldest rows: %d dropped "
                "so far; the database has been unavailable or too slow — bring it back, or "
                "raise GPUPROXY_ACTIVITY_BUFFER", self.max_buffer, self._dropped)

    # ---- the background task ------------------------------------------------------------

    def start(self) -> None:
        """Start the background task on the running loop (idempotent; restarts it if the
        previous loop is gone)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._lock = asyncio.Lock()
        self._closing = False
        # A fresh context: the task must not inherit a request's (asgiref) context.
        self._task = loop.create_task(self._run(), name="activity-writer",
                                      context=contextvars.Context())
        # the months ahead exist before rows need them: on the thread, never the loop
        self._get_executor().submit(partitions.keep_ahead, self.model_name, self.using,
                                    close=True)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        assert self._wake is not None and self._urgent is not None
        while not self._closing:
            if len(self._buf) < self.batch_size:
                self._wake.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancel that lands as the event is set, and close() would wait for us.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await self._wake.wait()
            if self._closing:
                break
            while self._buf and not self._closing:
                try:
                    ok = await self._write_batch()
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let the task die
                    logger.exception("activity writer: unexpected error")
                    ok = False
                if not ok:
                    self._urgent.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._backoff):
                            await self._urgent.wait()
                    break

    def _ensure_async_state(self) -> None:
        if self._lock is None or self._loop is not asyncio.get_running_loop():
            self._loop = asyncio.get_running_loop()
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._urgent = asyncio.Event()

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="activity-writer")
            return self._executor

    async def _write_batch(self) -> bool:
        """Write one batch; True on success (or nothing to do), False on a database error
        (the rows are back at the front of the buffer).

        The accounting happens in a callback on the thread's future, so a caller cancelled
        mid-write (a flush deadline) neither loses the batch nor writes it twice."""
        assert self._lock is not None
        async with self._lock:
            if not self._buf:
                return True
            n = min(self.batch_size, len(self._buf))
            batch = [self._buf.popleft() for _ in range(n)]
            self._inflight += n
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._get_executor(), self._write_rows, batch)
            fut.add_done_callback(lambda f: self._settle(batch, f))
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                raise
            except Exception:
                return False
            return True

    def _settle(self, batch: list[dict[str, Any]], fut: asyncio.Future) -> None:
        n = len(batch)
        self._inflight -= n
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self._put_back(batch)
            # Captures wait for no outage: while the rows are kept, theirs go (their bodies
            # would hold memory the row cap does not count).
            for row in self._buf:
                row.pop(captures.ROW_KEY, None)
            self._write_errors += 1
            self._backoff = (self.min_backoff if not self._failing
                             else min(self._backoff * 2, self.max_backoff))
            # one line when it starts failing, then one every 30 errors at the longest backoff
            if not self._failing or (self._backoff >= self.max_backoff
                                     and self._write_errors % 30 == 0):
                logger.warning(
                    "activity writer: database unavailable (%s); %d rows buffered, "
                    "retrying in %.2f s", _one_line(exc), self.buffered, self._backoff)
            self._failing = True
            return
        rejected = fut.result()
        self._batches += 1
        self._rejected += rejected
        self._written += n - rejected
        if self._failing:
            logger.info("activity writer: database reachable again; writing the %d buffered "
                        "rows (%d write errors during the outage)", self.buffered + n,
                        self._write_errors)
            self._failing = False
            self._backoff = 0.0

    def _put_back(self, batch: list[dict[str, Any]]) -> None:
        """Return a batch to the FRONT of the buffer; over the cap, the oldest go."""
        self._buf.extendleft(reversed(batch))
        over = len(self._buf) - self.max_buffer
        if over > 0:
            for _ in range(over):
                self._buf.popleft()
            self._count_drops(over)

    # ---- the database thread ------------------------------------------------------------

    def _limits(self) -> dict[str, int]:
        if self._char_limits is None:
            self._char_limits = {
                f.name: int(f.max_length or 0) for f in self._model()._meta.concrete_fields
                if getattr(f, "max_length", None) and f.get_internal_type() == "CharField"}
        return self._char_limits

    def _model(self) -> Any:
        from activity import models

        return getattr(models, self.model_name)

    def _statement(self, conn) -> tuple[str, list[tuple[str, Any]]]:
        """One INSERT of every column, prepared once: (sql, [(attname, field)])."""
        if self._sql is None:
            model = self._model()
            fields = [f for f in model._meta.concrete_fields if not f.primary_key]
            columns = ", ".join(conn.ops.quote_name(f.column) for f in fields)
            table = conn.ops.quote_name(model._meta.db_table)
            self._sql = (f"INSERT INTO {table} ({columns}) "
                         f"VALUES ({', '.join(['%s'] * len(fields))})")
            self._copy_sql = f"COPY {table} ({columns}) FROM STDIN"
            self._fields = [(f.attname, f) for f in fields]
        return self._sql, self._fields

    def _params(self, row: dict[str, Any], conn, fields: list[tuple[str, Any]]
                ) -> list[Any]:
        """A row's values as the database takes them (text cut to its column).

        On PostgreSQL a value already of the column's plain Python type (a str for text, an
        int for an integer, an aware datetime, a UUID, None where NULL is allowed) goes as it
        is: it is what `get_db_prep_save` would return, and its call chain per column was
        half the writer's CPU per row. Anything else, JSON included, takes Django's way."""
        limits = self._limits()
        plain = self._plain_types(fields) if conn.vendor == "postgresql" else None
        values = []
        for i, (name, field) in enumerate(fields):
            value: Any = (row[name] if name in row else self.node if name == "node"
                          else field.get_default())
            limit = limits.get(name)
            if limit is not None and isinstance(value, str) and len(value) > limit:
                value = value[:limit]
            if plain is not None:
                kinds = plain[i]
                if (value is None and field.null) or (
                        kinds and type(value) in kinds
                        and (kinds is not _DATETIME or value.tzinfo is not None)):
                    values.append(value)
                    continue
            values.append(field.get_db_prep_save(value, conn))
        return values

    def _plain_types(self, fields: list[tuple[str, Any]]) -> list[tuple[type, ...]]:
        if self._plain is None:
            self._plain = [_PLAIN.get(field.get_internal_type(), ()) for _, field in fields]
        return self._plain

    def _insert(self, conn, sql: str, params: list[list[Any]]) -> None:
        """A batch in one transaction: on PostgreSQL a `COPY ... FROM STDIN`, whose rows
        psycopg formats in C (an `executemany` of the INSERT dumps every parameter in
        Python: twice the writer's CPU per row, on the GIL the proxy needs); one row, or
        another database, the prepared INSERT."""
        # A value the database refuses (a NUL in text) is a DataError, and so is a string
        # the driver cannot encode (a lone surrogate, which JSON can carry): the caller then
        # isolates the row instead of retrying the batch forever. COPY goes through the
        # driver's own cursor, so its errors are made Django's here.
        try:
            with transaction.atomic(using=self.using), conn.cursor() as cursor:
                if conn.vendor == "postgresql" and len(params) > 1:
                    with conn.wrap_database_errors, cursor.cursor.copy(self._copy_sql) as copy:
                        for values in params:
                            copy.write_row(values)
                else:
                    cursor.executemany(sql, params)
        except (UnicodeError, ValueError) as exc:
            raise DataError(f"a value could not be sent: {_one_line(exc)}") from exc

    def _write_rows(self, rows: list[dict[str, Any]]) -> int:
        """On the writer's own thread: insert, return the number of rows refused as bad
        data (skipped, logged). Connectivity errors propagate (the caller retries).

        Not the ORM's bulk_create (`_insert`: COPY or a prepared INSERT): a fifth of the CPU
        per row, and this thread shares the GIL with the proxy (BENCHMARKS.md)."""
        conn = connections[self.using]
        sqlite = conn.vendor == "sqlite"
        if not sqlite:
            close_old_connections()
        try:
            partitions.keep_ahead(self.model_name, self.using)  # about once a day
            sql, fields = self._statement(conn)
            params, kept, rejected = [], [], 0
            for row in rows:
                try:
                    params.append(self._params(row, conn, fields))
                    kept.append(row)
                except (TypeError, ValueError) as exc:
                    rejected += 1
                    logger.error("activity writer: dropped a malformed row (%s): %r",
                                 exc, row)
            try:
                self._insert(conn, sql, params)
            except (DataError, IntegrityError):
                # The database is up but refused some value: isolate the bad rows so one
                # cannot block the rest forever.
                for one, row in zip(params, kept, strict=True):
                    try:
                        self._insert(conn, sql, [one])
                    except (DataError, IntegrityError) as exc:
                        rejected += 1
                        logger.error("activity writer: the database refused a %s row (%s); "
                                     "dropped request_id=%s", self.model_name, _one_line(exc),
                                     row.get("request_id"))
            captures.store(kept, self.using)
            return rejected
        except DatabaseError:
            if sqlite:  # start afresh next time
                with contextlib.suppress(Exception):
                    conn.close()
            raise
        finally:
            if not sqlite:  # back to the pool; SQLite keeps its one connection open
                with contextlib.suppress(DatabaseError, Exception):
                    conn.close()

    # ---- shutdown -----------------------------------------------------------------------

    async def flush(self, timeout: float = 10.0) -> bool:  # noqa: ASYNC109
        """Write everything buffered now; True when the buffer is empty, False when the
        deadline passed first (the rows stay buffered)."""
        self._ensure_async_state()
        assert self._urgent is not None
        self._urgent.set()
        deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                while self.buffered:
                    if not self._buf:  # only a batch still in flight (a cancelled flush's)
                        await asyncio.sleep(0.01)
                    elif not await self._write_batch():
                        left = deadline - time.monotonic()
                        await asyncio.sleep(max(0.0, min(self._backoff, left)))
        except TimeoutError:
            logger.warning("activity writer: flush timed out after %.1f s; %d rows not written",
                           timeout, self.buffered)
            return False
        return True

    async def close(self, timeout: float = 10.0) -> bool:  # noqa: ASYNC109
        """Flush, then stop the background task and the thread."""
        flushed = await self.flush(timeout)
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._urgent is not None:
            self._urgent.set()
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(max(timeout, 1.0)):
                    await task
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
        return flushed


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


_writer: ActivityWriter | None = None
_event_writer: ActivityWriter | None = None
_writer_lock = threading.Lock()


def writer() -> ActivityWriter:
    """The process-wide writer (created lazily; call `.start()` from the running loop)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = ActivityWriter()
        return _writer


def event_writer() -> ActivityWriter:
    """The process-wide writer of model events (`ModelEvent`): only the process that runs
    the upstreams (the scheduler process under `serve --workers N`) starts it."""
    global _event_writer
    with _writer_lock:
        if _event_writer is None:
            _event_writer = ActivityWriter(model="ModelEvent")
        return _event_writer
