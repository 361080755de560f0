"""The activity writer against real PostgreSQL: rows arrive, in batches, the buffer is bounded,
and a real database outage (connections terminated, new ones refused) loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from django.db import connection, connections

from activity import outcomes
from activity.models import RequestLog
from activity.writer import ActivityWriter, writer

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres,
]

_db_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-db")


async def db(fn):
    """Run ORM code for the assertions on a thread of its own, connection back to the pool."""

    def call():
        try:
            return fn()
        finally:
            connections["default"].close()

    return await asyncio.get_running_loop().run_in_executor(_db_thread, call)


def row(i: int = 0, **kw) -> dict:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC) + timedelta(seconds=i)
    base = {
        "request_id": uuid.uuid4(), "received_at": t0, "method": "POST",
        "path": "/v1/chat/completions", "model_requested": "m", "model": "m",
        "status_code": 200, "outcome": outcomes.OK, "priority": i, "band": "normal",
        "scheduler": "fifo", "client": "127.0.0.1",
    }
    base.update(kw)
    return base


async def wait_for(predicate, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.02)


@pytest.fixture
async def make_writer():
    made: list[ActivityWriter] = []

    def make(**kw) -> ActivityWriter:
        w = ActivityWriter(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        await w.close(timeout=15)


def test_outcome_set_is_documented():
    for name in ("ok", "upstream_error", "rejected_capacity", "rejected_queue", "queue_timeout",
                 "cancelled_queued", "cancelled_inflight", "start_failed", "upstream_died",
                 "bad_request", "unknown_model", "unauthorized", "shutting_down"):
        assert outcomes.DESCRIPTIONS[name]
    assert [c[0] for c in RequestLog._meta.get_field("outcome").choices] == list(outcomes.ALL)


def test_time_index_is_brin_on_postgresql():
    with connection.cursor() as cur:
        cur.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'activity_requestlog'")
        defs = [r[0] for r in cur.fetchall()]
    assert any("USING brin (received_at)" in d for d in defs), defs
    assert any("(model, received_at)" in d for d in defs), defs
    assert any("(band, received_at)" in d for d in defs), defs


async def test_rows_round_trip(make_writer):
    w = make_writer(interval=0.05)
    w.start()
    rid = uuid.uuid4()
    t0 = datetime(2026, 3, 1, 9, 30, tzinfo=UTC)
    w.submit(row(
        request_id=rid, received_at=t0, dispatched_at=t0 + timedelta(milliseconds=40),
        first_byte_at=t0 + timedelta(milliseconds=300), finished_at=t0 + timedelta(seconds=2),
        model_requested="alias", model="qwen-7b", status_code=200, outcome=outcomes.OK,
        priority=-(2**40), band="batch", score=12.5,
        score_parts={"priority": 10, "affinity": 2.0, "aging": 0.5, "seq": 7},
        queue_wait_ms=40.0, swap_ms=1500.0, duration_ms=2000.0, ttft_ms=300.0, stream=True,
        prompt_tokens=11, completion_tokens=22, cached_tokens=3, prompt_tps=900.5,
        generation_tps=45.25, scheduler="priority", client="alice", user_agent="x" * 2000,
        error=""))
    # within 1 s without any flush: the time-based batch
    await wait_for(lambda: w.written == 1, deadline=1.0)
    got = await db(lambda: RequestLog.objects.get(request_id=rid))
    assert got.received_at == t0 and got.finished_at == t0 + timedelta(seconds=2)
    assert (got.model_requested, got.model, got.band, got.scheduler, got.client) == (
        "alias", "qwen-7b", "batch", "priority", "alice")
    assert got.priority == -(2**40) and got.score == 12.5 and got.stream is True
    assert got.score_parts == {"priority": 10, "affinity": 2.0, "aging": 0.5, "seq": 7}
    assert (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (11, 22, 3)
    assert (got.prompt_tps, got.generation_tps, got.ttft_ms, got.swap_ms) == (
        900.5, 45.25, 300.0, 1500.0)
    assert got.user_agent == "x" * 512  # truncated to fit
    assert w.buffered == 0 and w.write_errors == 0


async def test_a_batch_round_trips_through_copy(make_writer):
    """A batch goes to PostgreSQL as one COPY with most values as they are (writer._params):
    text that COPY must escape, NULLs, JSON, extreme integers and an aware datetime from
    another zone come back as sent; a row with a value of the wrong type is refused alone."""
    w = make_writer(interval=3600, batch_size=1000)
    w.start()
    t0 = datetime(2026, 3, 1, 9, 30, tzinfo=UTC)
    east = datetime(2026, 3, 1, 11, 30, tzinfo=timezone(timedelta(hours=2)))  # = t0
    tricky = "tab\there\nnewline \\N back\\slash \u00e9\u4e2d \U0001F600 \\."
    rows = [row(i, received_at=east if i == 3 else t0 + timedelta(seconds=i),
                error=tricky if i % 2 else "", user_agent=tricky, priority=-(2**62) + i,
                score=None if i % 3 else 1.5 + i, stream=bool(i % 2),
                score_parts={"seq": i, "text": tricky} if i % 2 else None,
                prompt_tokens=None if i % 4 == 0 else i, upstream_retries=i % 3)
            for i in range(40)]
    bad = row(99, status_code="two hundred")
    for r in [*rows[:20], bad, *rows[20:]]:
        w.submit(r)
    assert await w.flush(10)
    assert (w.written, w.rejected) == (40, 1)
    got = await db(lambda: {g.request_id: g for g in RequestLog.objects.all()})
    assert len(got) == 40
    for i, r in enumerate(rows):
        g = got[r["request_id"]]
        assert g.received_at == (t0 if i == 3 else t0 + timedelta(seconds=i))
        assert (g.error, g.user_agent, g.priority, g.score, g.stream, g.score_parts,
                g.prompt_tokens, g.upstream_retries) == (
            r["error"], tricky, r["priority"], r["score"], r["stream"], r["score_parts"],
            r["prompt_tokens"], r["upstream_retries"])


@pytest.mark.parametrize("bad", ["nul\x00inside", "lone \ud800 surrogate"])
async def test_a_value_the_database_refuses_in_a_copy_batch_costs_only_its_row(make_writer, bad):
    """COPY goes through the driver's own cursor: a refused value must still be a DataError
    that isolates its row, or the whole batch is retried forever and nothing is written."""
    w = make_writer(interval=3600, batch_size=1000)
    w.start()
    good = [row(i) for i in range(5)]
    for r in [*good[:2], row(9, error=bad), *good[2:]]:
        w.submit(r)
    assert await w.flush(10), "the activity writer is stuck"
    assert (w.written, w.rejected) == (5, 1)
    got = await db(lambda: set(RequestLog.objects.values_list("request_id", flat=True)))
    assert got == {r["request_id"] for r in good}


async def test_many_rows_few_batches(make_writer, monkeypatch):
    calls: list[int] = []
    w = make_writer(batch_size=500, interval=0.05)
    real = w._insert

    def counting(conn, sql, params):
        calls.append(len(params))
        return real(conn, sql, params)

    monkeypatch.setattr(w, "_insert", counting)
    w.start()
    for i in range(2000):
        w.submit(row(i))
    assert await w.flush(timeout=10)
    assert w.written == 2000 and w.buffered == 0
    assert sum(calls) == 2000 and len(calls) <= 6, calls
    assert await db(RequestLog.objects.count) == 2000


async def test_cap_keeps_the_newest_and_counts_drops(make_writer):
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logging.getLogger("activity.writer").addHandler(handler)
    try:
        w = make_writer(max_buffer=10)  # not started: nothing drains, as if the DB were down
        for i in range(25):
            w.submit(row(i))
    finally:
        logging.getLogger("activity.writer").removeHandler(handler)
    assert (w.buffered, w.dropped) == (10, 15)
    assert len(records) == 1 and "GPUPROXY_ACTIVITY_BUFFER" in records[0].getMessage()
    assert await w.flush(timeout=10)
    kept = await db(lambda: sorted(RequestLog.objects.values_list("priority", flat=True)))
    assert kept == list(range(15, 25))


@contextlib.contextmanager
def _maintenance():
    s = connection.settings_dict
    with psycopg.connect(host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432,
                         user=s["USER"], password=s["PASSWORD"] or None, dbname="postgres",
                         autocommit=True) as conn:
        yield conn, s["NAME"]


def _outage_start() -> None:
    """A real outage of the test database: refuse new connections (superusers included) and
    terminate every existing one, the pooled connections of the writer too."""
    with _maintenance() as (conn, name):
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = %s AND pid <> pg_backend_pid()", [name])


def _outage_end() -> None:
    with _maintenance() as (conn, name):
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    # the pool still holds sockets killed during the outage: let it replace them
    pool = getattr(connections["default"], "pool", None)
    if pool is not None:
        pool.check()


async def test_real_outage_loses_nothing(make_writer, monkeypatch):
    # The pool waits `timeout` (10 s in settings) for a connection before failing; the
    # prototype's 2 s keeps the test short. The outage itself is real.
    pool = await db(lambda: connections["default"].pool)
    monkeypatch.setattr(pool, "timeout", 2.0)
    w = make_writer(batch_size=50, interval=0.05, min_backoff=0.05, max_backoff=0.5)
    w.start()
    for i in range(30):
        w.submit(row(i))
    await wait_for(lambda: w.written == 30)

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _outage_start)
    try:
        slowest = 0.0
        for i in range(30, 330):  # keep serving while the database is gone
            t = time.perf_counter()
            w.submit(row(i))
            slowest = max(slowest, time.perf_counter() - t)
            if i % 30 == 0:
                await asyncio.sleep(0.1)
        await wait_for(lambda: w.write_errors > 0, deadline=15)
        assert slowest < 0.005, f"submit took {slowest * 1000:.1f} ms during the outage"
        assert w.buffered > 0 and w.dropped == 0
    finally:
        await loop.run_in_executor(None, _outage_end)

    await wait_for(lambda: w.written == 330 and w.buffered == 0, deadline=20)
    count, distinct = await db(lambda: (
        RequestLog.objects.count(),
        RequestLog.objects.values("request_id").distinct().count()))
    assert count == distinct == 330  # every row, none twice


async def test_close_flushes_the_tail(make_writer):
    w = make_writer(interval=30)  # the timer would never fire within the test
    w.start()
    # Idle is not observable from outside; one loop turn is exact, not a guess: the new task
    # runs to its first await, the 30 s wait for work, and parks there.
    await asyncio.sleep(0)
    assert w.running and w.batches == 0
    for i in range(7):
        w.submit(row(i))
    assert await w.close(timeout=10)
    assert not w.running and w.written == 7
    assert await db(RequestLog.objects.count) == 7


def test_writer_accessor_is_process_wide(monkeypatch, settings):
    settings.GPUPROXY_ACTIVITY_BUFFER = 1234
    monkeypatch.setattr("activity.writer._writer", None)
    assert writer() is writer()
    assert writer().max_buffer == 1234
