"""PostgreSQL: `activity_requestlog` (by `received_at`) and `activity_modelevent` (by `at`)
become tables range-partitioned by month, so that retention drops whole partitions instead of
deleting millions of rows (docs/activity.md, "Partitions and retention"). SQLite keeps its
plain tables: nothing runs there.

Django cannot model a partitioned table's key (PostgreSQL requires the partition key in the
primary key: `(id, received_at)`), so Django's state keeps `id` as the primary key and this
migration changes only the database (`SeparateDatabaseAndState` with no state operations):
`makemigrations --check` stays clean, and the ORM reads and writes through the parent as before.

Both tables are locked first, in one statement (ACCESS EXCLUSIVE; the writers buffer
meanwhile), waiting at most 30 s behind a long query: past that the migration fails, having
changed nothing, with the remedy. Then, per table:

1. The existing table is renamed `<table>_legacy`, its indexes `<index>_legacy`; its identity
   is dropped (PostgreSQL 17 refuses to attach a table with its own identity) after its next
   value is read. Its primary key becomes `(id, key)`: the one index built here, the only
   step that reads the whole table.
2. The partitioned parent is created with the old name and columns (`LIKE`, comments and
   defaults included), an identity that continues after the old one, the same index names
   (so Django's state still matches), and the primary key `(id, key)`.
3. A DEFAULT partition (a row no monthly partition takes lands there, never refused), and
   the monthly partitions from B (below; this month when the table was empty) through two
   months ahead; `activity/partitions.py` keeps creating them ahead at run time.
4. A table with rows is attached as it is, no copy: a CHECK (key < B) is added NOT VALID then
   validated (a read, under the lock already held), so ATTACH PARTITION ... FROM (MINVALUE)
   TO (B) needs no scan of its own; B is the first day of next month. Rows dated B or later
   (a clock in the future) are moved to their month or DEFAULT first, so that one bad row
   cannot stretch the legacy partition over the months to come. An empty table is dropped
   instead: it would only be a partition to drop later.

The SQL stays here, not imported from the app, so that this migration does what it did when
it was written. The reverse copies the rows back into a plain table (slow on a big table,
but complete).
"""

from __future__ import annotations

import datetime as dt

from django.db import OperationalError, migrations

# table -> partition key; the primary key constraint and identity follow Django's names
TABLES = {"activity_requestlog": "received_at", "activity_modelevent": "at"}
MONTHS_AHEAD = 2  # beyond the current month, created here; the writer keeps it so
LOCK_TIMEOUT = "30s"


def _month_start(t: dt.datetime) -> dt.datetime:
    return dt.datetime(t.year, t.month, 1, tzinfo=dt.UTC)


def _next_month(t: dt.datetime) -> dt.datetime:
    return dt.datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=dt.UTC)


def _literal(t: dt.datetime) -> str:
    return f"'{t:%Y-%m-%d %H:%M:%S}+00'"


def _one(cursor, sql: str, params: list | None = None):
    cursor.execute(sql, params or [])
    return cursor.fetchone()


def _next_id(cursor, table: str) -> int:
    """The value the table's id sequence (identity) would hand out next, and past every id
    already in the table."""
    (seq,) = _one(cursor, "SELECT pg_get_serial_sequence(%s, 'id')", [table])
    last, called = _one(cursor, f"SELECT last_value, is_called FROM {seq}")
    (top,) = _one(cursor, f"SELECT max(id) FROM {table}")
    return max(last + 1 if called else last, (top or 0) + 1)


def _indexes(cursor, table: str) -> list[tuple[str, str]]:
    """(name, CREATE INDEX statement) of the table's indexes other than its constraints'."""
    cursor.execute(
        "SELECT i.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x "
        "JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid = %s::regclass AND NOT EXISTS "
        "(SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid) ORDER BY i.relname",
        [table])
    return list(cursor.fetchall())


def _partition(cursor, table: str, key: str, now: dt.datetime) -> None:
    """One table (locked by `forward`) becomes a partitioned one, its rows untouched."""
    legacy = f"{table}_legacy"
    next_id = _next_id(cursor, table)
    (has_rows,) = _one(cursor, f"SELECT EXISTS (SELECT 1 FROM {table})")
    indexes = _indexes(cursor, table)  # their statements name `table`: the parent, later

    # 1. the existing table steps aside
    cursor.execute(f"ALTER TABLE {table} RENAME TO {legacy}")
    for name, _ in indexes:
        cursor.execute(f"ALTER INDEX {name} RENAME TO {name[:56]}_legacy")
    cursor.execute(f"ALTER TABLE {legacy} ALTER COLUMN id DROP IDENTITY")
    cursor.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {table}_pkey")

    # 2. the partitioned parent, under the old name
    cursor.execute(
        f"CREATE TABLE {table} (LIKE {legacy} INCLUDING COMMENTS INCLUDING DEFAULTS "
        f"INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE ({key})")
    cursor.execute(f"ALTER TABLE {table} ALTER COLUMN id ADD GENERATED BY DEFAULT AS "
                   f"IDENTITY (START WITH {next_id})")
    cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id, {key})")
    for _, create in indexes:
        cursor.execute(create)

    # 3. DEFAULT, and the months from the legacy partition's bound (or this month) ahead
    bound = _next_month(now)  # the legacy partition holds what came before
    cursor.execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
    month = bound if has_rows else _month_start(now)
    last = _month_start(now)
    for _ in range(MONTHS_AHEAD):
        last = _next_month(last)
    while month <= last:
        cursor.execute(
            f"CREATE TABLE {table}_p{month:%Y_%m} PARTITION OF {table} "
            f"FOR VALUES FROM ({_literal(month)}) TO ({_literal(_next_month(month))})")
        month = _next_month(month)

    # 4. the rows stay where they are: the old table is the first partition. A row from a
    #    clock in the future (rare: moved, so that one bad row cannot stretch the legacy
    #    partition over the months to come) goes to its month or DEFAULT first.
    if not has_rows:
        cursor.execute(f"DROP TABLE {legacy}")
        return
    cursor.execute(
        f"WITH moved AS (DELETE FROM {legacy} WHERE {key} >= {_literal(bound)} RETURNING *) "
        f"INSERT INTO {table} SELECT * FROM moved")
    cursor.execute(f"ALTER TABLE {legacy} ADD CONSTRAINT {legacy}_pkey PRIMARY KEY (id, {key})")
    cursor.execute(f"ALTER TABLE {legacy} ADD CONSTRAINT {legacy}_bound "
                   f"CHECK ({key} < {_literal(bound)}) NOT VALID")
    cursor.execute(f"ALTER TABLE {legacy} VALIDATE CONSTRAINT {legacy}_bound")
    cursor.execute(f"ALTER TABLE {table} ATTACH PARTITION {legacy} "
                   f"FOR VALUES FROM (MINVALUE) TO ({_literal(bound)})")
    cursor.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT {legacy}_bound")


def _unpartition(cursor, table: str, key: str) -> None:
    """Back to one plain table: the rows copied, the identity continued, Django's indexes."""
    plain = f"{table}_plain"
    next_id = _next_id(cursor, table)
    indexes = [(name, create.replace(" ON ONLY ", " ON "))
               for name, create in _indexes(cursor, table)]
    cursor.execute(f"CREATE TABLE {plain} (LIKE {table} INCLUDING COMMENTS INCLUDING DEFAULTS "
                   f"INCLUDING STORAGE INCLUDING COMPRESSION)")
    cursor.execute(f"INSERT INTO {plain} SELECT * FROM {table}")
    cursor.execute(f"DROP TABLE {table}")  # its partitions and identity with it
    cursor.execute(f"ALTER TABLE {plain} RENAME TO {table}")
    cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id)")
    cursor.execute(f"ALTER TABLE {table} ALTER COLUMN id ADD GENERATED BY DEFAULT AS "
                   f"IDENTITY (START WITH {next_id})")
    for _, create in indexes:
        cursor.execute(create)


def _lock(cursor) -> None:
    """Both tables at once (one statement: no deadlock with a reader of both), waiting at
    most LOCK_TIMEOUT behind a long query, which would otherwise hold every writer and reader
    queued behind this migration for as long as it runs."""
    cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
    try:
        cursor.execute(f"LOCK TABLE {', '.join(TABLES)} IN ACCESS EXCLUSIVE MODE")
    except OperationalError as exc:
        raise RuntimeError(
            f"activity migration 0009 could not lock {' and '.join(TABLES)} within "
            f"{LOCK_TIMEOUT}: a long query or an idle transaction holds one of them (find it "
            f"in pg_stat_activity), so nothing was changed; run `gpuproxy migrate` again once "
            f"it has ended") from exc
    cursor.execute("SET LOCAL lock_timeout = 0")


def forward(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    now = dt.datetime.now(dt.UTC)
    with schema_editor.connection.cursor() as cursor:
        _lock(cursor)
        for table, key in TABLES.items():
            _partition(cursor, table, key, now)


def backward(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        _lock(cursor)
        for table, key in TABLES.items():
            _unpartition(cursor, table, key)


class Migration(migrations.Migration):

    dependencies = [
        ("activity", "0008_text_column_defaults"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
