"""Every analyst's SQL example in the docs runs, as written, on the suite's PostgreSQL, and the
ones no other test checks give the answers worked out here by hand.

The examples are the activity log's contract with the people who query it; a renamed column or
a typo in one would otherwise be found by an analyst. Blocks are found wherever they are
(every ```sql block of `docs/*.md` and the README), so a new example is checked the day it is
written. `tests/test_token_queries.py` and `tests/test_activity_queries.py` check the answers of
the token, client and model-events examples; the queue, load and rejection ones are here.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, transaction

from activity import events, outcomes
from activity.models import ModelEvent, RequestLog

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
ACTIVITY_DOC = ROOT / "docs" / "activity.md"
FENCE = re.compile(r"^```sql\n(.*?)^```", flags=re.S | re.M)
#: PostgreSQL's SQLSTATE for "cannot execute … in a read-only transaction"
READ_ONLY_SQL_TRANSACTION = "25006"


def label(text: str, at: int) -> str:
    """The first words of the paragraph before a block: what the prose calls the query."""
    paragraph: list[str] = []
    for line in reversed(text[:at].splitlines()):
        if not line.strip():
            if paragraph:
                break
            continue
        if line.startswith("```"):
            break
        paragraph.insert(0, line)
    words = re.sub(r"[`*]", "", paragraph[0] if paragraph else "").split()
    return " ".join(words[:7]) or "(no prose)"


def sql_blocks(paths: list[Path]) -> list[tuple[str, str]]:
    """(id, sql) of every ```sql block of the files, in their order."""
    found = []
    for path in paths:
        text = path.read_text()
        for match in FENCE.finditer(text):
            found.append((f"{path.name}: {label(text, match.start())}", match.group(1)))
    return found


BLOCKS = sql_blocks(DOCS)


def run_read_only(sql: str) -> list[tuple] | None:
    """Run `sql` as written in a read-only savepoint, rolled back after: a block that writes
    fails with SQLSTATE 25006 instead of changing the table the other blocks read."""
    with connection.cursor() as cursor:
        sid = transaction.savepoint()
        try:
            cursor.execute("SET LOCAL transaction_read_only = on")
            cursor.execute(sql)
            if cursor.description is None:
                return None
            return [tuple(float(v) if hasattr(v, "as_tuple") else v for v in row)
                    for row in cursor.fetchall()]
        finally:
            transaction.savepoint_rollback(sid)


def query(marker: str) -> str:
    """The one example of `docs/activity.md` that contains `marker`."""
    (sql,) = [q for _, q in sql_blocks([ACTIVITY_DOC]) if marker in q]
    return sql


NOW = dt.datetime.now(dt.UTC)
# two whole hours that have ended, within every "last day" window
H1 = NOW.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=2)
H2 = H1 + dt.timedelta(hours=1)
THREE_DAYS_AGO = NOW - dt.timedelta(days=3)  # in the 7-day window only
TEN_DAYS_AGO = NOW - dt.timedelta(days=10)  # in no window


def rid(name: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_URL, name)


# name, band, received_at, outcome, queue_wait_ms, swap_ms
ROWS = [
    ("i1", "interactive", H1 + dt.timedelta(minutes=5), outcomes.OK, 10.0, None),
    ("i2", "interactive", H1 + dt.timedelta(minutes=10), outcomes.OK, 30.0, None),
    ("i3", "interactive", H2 + dt.timedelta(minutes=5), outcomes.OK, 50.0, 40.0),
    ("i4", "interactive", H2 + dt.timedelta(minutes=10), outcomes.REJECTED_CAPACITY, None, None),
    ("i5", "interactive", TEN_DAYS_AGO, outcomes.OK, 1000.0, None),
    ("n1", "normal", H1 + dt.timedelta(minutes=15), outcomes.OK, 100.0, 80.0),
    # swap_ms 0: no load waited for, not "delayed by a load"
    ("n2", "normal", H1 + dt.timedelta(minutes=20), outcomes.OK, 200.0, 0.0),
    ("n3", "normal", H1 + dt.timedelta(minutes=25), outcomes.OK, 400.0, 300.0),
    ("n4", "normal", H1 + dt.timedelta(minutes=30), outcomes.REJECTED_QUEUE, None, None),
    # the client left after 7 ms in the queue
    ("n5", "normal", H2 + dt.timedelta(minutes=15), outcomes.CANCELLED_QUEUED, 7.0, None),
    ("b1", "batch", THREE_DAYS_AGO, outcomes.OK, 9000.0, 2500.0),
    ("b2", "batch", H1 + dt.timedelta(minutes=35), outcomes.OK, 8000.0, None),
    ("b3", "batch", H1 + dt.timedelta(minutes=40), outcomes.OK, 7000.0, None),
    ("b4", "batch", H1 + dt.timedelta(minutes=45), outcomes.OK, 6000.0, 1500.0),
    ("b5", "batch", H2 + dt.timedelta(minutes=20), outcomes.OK, 5000.0, None),
    ("b6", "batch", H2 + dt.timedelta(minutes=21), outcomes.OK, 4000.0, None),
    ("b7", "batch", H2 + dt.timedelta(minutes=22), outcomes.OK, 3000.0, None),
    ("b8", "batch", H2 + dt.timedelta(minutes=23), outcomes.OK, 2000.0, None),
    ("b9", "batch", H2 + dt.timedelta(minutes=24), outcomes.OK, 1000.0, None),
    ("b10", "batch", H2 + dt.timedelta(minutes=25), outcomes.OK, 500.0, None),
    ("b11", "batch", H2 + dt.timedelta(minutes=26), outcomes.OK, 250.0, None),
    ("b12", "batch", H2 + dt.timedelta(minutes=50), outcomes.REJECTED_QUEUE, None, None),
    ("b13", "batch", TEN_DAYS_AGO, outcomes.OK, 99999.0, None),
]


@pytest.fixture
def rows() -> None:
    RequestLog.objects.bulk_create(
        RequestLog(request_id=rid(name), received_at=at, band=band, outcome=outcome,
                   queue_wait_ms=wait, swap_ms=swap, model=f"m-{band}",
                   model_requested=f"m-{band}", priority={"batch": -100}.get(band, 0),
                   client=f"key-{band}", client_ip="203.0.113.9", end_user="u",
                   endpoint="chat", path="/v1/chat/completions", input_tokens=10,
                   cached_tokens=4, output_tokens=3, draft_tokens=2, draft_accepted_tokens=1)
        for name, band, at, outcome, wait, swap in ROWS)
    ModelEvent.objects.bulk_create([
        ModelEvent(model="m-batch", kind=events.LOAD, reason=events.REQUEST, at=H1, pid=7),
        ModelEvent(model="m-batch", kind=events.READY, reason=events.REQUEST, at=H1, pid=7,
                   duration_ms=1200.0),
        ModelEvent(model="m-normal", kind=events.UNLOAD, reason=events.SWAP, at=H1, pid=6,
                   duration_ms=30.0, detail="code 0; for m-batch"),
        ModelEvent(model="m-batch", kind=events.CRASH, reason=events.CRASHED, at=H2, pid=7,
                   duration_ms=60000.0, detail="signal SIGKILL"),
    ])


def test_the_docs_have_the_examples_this_file_checks() -> None:
    # the five answered below, four token/client and four model-event ones, and the README's
    assert len(sql_blocks([ACTIVITY_DOC])) >= 13
    assert len(BLOCKS) >= 14


@pytest.mark.parametrize("sql", [sql for _, sql in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_every_sql_example_runs_as_written(rows, sql: str) -> None:
    try:
        result = run_read_only(sql)
    except DatabaseError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == READ_ONLY_SQL_TRANSACTION:
            pytest.skip(f"the block writes (not run here): {exc}")
        raise
    assert result is None or isinstance(result, list)


@pytest.mark.parametrize("broken", [
    "SELECT band, no_such_column FROM activity_requestlog",
    "SELECT band FROM activity_requestlog GROUP BY",
])
def test_a_block_with_a_missing_column_or_a_syntax_error_fails(rows, broken: str) -> None:
    # what the test above does with a block: here, with two that must not pass
    with pytest.raises(DatabaseError):
        run_read_only(broken)


def test_a_block_that_writes_is_refused_not_run(rows) -> None:
    with pytest.raises(DatabaseError) as raised:
        run_read_only("DELETE FROM activity_requestlog")
    assert getattr(raised.value.__cause__, "sqlstate", None) == READ_ONLY_SQL_TRANSACTION
    assert RequestLog.objects.count() == len(ROWS)


def test_queue_wait_p95_per_band(rows) -> None:
    got = sorted(run_read_only(query("FROM activity_requestlog GROUP BY band;")) or [])
    # percentile_cont(0.95) over n non-NULL waits, sorted: position p = 0.95 * (n - 1),
    # value = w[floor p] + (p - floor p) * (w[floor p + 1] - w[floor p]); no window: old rows
    # count too.
    # batch: 250 500 1000 2000 3000 4000 5000 6000 7000 8000 9000 99999, n = 12, p = 10.45:
    #   9000 + 0.45 * (99999 - 9000) = 9000 + 40949.55 = 49949.55
    # interactive: 10 30 50 1000, p = 2.85: 50 + 0.85 * 950 = 857.5
    # normal: 7 100 200 400, p = 2.85: 200 + 0.85 * 200 = 370
    assert got == [("batch", pytest.approx(49949.55)), ("interactive", pytest.approx(857.5)),
                   ("normal", pytest.approx(370.0))]


def test_queue_wait_p95_per_band_per_hour(rows) -> None:
    got = run_read_only(query("AS p95_wait_ms"))
    # count(*) counts the rejected rows (NULL wait), the percentile does not; 3 and 10 days
    # ago are out of the day.
    # H1 batch b2 b3 b4: 6000 7000 8000, p = 1.9: 7000 + 0.9 * 1000 = 7900
    # H1 interactive i1 i2: 10 30, p = 0.95: 10 + 0.95 * 20 = 29
    # H1 normal n1..n4 (n4 rejected): 100 200 400, p = 1.9: 200 + 0.9 * 200 = 380
    # H2 batch b5..b11 and b12 (rejected): 250 500 1000 2000 3000 4000 5000, p = 5.7:
    #   4000 + 0.7 * 1000 = 4700
    # H2 interactive i3, i4 (rejected): 50 alone; H2 normal n5: 7 alone
    assert got == [
        (H1, "batch", 3, pytest.approx(7900.0)),
        (H1, "interactive", 2, pytest.approx(29.0)),
        (H1, "normal", 4, pytest.approx(380.0)),
        (H2, "batch", 8, pytest.approx(4700.0)),
        (H2, "interactive", 2, 50.0),
        (H2, "normal", 1, 7.0),
    ]


def test_requests_delayed_by_a_model_load(rows) -> None:
    got = run_read_only(query("requests_that_waited_for_a_load"))
    # swap_ms > 0 within the day: H1 n1 80, n3 300, b4 1500 (n2's 0 is no load) -> 3 rows,
    # avg 1880 / 3 = 626.67 -> 627; H2 i3 40 -> 1 row, 40. b1's 2500 is 3 days old.
    assert got == [(H1, 3, 627.0), (H2, 1, 40.0)]


def test_longest_batch_band_waits(rows) -> None:
    got = run_read_only(query("WHERE band = 'batch' AND queue_wait_ms IS NOT NULL"))
    assert got is not None
    by_id = {rid(name): name for name, *_ in ROWS}
    # the 7 days hold b1..b11 with a wait (b12 was rejected, b13 is 10 days old): the ten
    # longest, b1 (9000) down to b10 (500); b11's 250 is the eleventh
    assert [by_id[r[1]] for r in got] == ["b1", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "b9",
                                          "b10"]
    assert got[0] == (THREE_DAYS_AGO, rid("b1"), "m-batch", -100, 9000.0, 2500.0, "ok",
                      "key-batch")
    assert [r[4:6] for r in got] == [
        (9000.0, 2500.0), (8000.0, None), (7000.0, None), (6000.0, 1500.0), (5000.0, None),
        (4000.0, None), (3000.0, None), (2000.0, None), (1000.0, None), (500.0, None)]


def test_rejection_rate_per_hour(rows) -> None:
    got = run_read_only(query("rejected_pct"))
    # H1: i1 i2 n1 n2 n3 n4 b2 b3 b4 = 9 rows, n4 rejected: 100 / 9 = 11.11 %
    # H2: i3 i4 n5 b5..b11 b12 = 11 rows, i4 and b12 rejected (n5 left the queue, not
    # rejected): 200 / 11 = 18.18 %
    assert got == [(H1, 9, 1, 11.11), (H2, 11, 2, 18.18)]
