"""How many activity rows per second does the writer put into PostgreSQL? (issue 6, item 8)

Submits `--rows` (default 50,000) realistic rows to a fresh `ActivityWriter` (default
settings: batches of 500 by `bulk_create` on its own thread) and times from the first submit
until `flush()` returns, i.e. until every row is in the table. Also reports what `submit()`
itself costs a request (µs, never the database). Goal: ≥ 5,000 rows/s.

The database: the server of `DATABASE_URL` (default postgres://postgres@127.0.0.1:5432/postgres),
in a scratch database `gpuproxy_bench` created and migrated if needed; the bench's rows are
deleted at the end. Without a reachable PostgreSQL it prints why and exits 0. Like the other
benchmarks it asserts nothing about timings.

    .venv/bin/python bench/activity_writer.py [--rows N] [--batch-size N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/postgres"
BENCH_DB = "gpuproxy_bench"
GOAL = 5_000.0
MARK = "bench-activity-writer"  # the `scheduler` column of the bench's rows


def ensure_database(url: str) -> str:
    """Create `gpuproxy_bench` on the server of `url` if missing; its URL."""
    import psycopg

    parts = urlsplit(url)
    with psycopg.connect(urlunsplit(parts._replace(query="")), autocommit=True,
                         connect_timeout=5) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              (BENCH_DB,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
    return urlunsplit(parts._replace(path="/" + BENCH_DB))


def make_row(i: int, t0: datetime) -> dict:
    at = t0 + timedelta(milliseconds=i)
    band = ("interactive", "normal", "batch")[i % 3]
    return {
        "request_id": uuid.uuid4(), "received_at": at,
        "dispatched_at": at + timedelta(milliseconds=40),
        "first_byte_at": at + timedelta(milliseconds=120),
        "finished_at": at + timedelta(milliseconds=900),
        "method": "POST", "path": "/v1/chat/completions",
        "model_requested": f"model-{i % 4}", "model": f"model-{i % 4}",
        "status_code": 200, "outcome": "ok", "priority": (100, 0, -100)[i % 3], "band": band,
        "score": 12.5, "score_parts": {"priority": 10, "affinity": 2, "aging": 0.5, "seq": i},
        "queue_wait_ms": 40.0 + i % 97, "swap_ms": None, "duration_ms": 900.0,
        "ttft_ms": 80.0, "stream": True, "prompt_tokens": 312, "completion_tokens": 128,
        "cached_tokens": 0, "prompt_tps": 850.0, "generation_tps": 42.0,
        "scheduler": MARK, "client": "bench", "user_agent": "bench/activity_writer",
        "error": "",
    }


async def run(rows: int, batch_size: int) -> dict:
    from activity.writer import ActivityWriter

    t0 = datetime.now(UTC)
    prepared = [make_row(i, t0) for i in range(rows)]
    w = ActivityWriter(max_buffer=rows + 1, batch_size=batch_size)
    w.start()
    start = time.perf_counter()
    for r in prepared:
        w.submit(r)
    submitted = time.perf_counter()
    flushed = await w.flush(timeout=100.0)
    done = time.perf_counter()
    await w.close(timeout=5.0)
    return {"written": w.written, "dropped": w.dropped, "errors": w.write_errors,
            "batches": w.batches, "flushed": flushed, "submit_s": submitted - start,
            "total_s": done - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()

    url = os.environ.get("DATABASE_URL") or DEFAULT_URL
    try:
        bench_url = ensure_database(url)
    except Exception as exc:
        print(f"activity_writer: skipped, PostgreSQL not reachable at {url} ({exc})")
        return 0
    os.environ["DATABASE_URL"] = bench_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuproxy.settings")

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    from activity.models import RequestLog

    call_command("migrate", verbosity=0)
    RequestLog.objects.filter(scheduler=MARK).delete()
    connections.close_all()
    try:
        result = asyncio.run(run(args.rows, args.batch_size))
        in_table = RequestLog.objects.filter(scheduler=MARK).count()
    finally:
        RequestLog.objects.filter(scheduler=MARK).delete()
        for conn in connections.all():
            close_pool = getattr(conn, "close_pool", None)
            if close_pool is not None:
                close_pool()
            conn.close()

    rate = result["written"] / result["total_s"] if result["total_s"] else 0.0
    submit_us = result["submit_s"] / args.rows * 1e6
    host = urlsplit(bench_url)
    print(f"activity writer -> PostgreSQL {host.hostname}:{host.port or 5432}/{BENCH_DB}, "
          f"{args.rows:,} rows, batches of {args.batch_size}")
    print(f"{'measure':<28}{'value':>14}")
    print(f"{'rows submitted':<28}{args.rows:>14,}")
    print(f"{'rows written (writer)':<28}{result['written']:>14,}")
    print(f"{'rows in the table':<28}{in_table:>14,}")
    print(f"{'dropped / write errors':<28}{result['dropped']:>7,} /{result['errors']:>5,}")
    print(f"{'batches':<28}{result['batches']:>14,}")
    print(f"{'submit() per row':<28}{submit_us:>11.2f} µs")
    print(f"{'submit -> all in table':<28}{result['total_s']:>12.2f} s")
    print(f"{'throughput':<28}{rate:>8,.0f} rows/s   (goal ≥ {GOAL:,.0f})")
    if in_table != args.rows or not result["flushed"]:
        print("WARNING: not every row reached the table")
    print(f"ratio rows/s ÷ goal: {rate / GOAL:.2f} ({'meets' if rate >= GOAL else 'BELOW'} "
          f"the goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
