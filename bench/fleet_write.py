"""What the fleet view's heartbeat costs the database (issue 24, item 3; docs/fleet.md).

In a scratch database (`--database`, default `gpuproxy_bench_fleet`, created and dropped at
the end) on the server of `DATABASE_URL` (default postgres://postgres@127.0.0.1:5432/postgres),
after the migrations: `--writes` heartbeats (default 5,000) through the node's own UPSERT
(`activity.fleet.write`, autocommit, one statement each, as a serve writes them), cycling over
`--nodes` node names (default 50, so the table holds a real fleet's rows), each a realistic row:
8 models, 3 loaded, 6 with requests waiting in one to three bands, 4 in flight. Printed per
write: the time (p50, p95, ms), the WAL it made (pg_current_wal_lsn before and after each of
`--batches` batches, divided by its writes; the smallest batch's, since WAL is counted for the
whole server and anything else running adds to it, and the median), the row's size, the share
of updates that were HOT; and what that means at `--fleet` nodes (default 50) writing once a
second: writes/s and WAL MB/hour. `--unlogged` measures the same on the table made UNLOGGED
(no WAL; emptied by a crash of the server and absent from its replicas), an alternative.

Nothing is asserted. Not part of `make bench` (`bench/report.py`).

    .venv/bin/python bench/fleet_write.py [--writes N] [--nodes N] [--batches N] [--fleet N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

from bench.activity_partitions import (  # noqa: E402 (after the path)
    DEFAULT_URL,
    drop_scratch_database,
    execute,
    scratch_database,
)

BENCH_DB = "gpuproxy_bench_fleet"
MODELS = [f"org/model-{i}-8b-instruct-q4_k_m" for i in range(8)]
BANDS = ("interactive", "normal", "batch")


def report(node: str, tick: int):
    """A busy node's heartbeat: its numbers move every tick, as a real queue's do."""
    from activity.fleet import NodeReport

    queue = {m: {BANDS[b]: {"depth": (tick + i + b) % 40 + 1,
                            "oldest_wait_s": round(((tick * 7 + i) % 900) / 3.0, 3)}
                 for b in range(i % 3 + 1)}
             for i, m in enumerate(MODELS[:6])}
    in_flight = {m: (tick + i) % 4 + 1 for i, m in enumerate(MODELS[:4])}
    return NodeReport(node=node, pid=40000 + tick % 1000,
                      started_at=datetime(2026, 12, 1, tzinfo=UTC), version="0.42.0",
                      listen="10.0.12.34:8080", loaded=MODELS[:3], queue=queue,
                      in_flight=in_flight)


def wal_lsn() -> int:
    return int(execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")[0][0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--fleet", type=int, default=50)
    parser.add_argument("--database", default=BENCH_DB)
    parser.add_argument("--unlogged", action="store_true",
                        help="measure the table made UNLOGGED (an alternative, not what ships)")
    args = parser.parse_args()

    url = os.environ.get("DATABASE_URL") or DEFAULT_URL
    if not scratch_database(url, args.database, "fleet_write"):
        return 0
    from django.core.management import call_command

    from activity.fleet import write

    try:
        call_command("migrate", verbosity=0)
        if args.unlogged:
            execute("ALTER TABLE activity_node SET UNLOGGED")
        names = [f"gpu-node-{i:02d}" for i in range(args.nodes)]
        for i, name in enumerate(names):  # the fleet's rows exist: every later write updates
            write(report(name, i), datetime.now(UTC))
        execute("VACUUM ANALYZE activity_node")
        before_upd = execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                             "WHERE relname = 'activity_node'")[0]
        times: list[float] = []
        wal_per_write: list[float] = []
        per_batch = max(1, args.writes // args.batches)
        tick = 0
        for _ in range(args.batches):
            start_lsn = wal_lsn()
            for _ in range(per_batch):
                tick += 1
                one = report(names[tick % len(names)], tick)
                at = datetime.now(UTC)
                t0 = time.perf_counter()
                write(one, at)
                times.append((time.perf_counter() - t0) * 1000)
            wal_per_write.append((wal_lsn() - start_lsn) / per_batch)
        time.sleep(0.6)  # the statistics collector reports at its own pace
        after_upd = execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                            "WHERE relname = 'activity_node'")[0]
        row_bytes = execute("SELECT avg(pg_column_size(n.*))::int FROM activity_node n")[0][0]
        table_bytes = execute("SELECT pg_total_relation_size('activity_node')")[0][0]
    finally:
        drop_scratch_database(url, args.database)

    writes = len(times)
    times.sort()
    p50 = statistics.median(times)
    p95 = times[min(writes - 1, int(writes * 0.95))]
    wal_min, wal_median = min(wal_per_write), statistics.median(wal_per_write)
    updates = after_upd[0] - before_upd[0]
    hot = (after_upd[1] - before_upd[1]) / updates if updates else float("nan")
    kind = " (UNLOGGED)" if args.unlogged else ""
    print(f"fleet_write: {writes} UPSERTs{kind} over {args.nodes} node rows ({len(MODELS)} models, "
          f"row {row_bytes} bytes, table {table_bytes / 1024:.0f} kB after)")
    print(f"  time per write: p50 {p50:.3f} ms, p95 {p95:.3f} ms")
    print(f"  WAL per write: {wal_min:.0f} bytes (smallest of {args.batches} batches), "
          f"{wal_median:.0f} bytes (median)")
    print(f"  HOT updates: {hot:.0%} of {updates}")
    print(f"  {args.fleet} nodes at 1/s: {args.fleet} writes/s, "
          f"{args.fleet * p50 / 1000:.3f} s of database time per s at the p50, "
          f"WAL {args.fleet * 3600 * wal_min / 1e6:.1f} MB/hour "
          f"({args.fleet * 3600 * wal_median / 1e6:.1f} at the median), "
          f"{args.fleet * 86400 * wal_min / 1e9:.2f} GB/day")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
