"""`activity_prune` and `activity_export` against real rows in PostgreSQL."""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from activity.models import ModelEvent, RequestLog

pytestmark = pytest.mark.django_db

UTC = dt.UTC


def row(received_at: dt.datetime, **kw) -> RequestLog:
    fields = {"request_id": uuid.uuid4(), "received_at": received_at, "outcome": "ok", **kw}
    return RequestLog(**fields)


def run(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


# --- prune -------------------------------------------------------------------------------------


@pytest.fixture
def aged_rows():
    """Ages in hours: 4 rows older than 30 days, 3 between 1 and 30 days, 2 under an hour."""
    now = timezone.now()
    ages_h = [24 * 90, 24 * 45, 24 * 31, 24 * 30 + 1,  # older than 30d
              24 * 29, 24 * 2, 25,                   # older than 1d, younger than 30d
              0.5, 0.1]                              # younger than 1h
    RequestLog.objects.bulk_create(row(now - dt.timedelta(hours=h)) for h in ages_h)
    return now


def test_prune_deletes_only_rows_older_than_the_cutoff(aged_rows):
    out, _ = run("activity_prune", "--older-than", "30d")
    assert out.startswith("deleted 4 rows older than ")
    cutoff = dt.datetime.fromisoformat(out.strip().rsplit(" ", 1)[1])
    assert abs(cutoff - (aged_rows - dt.timedelta(days=30))) < dt.timedelta(minutes=1)
    assert RequestLog.objects.count() == 5
    assert not RequestLog.objects.filter(received_at__lt=cutoff).exists()

    out, _ = run("activity_prune", "--older-than", "24h")
    assert out.startswith("deleted 3 rows older than ")
    out, _ = run("activity_prune", "--older-than", "60m")
    assert out.startswith("deleted 0 rows older than ")
    assert RequestLog.objects.count() == 2


def test_prune_deletes_old_model_events_too(aged_rows):
    now = timezone.now()
    ModelEvent.objects.bulk_create(
        ModelEvent(at=now - dt.timedelta(days=d), model="m", kind="load") for d in (40, 31, 1))
    out, _ = run("activity_prune", "--older-than", "30d")
    assert [line.split(" older")[0] for line in out.splitlines()] == [
        "deleted 4 rows", "deleted 2 model events"]
    assert list(ModelEvent.objects.values_list("at", flat=True)) == [
        now - dt.timedelta(days=1)]


def test_prune_dry_run_deletes_nothing(aged_rows):
    out, _ = run("activity_prune", "--older-than", "1d", "--dry-run")
    assert out.startswith("dry run: would delete 7 rows older than ")
    assert RequestLog.objects.count() == 9


def test_prune_in_batches_smaller_than_the_row_count(django_assert_max_num_queries):
    now = timezone.now()
    old = [row(now - dt.timedelta(days=40, minutes=i)) for i in range(23)]
    new = [row(now - dt.timedelta(days=1, minutes=i)) for i in range(5)]
    # new rows interleaved with old ones in id order: ranges must keep them
    RequestLog.objects.bulk_create(old[:10] + new[:3] + old[10:] + new[3:])
    # 1 span query + ceil(26 id span / 5) = 6 ranges, each a select + delete at most
    with django_assert_max_num_queries(1 + 6 * 2):
        out, _ = run("activity_prune", "--older-than", "30d", "--batch", "5")
    assert out.startswith("deleted 23 rows older than ")
    assert RequestLog.objects.count() == 5
    assert not RequestLog.objects.filter(received_at__lt=now - dt.timedelta(days=30)).exists()


@pytest.mark.parametrize("bad", ["30", "30x", "d", "-3d", "thirty days", "0d"])
def test_prune_rejects_a_bad_age(bad):
    with pytest.raises(CommandError, match=r"use an age like 30d \(days\), 12h"):
        run("activity_prune", f"--older-than={bad}")


def test_prune_rejects_a_bad_batch():
    with pytest.raises(CommandError, match="--batch"):
        run("activity_prune", "--older-than", "1d", "--batch", "0")


# --- export ------------------------------------------------------------------------------------

A = uuid.UUID("00000000-0000-0000-0000-00000000000a")
B = uuid.UUID("00000000-0000-0000-0000-00000000000b")
C = uuid.UUID("00000000-0000-0000-0000-00000000000c")


@pytest.fixture
def window_rows():
    t = dt.datetime(2026, 11, 1, 10, 0, tzinfo=UTC)
    RequestLog.objects.bulk_create([
        # inserted out of time order: export sorts by received_at
        RequestLog(id=902, request_id=B, received_at=t + dt.timedelta(minutes=5),
                   method="POST", path="/v1/chat/completions", model_requested="qwen",
                   model="qwen-7b", status_code=429, outcome="rejected_queue", priority=-10,
                   band="batch", client="etl", error='queue full, "try later"'),
        RequestLog(id=901, request_id=A, received_at=t, finished_at=t + dt.timedelta(seconds=2),
                   method="POST", path="/v1/chat/completions", model_requested="qwen",
                   model="qwen-7b", status_code=200, outcome="ok", priority=100,
                   band="interactive", score=101.5,
                   score_parts={"priority": 100, "affinity": 1.0, "aging": 0.5, "seq": 7},
                   queue_wait_ms=12.5, duration_ms=2000.0, stream=True, prompt_tokens=10,
                   completion_tokens=20, generation_tps=41.5, scheduler="priority",
                   client="alice", user_agent="t/1"),
        # outside the window on both sides
        RequestLog(id=900, request_id=uuid.uuid4(), received_at=t - dt.timedelta(seconds=1),
                   outcome="ok"),
        RequestLog(id=903, request_id=C, received_at=t + dt.timedelta(hours=1), outcome="ok"),
    ])


HEADER = ("id,request_id,received_at,dispatched_at,first_byte_at,finished_at,method,path,"
          "model_requested,model,status_code,outcome,priority,priority_asked,band,score,"
          "score_parts,queue_wait_ms,swap_ms,duration_ms,ttft_ms,stream,input_tokens,"
          "output_tokens,output_tokens_counted,draft_tokens,draft_accepted_tokens,"
          "prompt_tokens,completion_tokens,cached_tokens,prompt_tps,generation_tps,scheduler,"
          "client,client_ip,end_user,endpoint,user_agent,error,upstream_retries,node,entry_node")


def test_export_csv_window(window_rows, tmp_path):
    target = tmp_path / "out.csv"
    out, err = run("activity_export", "--since", "2026-11-01T10:00:00Z",
                   "--until", "2026-11-01T11:00", "-o", str(target))
    assert out == ""
    assert err.strip() == "exported 2 rows since 2026-11-01T10:00:00+00:00"
    assert target.read_text().splitlines() == [
        HEADER,
        "901,00000000-0000-0000-0000-00000000000a,2026-11-01T10:00:00+00:00,,,"
        "2026-11-01T10:00:02+00:00,POST,/v1/chat/completions,qwen,qwen-7b,200,ok,100,,"
        'interactive,101.5,"{""affinity"":1.0,""aging"":0.5,""priority"":100,""seq"":7}",'
        "12.5,,2000.0,,true,,,false,,,10,20,,,41.5,priority,alice,,,,t/1,,0,,",
        "902,00000000-0000-0000-0000-00000000000b,2026-11-01T10:05:00+00:00,,,,POST,"
        "/v1/chat/completions,qwen,qwen-7b,429,rejected_queue,-10,,batch,,,,,,,false,,,false,"
        ',,,,,,,,etl,,,,,"queue full, ""try later""",0,,',
    ]


def test_export_jsonl_to_stdout(window_rows):
    out, _ = run("activity_export", "--since", "2026-11-01T10:00:00",
                 "--until", "2026-11-01T10:05:00", "--format", "jsonl")
    lines = out.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record == {
        "id": 901, "request_id": "00000000-0000-0000-0000-00000000000a",
        "received_at": "2026-11-01T10:00:00+00:00", "dispatched_at": None,
        "first_byte_at": None, "finished_at": "2026-11-01T10:00:02+00:00",
        "method": "POST", "path": "/v1/chat/completions", "model_requested": "qwen",
        "model": "qwen-7b", "status_code": 200, "outcome": "ok", "priority": 100,
        "priority_asked": None, "band": "interactive", "score": 101.5,
        "score_parts": {"priority": 100, "affinity": 1.0, "aging": 0.5, "seq": 7},
        "queue_wait_ms": 12.5, "swap_ms": None, "duration_ms": 2000.0, "ttft_ms": None,
        "stream": True, "input_tokens": None, "output_tokens": None,
        "output_tokens_counted": False, "draft_tokens": None, "draft_accepted_tokens": None,
        "prompt_tokens": 10, "completion_tokens": 20, "cached_tokens": None,
        "prompt_tps": None, "generation_tps": 41.5, "scheduler": "priority",
        "client": "alice", "client_ip": None, "end_user": "", "endpoint": "",
        "user_agent": "t/1", "error": "", "upstream_retries": 0, "node": "", "entry_node": "",
    }


def test_export_date_since_without_until_and_small_chunks(window_rows):
    out, _ = run("activity_export", "--since", "2026-11-01", "--format", "jsonl",
                 "--chunk-size", "1")
    assert [json.loads(line)["id"] for line in out.splitlines()] == [900, 901, 902, 903]


def test_export_relative_since():
    now = timezone.now()
    RequestLog.objects.bulk_create([row(now - dt.timedelta(hours=h), client=f"c{h}")
                                    for h in (1, 5, 30)])
    out, _ = run("activity_export", "--since", "24h", "--format", "jsonl")
    assert [json.loads(line)["client"] for line in out.splitlines()] == ["c5", "c1"]
    out, _ = run("activity_export", "--since", "2d")
    assert [line.split(",")[-9] for line in out.splitlines()] == ["client", "c30", "c5", "c1"]


def test_export_rejects_a_bad_since():
    with pytest.raises(CommandError, match="ISO date or datetime"):
        run("activity_export", "--since", "yesterday")
