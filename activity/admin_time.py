"""Times and durations in the activity admin as a person reads them, and a newest-first page
by arrival time that stays cheap on a big table.

Django's default date format stops at the minute, and the columns hold milliseconds as floats
(`162270.823`): both read badly when the question is "what was slow, and when". The list shows
seconds and a human duration ("2 min 42 s"); a row's page adds milliseconds to the times and
the exact value to the durations, for the analyst comparing it with SQL.

`TimeBoundedPaginator`: the list is ordered by `received_at`, the time the proxy got the
request, which is what an operator means by "newest". Rows are written when the request ends,
so `id` order is finish order and a long request's row lands among later arrivals: ordered by
id, the times look shuffled. `received_at` has only a BRIN index (an ordered scan needs a
btree), so `ORDER BY received_at DESC LIMIT 100` alone sorts the whole table (every partition).
The paginator first takes the page's last row count of newest rows by id (the primary key's
index, as fast as the old ordering) and the oldest `received_at` among them, T: at least that
many rows arrived at T or later, so every row of the page did, and `received_at >= T`, which
the BRIN index narrows to the table's last blocks, selects exactly the same page.
docs/activity.md (Admin and commands) has the EXPLAIN figures.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.core.paginator import Page, Paginator
from django.db.models import Min, QuerySet
from django.utils import timezone

MS_PER_S = 1000.0


def human_ms(ms: float | None) -> str | None:
    """840 ms, 4.2 s, 42.7 s, 2 min 42 s, 1 h 5 min: the units a person reads without
    counting digits; None stays None (the admin's dash)."""
    if ms is None:
        return None
    # each threshold on the rounded value, so that 59.97 s reads "1 min 0 s", not "60.0 s"
    if round(ms, 1) < 10:
        return f"{ms:.1f} ms"
    if round(ms) < MS_PER_S:
        return f"{ms:.0f} ms"
    s = ms / MS_PER_S
    if round(s, 1) < 60:
        return f"{s:.1f} s"
    whole = round(s)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    minutes = round(s / 60)
    return f"{minutes // 60} h {minutes % 60} min"


def exact_ms(ms: float | None) -> str | None:
    """The human duration with the stored value beside it: "2 min 42 s (162,270.823 ms)"."""
    if ms is None:
        return None
    shown = human_ms(ms)
    exact = f"{ms:,.3f}".rstrip("0").rstrip(".")
    return f"{shown} ({exact} ms)"


def at_seconds(value: dt.datetime | None) -> str | None:
    """2026-12-05 02:57:44 in the server's time zone (the admin's own dates stop at the
    minute, where two requests a second apart look alike)."""
    if value is None:
        return None
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def at_millis(value: dt.datetime | None) -> str | None:
    """2026-12-05 02:57:44.123: a row's page, where received, dispatched and first byte can
    be milliseconds apart."""
    if value is None:
        return None
    local = timezone.localtime(value)
    return local.strftime("%Y-%m-%d %H:%M:%S.") + f"{local.microsecond // 1000:03d}"


def shown(field: str, description: str, render: Callable[[Any], str | None]
          ) -> Callable[[Any, Any], str | None]:
    """An admin column (or read-only field) that renders `field` with `render`."""

    @admin.display(description=description)
    def column(self: Any, obj: Any) -> str | None:
        return render(getattr(obj, field))

    column.__name__ = f"{field}_shown"
    return column


class TimeBoundedPaginator(Paginator):
    """Pages ordered by `time_field` descending, bounded below first (the module docstring):
    the same rows as the plain ordering, without sorting the table."""

    time_field = "received_at"

    def page(self, number: Any):  # Django's signature
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = bottom + self.per_page
        qs = self.object_list
        if isinstance(qs, QuerySet):
            qs = self.bounded(qs, top)
        return Page(qs[bottom:top], number, self)

    def bounded(self, qs: QuerySet, rows: int) -> QuerySet:
        # SELECT min(t) FROM (SELECT t … ORDER BY id DESC LIMIT rows): the pk's index
        oldest = qs.order_by("-pk")[:rows].aggregate(t=Min(self.time_field))["t"]
        if oldest is None:
            return qs
        return qs.filter(**{f"{self.time_field}__gte": oldest})
