"""`gpuproxy activity_prune --older-than 30d [--batch 10000] [--dry-run]`.

Deletes activity rows received before now - age, in short transactions of at most `--batch`
rows each, by primary-key range: one indexed query (BRIN on received_at) finds the id span of the
old rows, then each batch deletes `id in [lo, lo + batch) AND received_at < cutoff` through the
primary key. No statement scans the whole table, and no transaction holds locks for long.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Count, Max, Min
from django.utils import timezone

from activity.management.commands.activity_export import parse_age
from activity.models import RequestLog

FORMAT_HELP = "an age like 30d (days), 12h (hours) or 90m (minutes)"


class Command(BaseCommand):
    help = "Delete activity log rows older than a given age, in batches."

    def add_arguments(self, parser):
        parser.add_argument("--older-than", required=True, help=FORMAT_HELP)
        parser.add_argument("--batch", type=int, default=10_000,
                            help="most rows deleted per statement (default 10000)")
        parser.add_argument("--dry-run", action="store_true",
                            help="count what would be deleted, delete nothing")

    def handle(self, *args, **options):
        age = parse_age(options["older_than"])
        if age is None or age.total_seconds() <= 0:
            raise CommandError(
                f"--older-than {options['older_than']!r} is not valid; use {FORMAT_HELP}")
        batch = options["batch"]
        if batch < 1:
            raise CommandError("--batch must be a positive number of rows")
        cutoff = timezone.now() - age
        old = RequestLog.objects.filter(received_at__lt=cutoff).order_by()
        span = old.aggregate(lo=Min("id"), hi=Max("id"), n=Count("id"))
        if options["dry_run"]:
            self.stdout.write(f"dry run: would delete {span['n']} rows older than "
                              f"{cutoff.isoformat()}")
            return
        deleted = 0
        if span["n"]:
            lo, hi = span["lo"], span["hi"]
            while lo <= hi:
                n, _ = old.filter(id__gte=lo, id__lt=lo + batch).delete()
                deleted += n
                lo += batch
        self.stdout.write(f"deleted {deleted} rows older than {cutoff.isoformat()}")
