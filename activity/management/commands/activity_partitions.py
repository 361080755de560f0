"""`gpuproxy activity_partitions [--ahead N]`: the activity tables' monthly partitions.

Without options, lists each partition of `activity_requestlog` and `activity_modelevent` with
its bounds and PostgreSQL's row estimate. `--ahead N` creates the partitions from the current
month through N months ahead (the writer keeps 2 months ahead by itself; this is for a longer
horizon, or after the writer could not).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from activity import partitions


class Command(BaseCommand):
    help = "List the activity tables' monthly partitions, or create them ahead (--ahead N)."

    def add_arguments(self, parser):
        parser.add_argument("--ahead", type=int, metavar="N",
                            help="create the partitions of the current month and the N "
                                 "months after it, where missing")

    def handle(self, *args, **options):
        tables = list(partitions.TABLES)
        if not any(partitions.is_partitioned(t) for t in tables):
            raise CommandError("the activity tables are not partitioned: partitions exist on "
                               "PostgreSQL only, after `gpuproxy migrate` (migration 0009)")
        ahead = options["ahead"]
        if ahead is not None:
            if ahead < 0:
                raise CommandError("--ahead must be 0 or a positive number of months")
            try:
                created = partitions.ensure_ahead(ahead)
            except DatabaseError as exc:
                raise CommandError(f"could not create the partitions ({exc}); a long query "
                                   f"may hold the table: run the command again") from exc
            for name in created:
                self.stdout.write(f"created {name}")
            if not created:
                self.stdout.write(f"nothing to create: every month through {ahead} ahead "
                                  f"has its partition")
            return
        for table in tables:
            self.stdout.write(f"{table} (partitioned by {partitions.TABLES[table]})")
            for part in partitions.partitions(table):
                if part.default:
                    bounds = "DEFAULT"
                else:
                    lower = part.lower.isoformat() if part.lower else "MINVALUE"
                    upper = part.upper.isoformat() if part.upper else "MAXVALUE"
                    bounds = f"{lower} to {upper}"
                rows = ("not analyzed yet" if part.estimate is None
                        else f"about {part.estimate} rows")
                self.stdout.write(f"  {part.name}  {bounds}  {rows}")
