"""The token and client queries of `docs/activity.md`'s *Example SQL* run, as written, against
the suite's PostgreSQL, on rows whose answers are worked out here by hand."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from pathlib import Path

import pytest
from django.db import connection

from activity import outcomes
from activity.models import RequestLog
from gpuproxy.api.activity import compute_stats

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

DOC = Path(__file__).resolve().parent.parent / "docs" / "activity.md"


def query(marker: str) -> str:
    """The one example of the *Example SQL* section that contains `marker`."""
    text = DOC.read_text()
    start = text.index("\n## Example SQL (PostgreSQL)\n")
    end = text.find("\n## ", start + 1)
    (sql,) = [q for q in re.findall(r"```sql\n(.*?)```", text[start:end], flags=re.S)
              if marker in q]
    return sql


def run(sql: str) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [tuple(float(v) if hasattr(v, "as_tuple") else v for v in row)
                for row in cursor.fetchall()]


@pytest.fixture
def rows() -> None:
    now = dt.datetime.now(dt.UTC)
    # within every window, and on one day whatever the time (the first query groups by day)
    recent = now.replace(hour=0, minute=0, second=0, microsecond=0)
    old = now - dt.timedelta(days=40)

    def row(model: str, at: dt.datetime, outcome: str = outcomes.OK, **kw) -> RequestLog:
        return RequestLog(request_id=uuid.uuid4(), received_at=at, model=model,
                          model_requested=model, outcome=outcome, path="/v1/chat/completions",
                          **kw)

    RequestLog.objects.bulk_create([
        # llama.cpp: 25 prompt tokens, 24 of them cached; drafts 6, 4 accepted
        row("llama", recent, input_tokens=25, cached_tokens=24, output_tokens=8,
            draft_tokens=6, draft_accepted_tokens=4, client_ip="203.0.113.9",
            end_user="alice", endpoint="chat"),
        row("llama", recent, input_tokens=75, cached_tokens=0, output_tokens=2,
            draft_tokens=4, draft_accepted_tokens=1, client_ip="203.0.113.9",
            end_user="alice", endpoint="chat"),
        # a client that left after 30 events were relayed
        row("llama", recent, outcomes.CANCELLED_INFLIGHT, output_tokens=30,
            output_tokens_counted=True, client_ip="198.51.100.4", endpoint="chat"),
        row("vllm", recent, input_tokens=10, output_tokens=0, client_ip="198.51.100.4",
            endpoint="embeddings"),
        row("vllm", recent, outcomes.CANCELLED_INFLIGHT, client_ip="198.51.100.4",
            endpoint="chat"),
        # out of every window
        row("llama", old, outcomes.CANCELLED_INFLIGHT, input_tokens=1000, cached_tokens=1000,
            output_tokens=1000, draft_tokens=9, draft_accepted_tokens=9,
            client_ip="192.0.2.1", endpoint="chat"),
    ])


def test_tokens_per_model_per_day(rows) -> None:
    got = [r[1:] for r in run(query("cached_pct"))]
    # llama: 25 + 75 in, 24 cached (24.0 %), 8 + 2 + 30 out, 3 rows; vllm: 10 in, none cached
    assert got == [("llama", 100, 24, 40, 24.0, 3), ("vllm", 10, None, 0, None, 2)]


def test_output_tokens_of_clients_that_left(rows) -> None:
    assert run(query("tokens_relayed")) == [("llama", 1, 30), ("vllm", 1, None)]


def test_draft_acceptance_rate(rows) -> None:
    # 6 + 4 drafted, 4 + 1 accepted: 50 %
    assert run(query("accepted_pct")) == [("llama", 10, 5, 50.0)]


def test_who_sends_what(rows) -> None:
    assert run(query("GROUP BY client_ip, end_user, endpoint")) == [
        ("198.51.100.4", "", "chat", 2, None, 30),
        ("203.0.113.9", "alice", "chat", 2, 100, 10),
        ("198.51.100.4", "", "embeddings", 1, 10, 0),
    ]


def test_the_stats_api_sums_the_token_columns(rows) -> None:
    # the five rows of today; the 40-day-old one is out of the window
    since = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    assert compute_stats({"received_at__gte": since})["tokens"] == {
        "input": 110, "cached": 24, "output": 40, "draft": 10, "draft_accepted": 5,
        "prompt": 0, "completion": 0}  # the aliases: these rows were written without them
