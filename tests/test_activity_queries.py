"""The analysts' example queries of `docs/activity.md`'s *Model events* run, as written, against
the suite's PostgreSQL, on events whose answers are worked out here by hand."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest
from django.db import connection

from activity import events
from activity.models import ModelEvent

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

DOC = Path(__file__).resolve().parent.parent / "docs" / "activity.md"


def section_queries(title: str) -> list[str]:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```sql\n(.*?)```", text[start:end], flags=re.S)


def run(sql: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchall()


def test_the_model_events_queries_answer_what_they_say() -> None:
    now = dt.datetime.now(dt.UTC)
    hour = now.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=2)
    day = hour.replace(hour=0)

    def at(minutes: float) -> dt.datetime:
        return hour + dt.timedelta(minutes=minutes)

    rows = [
        ("a", events.LOAD, events.REQUEST, at(1), None, ""),
        ("a", events.READY, events.REQUEST, at(1), 1000.0, ""),
        ("b", events.LOAD, events.REQUEST, at(5), None, ""),
        ("a", events.UNLOAD, events.SWAP, at(5), 40.0, "code 0; for b"),
        ("b", events.READY, events.REQUEST, at(5), 2000.0, ""),
        ("a", events.LOAD, events.REQUEST, at(10), None, ""),
        ("a", events.READY, events.REQUEST, at(10), 3000.0, ""),
        ("a", events.CRASH, events.CRASHED, at(20), 600000.0, "signal SIGKILL"),
        ("a", events.LOAD, events.ADMIN, at(30), None, "restart"),
        ("a", events.START_FAILED, events.ADMIN, at(30), 500.0, "exited, code 1"),
        # out of every window: three days and ten days ago
        ("a", events.LOAD, events.REQUEST, now - dt.timedelta(days=3), None, ""),
        ("a", events.UNLOAD, events.SWAP, now - dt.timedelta(days=3), 40.0, "code 0; for b"),
        ("a", events.READY, events.REQUEST, now - dt.timedelta(days=10), 99999.0, ""),
    ]
    ModelEvent.objects.bulk_create(
        ModelEvent(model=m, kind=k, reason=r, at=t, duration_ms=d, detail=x, pid=4242)
        for m, k, r, t, d, x in rows)

    loads, p95, crashes, evictions = section_queries("Model events")

    assert run(loads) == [(hour, "a", 3, 2), (hour, "b", 1, 1)]
    # a's ready times 1000 and 3000 ms: p95 by linear interpolation is 1000 + 0.95 * 2000
    assert run(p95) == [("a", 2, pytest.approx(2900.0)), ("b", 1, 2000.0)]
    assert run(crashes) == [(day, "a", 1, 1)]
    assert run(evictions) == [("a", "b", 1)]
