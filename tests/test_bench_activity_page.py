"""`bench/activity_page.py` at a tiny size: it times every query of the Activity page for
each window and drops its scratch database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent


def test_the_bench_times_the_page_queries_and_cleans_up():
    url = os.environ["DATABASE_URL"]  # the server's; the bench makes its own database there
    name = f"gpuproxy_bench_activity_page_{os.getpid()}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "activity_page.py"), "--rows", "2000",
         "--repeat", "1", "--database", name],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "2,000 rows over 120 days" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["1h", "24h", "7d"]
    assert all(len(line.split()) == 5 and all(float(v) > 0 for v in line.split()[1:])
               for line in lines[2:])
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            [name]).fetchone() == (0,)
