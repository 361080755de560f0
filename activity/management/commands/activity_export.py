"""`gpuproxy activity_export --since 2026-11-01 [--until …] [--format csv|jsonl] [-o FILE]`.

Streams `RequestLog` rows in time order (a server-side cursor, `iterator(chunk_size=…)`), so a
window of millions of rows never sits in memory. `--since`/`--until` take an ISO date or datetime
(naive means UTC) or a relative age: `24h`, `7d`, `30m`.

The column helpers here are shared with the admin's "Export selected as CSV" action.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from activity.models import RequestLog

#: every column of the table, in table order (the analysts' contract).
COLUMNS: tuple[str, ...] = tuple(f.attname for f in RequestLog._meta.concrete_fields)

CHUNK_SIZE = 2000

RELATIVE = re.compile(r"^\s*(\d+)\s*([dhm])\s*$")
UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def parse_age(text: str) -> dt.timedelta | None:
    """`30d` / `12h` / `90m` as a timedelta; None when `text` is not of that form."""
    match = RELATIVE.match(text)
    if not match:
        return None
    return dt.timedelta(**{UNITS[match.group(2)]: int(match.group(1))})


def parse_instant(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO date/datetime (naive = UTC) or a relative age back from now."""
    age = parse_age(text)
    if age is not None:
        return (now or timezone.now()) - age
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CommandError(
            f"{text!r} is not a time; use an ISO date or datetime (2026-11-01, "
            "2026-11-01T12:00:00Z) or a relative age like 24h, 7d, 30m") from None
    if timezone.is_naive(value):
        value = value.replace(tzinfo=dt.UTC)
    return value


def json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(json_value(value))


def write_csv(rows: Iterable[tuple], out: TextIO) -> int:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    n = 0
    for row in rows:
        writer.writerow([csv_value(v) for v in row])
        n += 1
    return n


def write_jsonl(rows: Iterable[tuple], out: TextIO) -> int:
    n = 0
    for row in rows:
        record = {c: json_value(v) for c, v in zip(COLUMNS, row, strict=True)}
        out.write(json.dumps(record, separators=(",", ":")) + "\n")
        n += 1
    return n


class _Echo:
    """A file-like object whose write returns the line: lets csv.writer feed a stream."""

    def write(self, value: str) -> str:
        return value


def iter_csv(rows: Iterable[tuple]) -> Iterator[str]:
    """CSV text line by line (for a StreamingHttpResponse)."""
    writer = csv.writer(_Echo(), lineterminator="\n")
    yield writer.writerow(COLUMNS)
    for row in rows:
        yield writer.writerow([csv_value(v) for v in row])


class Command(BaseCommand):
    help = "Export activity log rows in time order as CSV or JSON lines."

    def add_arguments(self, parser):
        parser.add_argument("--since", required=True,
                            help="ISO date/datetime (naive = UTC) or a relative age: 24h, 7d")
        parser.add_argument("--until", help="exclusive upper bound, same forms as --since")
        parser.add_argument("--format", choices=("csv", "jsonl"), default="csv")
        parser.add_argument("-o", "--output", help="file to write (default: stdout)")
        parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)

    def handle(self, *args, **options):
        now = timezone.now()
        since = parse_instant(options["since"], now)
        qs = RequestLog.objects.filter(received_at__gte=since)
        if options["until"]:
            until = parse_instant(options["until"], now)
            if until <= since:
                raise CommandError("--until must be later than --since")
            qs = qs.filter(received_at__lt=until)
        rows = qs.order_by("received_at", "id").values_list(*COLUMNS).iterator(
            chunk_size=max(1, options["chunk_size"]))
        write = write_csv if options["format"] == "csv" else write_jsonl
        if options["output"]:
            with open(options["output"], "w", newline="", encoding="utf-8") as out:
                n = write(rows, out)
        else:
            n = write(rows, self.stdout)
        # the summary goes to stderr, so stdout stays pure data
        self.stderr.write(f"exported {n} rows since {since.isoformat()}")
