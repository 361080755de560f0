"""`gpuproxy whatif [--since 24h | --from … --to …] [--model M] [--aging-divisor X]
[--swap-affinity-bonus Y] [--affinity-budget auto|SECONDS|off] [--scheduler serial|fifo]
[--swap-cost auto|SECONDS] [--json]`.

Replays the activity log's requests of a window through the real scheduling core, under the
settings in force and under the ones given, and prints per band p50/p95/max wait, swaps and
makespan side by side, then how well the replay under today's settings matches what actually
happened. docs/scheduling.md ("What if") says what it can and cannot know.
"""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from activity import whatif
from activity.management.commands.activity_export import parse_instant
from scheduling.whatif import WhatIfError, render


class Command(BaseCommand):
    help = ("What would the log's own traffic have waited under other scheduler settings? "
            "Replays a window of the activity log through the scheduling core.")

    def add_arguments(self, parser):
        window = parser.add_mutually_exclusive_group()
        window.add_argument("--since", default=None,
                            help="the window: the last 24h (default), 7d, 90m, or an ISO time")
        window.add_argument("--from", dest="start", default=None,
                            help="the window's start (ISO date or datetime, naive = UTC); "
                                 "with --to")
        parser.add_argument("--to", dest="end", default=None,
                            help="the window's end (default: now)")
        parser.add_argument("--model", action="append", default=[],
                            help="count only this model's requests in the figures (repeatable;"
                                 " every request is still replayed, since all share the box)")
        parser.add_argument("--scheduler", choices=("serial", "fifo"),
                            help="the scheduler to replay under (default: today's)")
        parser.add_argument("--aging-divisor", type=float,
                            help="serial: seconds of waiting per point of score (default: "
                                 "today's)")
        parser.add_argument("--swap-affinity-bonus", type=float,
                            help="serial: the loaded model's bonus, 0..99 (default: today's)")
        parser.add_argument("--affinity-budget",
                            help="serial: how long affinity may hold a request back: auto, "
                                 "seconds, or off (default: today's)")
        parser.add_argument("--swap-cost", default="auto",
                            help="seconds per swap for every model, or auto (default): each "
                                 "model's measured from the window's own loads")
        parser.add_argument("--json", action="store_true",
                            help="print the report as JSON (the settings page's form)")

    def handle(self, *args, **options):
        now = timezone.now()
        if options["end"] and not options["start"]:
            raise CommandError("--to goes with --from (or give --since alone)")
        if options["start"]:
            start = parse_instant(options["start"], now)
            end = parse_instant(options["end"], now) if options["end"] else now
        else:
            start, end = parse_instant(options["since"] or "24h", now), now
        cost = options["swap_cost"].strip().lower()
        if cost == "auto":
            swap_cost = None
        else:
            try:
                swap_cost = float(cost.removesuffix("s"))
            except ValueError:
                raise CommandError(f"--swap-cost {options['swap_cost']!r}: give auto or a "
                                   "number of seconds, e.g. 12.5") from None
        try:
            report = whatif.report(
                start, end, scheduler=options["scheduler"],
                aging_divisor=options["aging_divisor"],
                swap_affinity_bonus=options["swap_affinity_bonus"],
                affinity_budget=options["affinity_budget"], swap_cost=swap_cost,
                models=options["model"])
        except WhatIfError as exc:
            hint = "; try a longer window (--since 7d)" if "no request to" in str(exc) else ""
            raise CommandError(str(exc) + hint) from None
        if options["json"]:
            self.stdout.write(json.dumps(report.as_dict(), indent=2, ensure_ascii=False))
        else:
            self.stdout.write(render(report))
