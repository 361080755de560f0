"""A test run shares nothing with a `make run` or another run on the same machine, and a run
that cannot have PostgreSQL says so instead of falling back (gpuproxy/testing/pytest_isolation.py,
scripts/ensure-postgres)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from gpuproxy.testing import pytest_isolation

REPO = Path(__file__).resolve().parents[1]
UNREACHABLE = "postgres://nobody@127.0.0.1:1/x"


def test_the_run_has_a_temporary_data_dir_not_the_checkouts():
    assert settings.DATA_DIR != REPO / "var"
    assert settings.DATA_DIR.is_relative_to(Path(tempfile.gettempdir()))
    assert os.environ["GPUPROXY_DATA_DIR"] == str(settings.DATA_DIR)


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_test_database_is_this_runs_own():
    name = connection.settings_dict["NAME"]
    assert re.fullmatch(rf"test_\w+_[0-9a-f]{{6}}_{os.getpid()}", name), name


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_killed_runs_database_is_dropped_and_a_live_ones_kept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    db = dict(connection.settings_dict)
    db["NAME"] = "postgres"
    base = "test_isolation_probe"
    pattern = re.compile(re.escape(f"{base}_") + r"(\d+)")
    names = [f"{base}_{dead.pid}", f"{base}_{os.getpid()}"]
    with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"],
                         dbname="postgres", autocommit=True) as conn:
        for n in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{n}"')
            conn.execute(f'CREATE DATABASE "{n}"')
        try:
            pytest_isolation.drop_stale_databases(db, pattern)
            left = {r[0] for r in conn.execute("SELECT datname FROM pg_database")}
            assert names[0] not in left  # its pid is gone
            assert names[1] in left  # this process is alive
        finally:
            for n in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{n}"')


def test_pytest_without_postgresql_stops_at_once_with_what_to_do(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "GPUPROXY_TEST_SQLITE")}
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_spec.py", "-q"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "the test suite runs on PostgreSQL" in r.stderr
    assert "make test-sqlite" in r.stderr
    assert " passed" not in r.stdout


def test_make_test_without_postgresql_stops_before_installing_anything():
    r = subprocess.run(["make", "--no-print-directory", "test", f"DATABASE_URL={UNREACHABLE}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"cannot connect to {UNREACHABLE}" in out
    for remedy in ("DATABASE_URL=", "pg_ctlcluster", "pg_hba.conf", "make test-sqlite"):
        assert remedy in out, remedy
    assert "pip" not in out and "pytest" not in out  # nothing ran after the check


def test_ensure_postgres_never_prompts_and_hides_the_password():
    url = "postgres://nobody:hunter2@127.0.0.1:1/x"
    r = subprocess.run([str(REPO / "scripts" / "ensure-postgres")], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "DATABASE_URL": url},
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stdout == ""
    assert "hunter2" not in r.stderr
    assert "postgres://nobody:***@127.0.0.1:1/x" in r.stderr
