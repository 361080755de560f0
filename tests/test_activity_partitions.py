"""Monthly partitions of the activity tables on PostgreSQL (migration 0009, activity/partitions.py,
`activity_prune` and `activity_partitions`): where rows land, DEFAULT's rows moved out when
their month is created, whole partitions dropped by prune, and a table that had rows converted
without a copy, its ids continuing."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import io
import logging
import re
import uuid
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from activity import outcomes, partitions
from activity.admin import EstimatedCountPaginator
from activity.models import Capture, ModelEvent, RequestLog
from activity.writer import ActivityWriter
from tests.conftest import database_url

pytestmark = pytest.mark.postgres

UTC = dt.UTC
BEFORE = ("activity", "0008_text_column_defaults")
AFTER = ("activity", "0009_partition_by_month")


def months_from(t: dt.datetime, n: int) -> dt.datetime:
    """The first instant (UTC) of the month `n` months after `t`'s (n may be negative)."""
    index = t.year * 12 + (t.month - 1) + n
    return dt.datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)


def name(table: str, month: dt.datetime) -> str:
    return f"{table}_p{month.year:04d}_{month.month:02d}"


def sql(text: str, params: list | None = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(text, params)
        return list(cursor.fetchall())


def landed(table: str, request_id: uuid.UUID) -> str:
    ((where,),) = sql(f"SELECT tableoid::regclass::text FROM {table} WHERE request_id = %s",
                      [request_id])
    return where


def request_row(at: dt.datetime, **kw) -> RequestLog:
    return RequestLog(request_id=uuid.uuid4(), received_at=at, outcome=outcomes.OK, **kw)


def event_row(at: dt.datetime) -> ModelEvent:
    return ModelEvent(at=at, model="m", kind="load", request_id=uuid.uuid4())


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


# --- the layout the migration makes ---------------------------------------------------------


@pytest.mark.django_db
def test_both_tables_are_partitioned_by_month_with_a_default():
    now = timezone.now()
    assert sql("SELECT c.relname, c.relkind, p.partstrat, a.attname "
               "FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
               "JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
               "WHERE c.relname LIKE 'activity_%' ORDER BY c.relname") == [
        ("activity_modelevent", "p", "r", "at"),
        ("activity_requestlog", "p", "r", "received_at")]
    for table in ("activity_requestlog", "activity_modelevent"):
        # the test database was empty when migrated: no legacy partition, this month and
        # the two after it, and DEFAULT
        assert [p.name for p in partitions.partitions(table)] == [
            name(table, months_from(now, 0)), name(table, months_from(now, 1)),
            name(table, months_from(now, 2)), f"{table}_default"]
        parts = partitions.partitions(table)
        assert (parts[0].lower, parts[0].upper) == (months_from(now, 0), months_from(now, 1))
        assert parts[-1].default and parts[-1].lower is None and parts[-1].upper is None


@pytest.mark.django_db
def test_the_parent_keeps_djangos_index_names_and_a_key_with_the_time():
    assert sorted(sql("SELECT indexname FROM pg_indexes WHERE tablename = "
                      "'activity_requestlog'")) == [
        ("activity_requestlog_pkey",), ("activity_requestlog_request_id_bf267e46",),
        ("activity_rl_band_time",), ("activity_rl_model_time",), ("activity_rl_node_time",),
        ("activity_rl_outcome",), ("activity_rl_received_at",)]
    assert sql("SELECT pg_get_constraintdef(oid) FROM pg_constraint "
               "WHERE conname IN ('activity_requestlog_pkey', 'activity_modelevent_pkey') "
               "ORDER BY conname") == [("PRIMARY KEY (id, at)",),
                                       ("PRIMARY KEY (id, received_at)",)]
    assert sql("SELECT indexdef LIKE '%USING brin (received_at)' FROM pg_indexes "
               "WHERE indexname = 'activity_rl_received_at'") == [(True,)]
    # the model events' request_id refers to a request without a foreign key
    assert sql("SELECT count(*) FROM pg_constraint WHERE contype = 'f' AND conrelid IN "
               "('activity_modelevent'::regclass, 'activity_requestlog'::regclass)") == [(0,)]


# --- rows and where they land ---------------------------------------------------------------


@pytest.mark.django_db
def test_the_orm_reads_and_writes_through_the_parent():
    now = timezone.now()
    this_month, old = request_row(now, model="a"), request_row(
        dt.datetime(2020, 5, 17, tzinfo=UTC), model="b")
    this_month.save()
    old.save()
    assert old.id == this_month.id + 1
    assert landed("activity_requestlog", this_month.request_id) == name(
        "activity_requestlog", months_from(now, 0))
    assert landed("activity_requestlog", old.request_id) == "activity_requestlog_default"
    assert RequestLog.objects.get(id=old.id).model == "b"
    RequestLog.objects.filter(id=this_month.id).update(model="c")
    assert list(RequestLog.objects.order_by("id").values_list("model", flat=True)) == ["c", "b"]
    RequestLog.objects.filter(id=old.id).delete()
    assert RequestLog.objects.count() == 1


@pytest.mark.django_db(transaction=True)
async def test_the_writers_copy_lands_in_each_rows_partition():
    now = timezone.now()
    requests = ActivityWriter(interval=3600, batch_size=100)
    events = ActivityWriter(interval=3600, batch_size=100, model="ModelEvent")
    at = [now, months_from(now, 1) + dt.timedelta(hours=1), dt.datetime(2021, 1, 2, tzinfo=UTC)]
    ids = [uuid.uuid4() for _ in at]
    try:
        requests.start()
        events.start()
        for t, rid in zip(at, ids, strict=True):  # a batch of 3: one COPY each
            requests.submit({"request_id": rid, "received_at": t, "outcome": outcomes.OK})
            events.submit({"at": t, "model": "m", "kind": "load", "request_id": rid})
        assert await requests.flush(10) and await events.flush(10)
    finally:
        await requests.close(10)
        await events.close(10)
    assert (requests.written, events.written, requests.batches, events.batches) == (3, 3, 1, 1)

    def where() -> list[list[str]]:
        try:
            return [[landed(table, rid) for rid in ids]
                    for table in ("activity_requestlog", "activity_modelevent")]
        finally:
            connections["default"].close()

    got = await asyncio.get_running_loop().run_in_executor(None, where)
    assert got == [[name(t, months_from(now, 0)), name(t, months_from(now, 1)), f"{t}_default"]
                   for t in ("activity_requestlog", "activity_modelevent")]


@pytest.mark.django_db
def test_rows_past_the_partitions_wait_in_default_and_move_when_their_month_comes():
    now = timezone.now()
    far = months_from(now, 5)  # the migration made this month and the next two
    rows = [request_row(far + dt.timedelta(days=2)), request_row(far + dt.timedelta(days=9)),
            request_row(months_from(now, 4)), request_row(dt.datetime(2019, 1, 1, tzinfo=UTC))]
    RequestLog.objects.bulk_create(rows)
    ModelEvent.objects.bulk_create([event_row(far), event_row(far + dt.timedelta(hours=5))])
    assert {landed("activity_requestlog", r.request_id) for r in rows} == {
        "activity_requestlog_default"}

    created = partitions.ensure_ahead(5)
    assert created == [name("activity_requestlog", months_from(now, n)) for n in (3, 4, 5)] + [
        name("activity_modelevent", months_from(now, n)) for n in (3, 4, 5)]
    assert [landed("activity_requestlog", r.request_id) for r in rows] == [
        name("activity_requestlog", far), name("activity_requestlog", far),
        name("activity_requestlog", months_from(now, 4)), "activity_requestlog_default"]
    assert sql("SELECT tableoid::regclass::text, count(*) FROM activity_modelevent "
               "GROUP BY 1") == [(name("activity_modelevent", far), 2)]
    # the moved rows are the same rows (ids kept), still found through the parent
    assert sorted(RequestLog.objects.values_list("id", flat=True)) == sorted(r.id for r in rows)
    # the new partitions got the parent's indexes
    assert sql("SELECT count(*) FROM pg_indexes WHERE tablename = %s",
               [name("activity_requestlog", far)]) == [(7,)]
    assert partitions.ensure_ahead(5) == []


@pytest.mark.django_db
def test_a_month_another_process_created_meanwhile_is_left_as_it_is():
    """Every request process's writer checks at its start: the second to get the table's
    lock finds the month made and makes nothing (before, CREATE TABLE failed: a warning)."""
    now = timezone.now()
    made = request_row(now)
    made.save()
    assert partitions.create_month("activity_requestlog", months_from(now, 0)) is None
    assert landed("activity_requestlog", made.request_id) == name(
        "activity_requestlog", months_from(now, 0))


def estimate(table: str) -> str:
    """How the listing shows PostgreSQL's estimate, read here from pg_class (whatever earlier
    tests of the run left there: an ANALYZE outlives their rollback or flush)."""
    ((tuples,),) = sql("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table])
    return "not analyzed yet" if tuples < 0 else f"about {int(tuples)} rows"


@pytest.mark.django_db
def test_partitions_command_lists_and_creates_ahead():
    now = timezone.now()
    out = run("activity_partitions", "--ahead", "3")
    assert out.splitlines() == [f"created {name('activity_requestlog', months_from(now, 3))}",
                                f"created {name('activity_modelevent', months_from(now, 3))}"]
    assert run("activity_partitions", "--ahead", "3").startswith("nothing to create")
    listing = run("activity_partitions").splitlines()
    assert listing[0] == "activity_requestlog (partitioned by received_at)"
    first, second = months_from(now, 0), months_from(now, 1)
    assert listing[1] == (f"  {name('activity_requestlog', first)}  {first.isoformat()} to "
                          f"{second.isoformat()}  {estimate(name('activity_requestlog', first))}")
    assert listing[5] == ("  activity_requestlog_default  DEFAULT  "
                          f"{estimate('activity_requestlog_default')}")
    assert listing[6] == "activity_modelevent (partitioned by at)"
    assert len(listing) == 12


def test_keep_ahead_logs_what_to_do_and_never_raises(monkeypatch, caplog):
    """The writer's daily check: a failure is a warning with the remedy, and it is retried
    after RETRY_AFTER rather than at every batch."""
    calls = []

    def broken(**kw):
        calls.append(kw)
        raise RuntimeError("lock timeout")

    monkeypatch.setattr(partitions, "ensure_ahead", broken)
    monkeypatch.setattr(partitions, "_due", {})
    with caplog.at_level(logging.WARNING, logger="activity.partitions"):
        partitions.keep_ahead("RequestLog")
        partitions.keep_ahead("RequestLog")  # not due again yet
    assert calls == [{"using": "default", "tables": ("activity_requestlog",)}]
    (record,) = caplog.records
    assert "activity_requestlog_default" in record.getMessage()
    assert "activity_partitions --ahead 2" in record.getMessage()


# --- prune ----------------------------------------------------------------------------------


@pytest.fixture
def months_of_rows():
    """Rows in the months around a 70-day cutoff C (its month M): M-2 and M-1 wholly older,
    M split by the cutoff, DEFAULT holding one very old and one far-future row."""
    now = timezone.now()
    cutoff = now - dt.timedelta(days=70)
    m = months_from(cutoff, 0)
    for n in range(-2, 3):  # M-2 .. M+2: this month and before, that the migration lacks
        month = months_from(m, n)
        if month < months_from(now, 0):
            for table in partitions.TABLES:
                partitions.create_month(table, month)
    older_in_m = m + (cutoff - m) / 2
    younger_in_m = cutoff + (months_from(m, 1) - cutoff) / 2
    at = ([months_from(m, -2) + dt.timedelta(days=d) for d in (1, 2, 3)]     # dropped: 3
          + [months_from(m, -1) + dt.timedelta(days=d) for d in (4, 5)]      # dropped: 2
          + [older_in_m, older_in_m, younger_in_m]                           # 2 deleted
          + [now]                                                            # kept
          + [dt.datetime(2015, 1, 1, tzinfo=UTC), months_from(now, 30)])     # DEFAULT: 1 deleted
    RequestLog.objects.bulk_create(request_row(t) for t in at)
    ModelEvent.objects.bulk_create(event_row(t) for t in at[:1] + at[5:7] + at[8:])
    return m


@pytest.mark.django_db
def test_prune_drops_whole_old_partitions_and_deletes_only_across_the_cutoff(months_of_rows):
    m = months_of_rows
    rl, me = "activity_requestlog", "activity_modelevent"
    # a drop reports PostgreSQL's estimate (counting would read the month), and these months,
    # made in this test's transaction, were never analyzed (an ANALYZE here would outlive the
    # rollback: pg_class is updated in place)
    out = run("activity_prune", "--older-than", "70d", "--batch", "1").splitlines()
    cutoff = out[0].rsplit(" ", 1)[1]
    lower = {n: months_from(m, n).isoformat() for n in (-2, -1, 0)}
    assert out == [
        f"deleted 3 rows older than {cutoff}",
        f"dropped partition {name(rl, months_from(m, -2))} ({lower[-2]} to {lower[-1]}, "
        f"rows not counted)",
        f"dropped partition {name(rl, months_from(m, -1))} ({lower[-1]} to {lower[0]}, "
        f"rows not counted)",
        f"deleted 3 model events older than {cutoff}",
        f"dropped partition {name(me, months_from(m, -2))} ({lower[-2]} to {lower[-1]}, "
        f"rows not counted)",
        f"dropped partition {name(me, months_from(m, -1))} ({lower[-1]} to {lower[0]}, "
        f"rows not counted)"]
    assert RequestLog.objects.count() == 3 and ModelEvent.objects.count() == 2
    assert partitions.partitions(rl)[0].name == name(rl, m)
    assert sql(f"SELECT count(*) FROM {name(rl, m)}") == [(1,)]
    assert sql(f"SELECT count(*) FROM {rl}_default") == [(1,)]
    # again: nothing left to do
    out = run("activity_prune", "--older-than", "70d").splitlines()
    assert [line.rsplit(" older", 1)[0] for line in out] == ["deleted 0 rows",
                                                            "deleted 0 model events"]


@pytest.mark.django_db
def test_prune_dry_run_names_the_partitions_and_changes_nothing(months_of_rows):
    m = months_of_rows
    out = run("activity_prune", "--older-than", "70d", "--dry-run").splitlines()
    assert [line.split(" (")[0].rsplit(" older", 1)[0] for line in out] == [
        "dry run: would delete 3 rows",
        f"dry run: would drop partition {name('activity_requestlog', months_from(m, -2))}",
        f"dry run: would drop partition {name('activity_requestlog', months_from(m, -1))}",
        "dry run: would delete 3 model events",
        f"dry run: would drop partition {name('activity_modelevent', months_from(m, -2))}",
        f"dry run: would drop partition {name('activity_modelevent', months_from(m, -1))}"]
    assert RequestLog.objects.count() == 11 and ModelEvent.objects.count() == 6
    assert len(partitions.partitions("activity_requestlog")) == len(
        partitions.partitions("activity_modelevent"))


# --- the migration on a table that has rows -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_migration_attaches_a_table_with_rows_and_ids_continue():
    now = timezone.now()
    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE])
    try:
        old = executor.loader.project_state([BEFORE]).apps
        OldLog, OldEvent = old.get_model("activity", "RequestLog"), old.get_model(
            "activity", "ModelEvent")
        times = [dt.datetime(2024, 2, 29, 12, tzinfo=UTC), now - dt.timedelta(days=40), now]
        made = [OldLog.objects.create(request_id=uuid.uuid4(), received_at=t, outcome="ok",
                                      model=f"m{i}") for i, t in enumerate(times)]
        event = OldEvent.objects.create(at=now, model="m", kind="load")
        # a clock in the future: moved out, not stretching the legacy partition to 2099
        future = OldLog.objects.create(request_id=uuid.uuid4(), outcome="ok", model="future",
                                       received_at=dt.datetime(2099, 5, 1, tzinfo=UTC))
        # ids the identity handed out and then lost (a deleted row) stay used
        OldLog.objects.filter(id=made[-1].id).delete()
        with connection.cursor() as cursor:
            cursor.execute("COMMENT ON COLUMN activity_requestlog.model IS 'resolved model id'")
        executor = MigrationExecutor(connection)
        executor.migrate([AFTER])

        legacy = partitions.partitions("activity_requestlog")[0]
        assert (legacy.name, legacy.lower, legacy.upper) == (
            "activity_requestlog_legacy", None, months_from(now, 1))
        assert [p.name for p in partitions.partitions("activity_requestlog")[1:]] == [
            name("activity_requestlog", months_from(now, 1)),
            name("activity_requestlog", months_from(now, 2)), "activity_requestlog_default"]
        assert sql("SELECT id, model, tableoid::regclass::text FROM activity_requestlog "
                   "ORDER BY id") == [(made[0].id, "m0", "activity_requestlog_legacy"),
                                      (made[1].id, "m1", "activity_requestlog_legacy"),
                                      (future.id, "future", "activity_requestlog_default")]
        assert sql("SELECT col_description('activity_requestlog'::regclass, "
                   "(SELECT attnum FROM pg_attribute WHERE attname = 'model' AND "
                   "attrelid = 'activity_requestlog'::regclass))") == [("resolved model id",)]
        # the models as of 0009: the table has none of the later columns yet
        after = executor.loader.project_state([AFTER]).apps
        NewLog, NewEvent = after.get_model("activity", "RequestLog"), after.get_model(
            "activity", "ModelEvent")
        new = NewLog.objects.create(request_id=uuid.uuid4(), received_at=now, outcome="ok")
        assert new.id == future.id + 1
        assert landed("activity_requestlog", new.request_id) == "activity_requestlog_legacy"
        assert NewEvent.objects.create(at=now, model="m", kind="ready").id == event.id + 1
        assert partitions.partitions("activity_modelevent")[0].name == (
            "activity_modelevent_legacy")

        # and back: one plain table again, every row, the identity still going on
        executor = MigrationExecutor(connection)
        executor.migrate([BEFORE])
        assert sql("SELECT relkind FROM pg_class WHERE relname = 'activity_requestlog'") == [
            ("r",)]
        assert sql("SELECT id FROM activity_requestlog ORDER BY id") == [
            (made[0].id,), (made[1].id,), (future.id,), (new.id,)]
        assert OldLog.objects.create(request_id=uuid.uuid4(), received_at=now,
                                     outcome="ok").id == new.id + 1
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate([BEFORE])
        with connection.cursor() as cursor:  # empty again: no legacy partition for the rest
            cursor.execute("TRUNCATE activity_requestlog, activity_modelevent")
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())



@pytest.mark.django_db
def test_the_migration_gives_up_behind_a_long_query_having_changed_nothing(monkeypatch):
    """Without a limit, its lock would wait behind an analyst's query, and every writer and
    reader would queue behind it for as long."""
    migration = importlib.import_module("activity.migrations.0009_partition_by_month")
    monkeypatch.setattr(migration, "LOCK_TIMEOUT", "200ms")
    with psycopg.connect(database_url().replace("postgres://", "postgresql://")) as other:
        other.execute("SELECT count(*) FROM activity_modelevent")  # a transaction holds it
        with pytest.raises(RuntimeError, match=r"could not lock activity_requestlog and "
                           r"activity_modelevent within 200ms: .* run `gpuproxy migrate` "
                           r"again"), connection.cursor() as cursor:
            migration._lock(cursor)
        other.rollback()


@pytest.mark.django_db
def test_the_row_estimate_adds_up_the_partitions_autovacuum_analyzes():
    """Autovacuum analyzes partitions, never the partitioned parent, whose own estimate stays
    unknown (-1): the admin's count would fall back to its cap on a table of millions."""
    now = timezone.now()
    this_month = name("activity_requestlog", months_from(now, 0))
    # the other partitions' estimates, as earlier tests of the run may have left them (an
    # ANALYZE outlives a rollback): these two are analyzed below
    ((others,),) = sql(
        "SELECT coalesce(sum(reltuples) FILTER (WHERE reltuples >= 0), 0)::bigint "
        "FROM pg_class WHERE relkind = 'r' AND oid IN (SELECT relid FROM "
        "pg_partition_tree('activity_requestlog')) AND relname NOT IN (%s, %s)",
        [this_month, "activity_requestlog_default"])
    RequestLog.objects.bulk_create([request_row(now) for _ in range(30)] + [
        request_row(dt.datetime(2020, 1, 1, tzinfo=UTC)) for _ in range(12)])
    with connection.cursor() as cursor:  # what autovacuum does: the partitions, one by one
        cursor.execute(f"ANALYZE {this_month}")
        cursor.execute("ANALYZE activity_requestlog_default")
    assert partitions.estimate_rows("activity_requestlog") == others + 30 + 12
    assert EstimatedCountPaginator._estimate(RequestLog.objects.all()) == others + 42
    # a plain table: its own estimate
    Capture.objects.bulk_create(Capture(request_id=uuid.uuid4(), size=1, data=b"x")
                                for _ in range(3))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE activity_capture")
    assert partitions.estimate_rows("activity_capture") == 3


@pytest.mark.django_db(transaction=True)
async def test_the_writer_creates_the_months_ahead_when_it_starts(monkeypatch):
    """On its own thread, before its first batch (one thread: the batch waits behind it)."""
    now = timezone.now()
    missing = name("activity_modelevent", months_from(now, 2))

    def drop() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"DROP TABLE {missing}")
        finally:
            connections["default"].close()

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, drop)
    monkeypatch.setattr(partitions, "_due", {})
    events = ActivityWriter(interval=3600, batch_size=100, model="ModelEvent")
    try:
        events.start()
        # the writer's thread runs jobs in order: once this one ran, the start's check has
        await loop.run_in_executor(events._get_executor(), lambda: None)

        def names() -> list[str]:
            try:
                return [p.name for p in partitions.partitions("activity_modelevent")]
            finally:
                connections["default"].close()

        assert missing in await loop.run_in_executor(None, names)
        events.submit({"at": months_from(now, 2), "model": "m", "kind": "load"})
        assert await events.flush(10)
    finally:
        await events.close(10)

    def where() -> str:
        try:
            ((got,),) = sql("SELECT tableoid::regclass::text FROM activity_modelevent")
            return got
        finally:
            connections["default"].close()

    assert await loop.run_in_executor(None, where) == missing


DOC = Path(__file__).resolve().parent.parent / "docs" / "activity.md"


def doc_queries() -> list[str]:
    """The ```sql blocks of docs/activity.md's *Partitions and retention*, as written."""
    text = DOC.read_text()
    start = text.index("\n## Partitions and retention\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```sql\n(.*?)```", text[start:end], flags=re.S)


@pytest.mark.django_db
def test_the_docs_partition_queries_run_as_written():
    now = timezone.now()
    RequestLog.objects.bulk_create([request_row(now), request_row(now),
                                    request_row(dt.datetime(2019, 6, 1, tzinfo=UTC))])
    listing, week, default = doc_queries()
    first, second = months_from(now, 0), months_from(now, 1)
    rows = sql(listing)
    assert [r[0] for r in rows] == sorted(
        ["activity_requestlog_default"] + [name("activity_requestlog", months_from(now, n))
                                           for n in (0, 1, 2)])
    assert rows[0][1] == "DEFAULT"
    assert rows[1][1] == (f"FOR VALUES FROM ('{first:%Y-%m-%d} 00:00:00+00') "
                          f"TO ('{second:%Y-%m-%d} 00:00:00+00')")
    assert [(str(r[0]), r[1]) for r in sql(week)] == [(name("activity_requestlog", first), 2)]
    assert sql(default) == [(1,)]
