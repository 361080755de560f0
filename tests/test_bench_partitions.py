"""`bench/activity_partitions.py` at a tiny size: it runs both layouts end to end, the
migration included, drops its scratch database, and both layouts answer the 24 h p95 with the
value worked out here from the rows it generates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent


def expected_p95(rows: int, days: int = 120) -> float:
    """Row g (1..rows) is received (rows - g) * days / rows days before the anchor, with a
    queue wait of g * 7919 % 1000 ms; percentile_cont interpolates between closest ranks."""
    window = [g * 7919 % 1000 for g in range(1, rows + 1)
              if (rows - g) * days * 24 * 60 / rows <= 24 * 60]
    waits = sorted(window)
    pos = 0.95 * (len(waits) - 1)
    low = int(pos)
    return waits[low] + (pos - low) * (waits[low + 1] - waits[low])


def test_expected_p95_by_hand():
    # 2,000 rows 86.4 min apart: g = 1984..2000 in the last 24 h (16 * 86.4 = 1382.4 min),
    # 17 waits; rank 0.95 * 16 = 15.2 between the 16th and 17th smallest
    assert expected_p95(2000) == pytest.approx(907.2)


def test_the_bench_runs_both_layouts_and_cleans_up():
    url = os.environ["DATABASE_URL"]  # the server's; the bench makes its own database there
    name = f"gpuproxy_bench_partitions_{os.getpid()}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "activity_partitions.py"), "--rows", "2000",
         "--insert-rows", "1500", "--repeat", "2", "--database", name],
        cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "2,000 rows over 120 days" in lines[0]
    insert, query, value = lines[2].split(), lines[3].split(), lines[4].split()
    assert insert[:3] == ["insert,", "writer", "COPY"] and float(insert[-1]) > 0
    assert query[:4] == ["24", "h", "p95", "query,"] and float(query[-1]) > 0
    assert [float(v) for v in value[-2:]] == [pytest.approx(expected_p95(2000))] * 2
    assert lines[5].startswith("migration 0009 on the plain table: ")
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            [name]).fetchone() == (0,)
