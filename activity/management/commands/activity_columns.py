"""`gpuproxy activity_columns [--write | --check]`: the activity tables' column docs.

Without options it prints the tables; `--write` puts them into `docs/activity.md`; `--check`
exits 1 when the file differs from `activity/columns.py` (the test suite checks it too).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from activity import column_docs
from activity.columns import TABLES


class Command(BaseCommand):
    help = "Render the activity tables' column docs (activity/columns.py) into docs/activity.md."

    def add_arguments(self, parser):
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--write", action="store_true",
                           help="rewrite docs/activity.md's generated column tables")
        group.add_argument("--check", action="store_true",
                           help="fail when docs/activity.md's tables are out of date")

    def handle(self, *args, **options):
        if not (options["write"] or options["check"]):
            for table in TABLES:
                self.stdout.write(f"{table.name}\n\n{column_docs.render(table)}\n")
            return
        current = column_docs.DOC.read_text()
        try:
            wanted = column_docs.rewrite(current)
        except LookupError as exc:
            raise CommandError(str(exc)) from exc
        if options["check"]:
            if wanted != current:
                raise CommandError(f"{column_docs.DOC} is out of date with activity/columns.py: "
                                   "run `gpuproxy activity_columns --write`")
            self.stdout.write("docs/activity.md's column tables are up to date")
            return
        if wanted != current:
            column_docs.DOC.write_text(wanted)
        self.stdout.write(f"wrote {column_docs.DOC}")
