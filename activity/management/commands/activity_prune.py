"""`gpuproxy activity_prune --older-than 30d [--batch 10000] [--dry-run]`.

Deletes request rows received (and model events that happened) before now - age.

On PostgreSQL, where migration 0009 partitioned both tables by month, every partition whose
rows are all older than the cutoff is dropped whole (`DROP TABLE`: no row is read, no dead row
left for VACUUM; the output gives PostgreSQL's row estimate, a dry run the exact count); rows
are deleted only in the partitions the cutoff falls inside: the month it falls in, the legacy
partition while it still holds younger rows, and DEFAULT.

Rows are deleted (there, and in a plain table: SQLite) in short transactions of at most
`--batch` rows each, by primary-key range: one indexed query (BRIN or btree on the time) finds
the id span of the old rows, then each batch deletes `id in [lo, lo + batch) AND time < cutoff`
through the primary key. No statement scans the whole table, and no transaction holds locks
for long.
"""

from __future__ import annotations

import datetime as dt

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connections, transaction
from django.db.models import Count, Max, Min
from django.utils import timezone

from activity import partitions
from activity.management.commands.activity_export import parse_age
from activity.models import ModelEvent, RequestLog

FORMAT_HELP = "an age like 30d (days), 12h (hours) or 90m (minutes)"
DROP_LOCK_TIMEOUT = "10s"

# (model, its time column, what its rows are called in the output)
TARGETS = ((RequestLog, "received_at", "rows"), (ModelEvent, "at", "model events"))


class Command(BaseCommand):
    help = ("Delete activity log rows and model events older than a given age: whole monthly "
            "partitions dropped on PostgreSQL, the rest in batches.")

    def add_arguments(self, parser):
        parser.add_argument("--older-than", required=True, help=FORMAT_HELP)
        parser.add_argument("--batch", type=int, default=10_000,
                            help="most rows deleted per statement (default 10000)")
        parser.add_argument("--dry-run", action="store_true",
                            help="say which partitions would be dropped and how many rows "
                                 "deleted; change nothing")

    def handle(self, *args, **options):
        age = parse_age(options["older_than"])
        if age is None or age.total_seconds() <= 0:
            raise CommandError(
                f"--older-than {options['older_than']!r} is not valid; use {FORMAT_HELP}")
        batch = options["batch"]
        if batch < 1:
            raise CommandError("--batch must be a positive number of rows")
        self.batch, self.dry_run = batch, options["dry_run"]
        self.using = "default"
        cutoff = timezone.now() - age
        for model, key, noun in TARGETS:
            table = model._meta.db_table
            parts = partitions.partitions(table, self.using)
            dropped: list[tuple[partitions.Partition, str]] = []
            if parts:
                deleted = 0
                for part in parts:
                    if part.covers_before(cutoff):
                        dropped.append((part, self._drop(part)))
                    elif part.lower is None or part.lower < cutoff:  # DEFAULT is lower None
                        deleted += self._delete(part.name, key, cutoff)
            else:
                deleted = self._delete_plain(model, key, cutoff)
            verb = "dry run: would delete" if self.dry_run else "deleted"
            self.stdout.write(f"{verb} {deleted} {noun} older than {cutoff.isoformat()}")
            for part, n in dropped:
                verb = "dry run: would drop" if self.dry_run else "dropped"
                held = n if n == "rows not counted" else f"{n} {noun}"
                self.stdout.write(f"{verb} partition {part.name} ({_span(part)}, {held})")

    def _drop(self, part: partitions.Partition) -> str:
        """Drop one partition whose rows are all older than the cutoff; how many rows it held:
        counted on a dry run, else PostgreSQL's estimate (a count would read the whole month
        the drop is there to avoid reading)."""
        with connections[self.using].cursor() as cursor:
            if self.dry_run:
                cursor.execute(f"SELECT count(*) FROM {part.name}")
                return str(cursor.fetchone()[0])
            try:
                with transaction.atomic(using=self.using):
                    cursor.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'")
                    cursor.execute(f"DROP TABLE {part.name}")
            except DatabaseError as exc:
                raise CommandError(
                    f"could not drop partition {part.name} ({exc}); a long query or "
                    f"transaction probably holds the table: run the command again when it "
                    f"has ended") from exc
        return "rows not counted" if part.estimate is None else f"about {part.estimate}"

    def _delete(self, table: str, key: str, cutoff: dt.datetime) -> int:
        """Delete one partition's rows older than the cutoff, in id-range batches."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(f"SELECT min(id), max(id), count(*) FROM {table} WHERE {key} < %s",
                           [cutoff])
            lo, hi, n = cursor.fetchone()
            if self.dry_run or not n:
                return int(n)
            deleted = 0
            while lo <= hi:
                cursor.execute(f"DELETE FROM {table} WHERE id >= %s AND id < %s AND {key} < %s",
                               [lo, lo + self.batch, cutoff])
                deleted += max(cursor.rowcount, 0)
                lo += self.batch
        return deleted

    def _delete_plain(self, model, key: str, cutoff: dt.datetime) -> int:
        old = model.objects.filter(**{f"{key}__lt": cutoff}).order_by()
        span = old.aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        if self.dry_run or not span["n"]:
            return int(span["n"])
        deleted = 0
        lo, hi = span["lo"], span["hi"]
        while lo <= hi:
            n, _ = old.filter(id__gte=lo, id__lt=lo + self.batch).delete()
            deleted += n
            lo += self.batch
        return deleted


def _span(part: partitions.Partition) -> str:
    lower = part.lower.isoformat() if part.lower else "MINVALUE"
    upper = part.upper.isoformat() if part.upper else "MAXVALUE"
    return f"{lower} to {upper}"
