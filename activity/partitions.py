"""The monthly partitions of the activity tables on PostgreSQL (migration 0009): what exists,
and the months ahead created before a row needs them (docs/activity.md, "Partitions and
retention"). On SQLite, and on a PostgreSQL table that is not partitioned, every function here
is a no-op: the writer and the commands call them without asking.

Partitions are created ahead (the writer at its start and about once a day, the
`activity_partitions --ahead N` command) rather than when a row arrives, so that no insert
ever waits on DDL; a row no partition takes lands in the DEFAULT partition, and creating its
month later moves it out, since PostgreSQL refuses a partition whose rows DEFAULT still holds.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass

from django.db import connections, transaction

logger = logging.getLogger("activity.partitions")

# table -> partition key (migration 0009)
TABLES: dict[str, str] = {"activity_requestlog": "received_at", "activity_modelevent": "at"}
DEFAULT_AHEAD = 2  # months beyond the current one
ENSURE_EVERY = 24 * 3600.0  # seconds between the writer's checks
RETRY_AFTER = 600.0  # after a failed check
LOCK_TIMEOUT = "5s"  # DDL gives up rather than queue every insert behind a long query

_LIST_SQL = """
SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' AS is_default,
       CASE WHEN b[1] = 'MINVALUE' THEN NULL ELSE trim(both '''' from b[1])::timestamptz END,
       CASE WHEN b[2] = 'MAXVALUE' THEN NULL ELSE trim(both '''' from b[2])::timestamptz END,
       c.reltuples::bigint
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
LEFT JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                               'FROM \\((.+)\\) TO \\((.+)\\)') AS b ON true
WHERE i.inhparent = %s::regclass
"""


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    lower: dt.datetime | None  # None: MINVALUE (the legacy partition), or DEFAULT
    upper: dt.datetime | None
    estimate: int | None  # PostgreSQL's row estimate; None before the first ANALYZE

    def covers_before(self, cutoff: dt.datetime) -> bool:
        """Every row it can hold is older than `cutoff`: it can be dropped whole."""
        return not self.default and self.upper is not None and self.upper <= cutoff

    def overlaps(self, lo: dt.datetime, hi: dt.datetime) -> bool:
        if self.default:
            return False
        return (self.lower is None or self.lower < hi) and (self.upper is None or lo < self.upper)


def month_start(t: dt.datetime) -> dt.datetime:
    t = t.astimezone(dt.UTC)
    return dt.datetime(t.year, t.month, 1, tzinfo=dt.UTC)


def next_month(t: dt.datetime) -> dt.datetime:
    return dt.datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=dt.UTC)


def partition_name(table: str, month: dt.datetime) -> str:
    return f"{table}_p{month:%Y_%m}"


def _postgresql(using: str) -> bool:
    return connections[using].vendor == "postgresql"


def is_partitioned(table: str, using: str = "default") -> bool:
    if not _postgresql(using):
        return False
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_partitioned_table "
                       "WHERE partrelid = to_regclass(%s))", [table])
        return bool(cursor.fetchone()[0])


def partitions(table: str, using: str = "default") -> list[Partition]:
    """The table's partitions, oldest first (the legacy one, the months), DEFAULT last; []
    when the table is not partitioned (or not on PostgreSQL)."""
    if not _postgresql(using):
        return []
    with connections[using].cursor() as cursor:
        cursor.execute(_LIST_SQL, [table])
        rows = cursor.fetchall()
    found = [Partition(name, bool(default), lower, upper, est if est >= 0 else None)
             for name, default, lower, upper, est in rows]
    far = dt.datetime.max.replace(tzinfo=dt.UTC)
    return sorted(found, key=lambda p: (p.default, p.lower is not None, p.lower or far))


def estimate_rows(table: str, using: str = "default") -> int | None:
    """PostgreSQL's row estimate for the table (no COUNT(*) on millions of rows): the sum over
    its partitions, since autovacuum analyzes the partitions but never a partitioned parent,
    whose own estimate stays unknown; a plain table's own. None on SQLite, or before anything
    was analyzed."""
    if not _postgresql(using):
        return None
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT sum(c.reltuples) FILTER (WHERE c.reltuples >= 0)::bigint "
                       "FROM pg_class c WHERE c.relkind = 'r' AND (c.oid = %s::regclass OR "
                       "c.oid IN (SELECT relid FROM pg_partition_tree(%s::regclass)))",
                       [table, table])
        row = cursor.fetchone()
    return int(row[0]) if row and row[0] is not None else None


def create_month(table: str, month: dt.datetime, using: str = "default") -> int | None:
    """Create `table`'s partition for the month starting at `month`; return how many rows it
    took over from the DEFAULT partition (moved in the same transaction: PostgreSQL refuses
    to attach a partition whose rows DEFAULT holds), or None when another process created it
    first (each request process's writer checks at its start). The new table is filled, then
    attached, which locks the parent only SHARE UPDATE EXCLUSIVE: inserts go on meanwhile,
    except into DEFAULT."""
    key = TABLES[table]
    lo, hi = month_start(month), next_month(month_start(month))
    name = partition_name(table, lo)
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute(f"LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE")
        cursor.execute(f"LOCK TABLE {table}_default IN ACCESS EXCLUSIVE MODE")
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        if cursor.fetchone()[0]:  # made while this one waited for the locks
            return None
        cursor.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS "
                       f"INCLUDING STORAGE INCLUDING COMPRESSION)")
        # by name, not position: the two tables' column orders could differ after later DDL
        cursor.execute("SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) "
                       "FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                       "AND NOT attisdropped", [table])
        (columns,) = cursor.fetchone()
        cursor.execute(
            f"WITH moved AS (DELETE FROM {table}_default WHERE {key} >= %s AND {key} < %s "
            f"RETURNING {columns}) INSERT INTO {name} ({columns}) SELECT {columns} FROM moved",
            [lo, hi])
        moved = max(cursor.rowcount, 0)
        cursor.execute(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM (%s) "
                       f"TO (%s)", [lo, hi])
    if moved:
        logger.info("activity: created partition %s and moved into it the %d rows the "
                    "DEFAULT partition held for that month", name, moved)
    return moved


def ensure_ahead(months: int = DEFAULT_AHEAD, *, now: dt.datetime | None = None,
                 using: str = "default", tables: tuple[str, ...] = tuple(TABLES)) -> list[str]:
    """Create the monthly partitions from `now`'s month through `months` months after it,
    where no partition (a month, or the legacy one) covers them yet; return the new names."""
    created: list[str] = []
    start = month_start(now or dt.datetime.now(dt.UTC))
    for table in tables:
        existing = partitions(table, using)
        if not existing:
            continue
        month = start
        for _ in range(months + 1):
            following = next_month(month)
            if (not any(p.overlaps(month, following) for p in existing)
                    and create_month(table, month, using) is not None):
                created.append(partition_name(table, month))
            month = following
    return created


_due: dict[tuple[str, str], float] = {}
_due_lock = threading.Lock()


def keep_ahead(model_name: str, using: str = "default", *, close: bool = False) -> None:
    """The writer's call, on its own thread: ensure the months ahead for its model's table
    when due (at its start, then about once a day). Never raises: a failure is logged with
    what to do and retried later, and the writer's batch goes on."""
    if not _postgresql(using):
        return
    from django.apps import apps

    table = apps.get_model("activity", model_name)._meta.db_table
    with _due_lock:
        if time.monotonic() < _due.get((using, table), 0.0):
            return
        _due[(using, table)] = time.monotonic() + ENSURE_EVERY
    try:
        ensure_ahead(using=using, tables=(table,))
    except Exception as exc:  # the writer goes on, whatever this is
        with _due_lock:
            _due[(using, table)] = time.monotonic() + RETRY_AFTER
        first = (str(exc).strip().splitlines() or [""])[0]
        logger.warning(
            "activity: could not create the coming months' partitions of %s (%s: %s); rows "
            "land in %s_default meanwhile. Retrying in %d minutes; or run `gpuproxy "
            "activity_partitions --ahead %d` once the database is reachable and no long "
            "query holds the table", table, type(exc).__name__, first, table,
            RETRY_AFTER // 60, DEFAULT_AHEAD)
    finally:
        if close:
            connections[using].close()
