"""A test run that shares nothing with anything else on the machine (a pytest plugin).

pyproject's `addopts` loads it with `-p`, so it is imported before pytest-django reads Django's
settings; a conftest would be too late for the data dir.

- The run gets its own data dir. With the checkout's `./var`, a `make run` started meanwhile
  swept the run's live upstreams as if a crash had left them, and the other way round.
- The run gets its own test database name (`test_<db>_<host>_<pid>`), so two runs on one cluster
  no longer drop each other's database. Databases that a killed run on this host left behind
  (their pid is gone) are dropped when the next run starts.
- The suite runs on PostgreSQL, the database users run, unless SQLite is asked for by name
  (`GPUPROXY_TEST_SQLITE=1`, which `make test-sqlite` sets). Without either, the run stops at
  once with what to do; it never falls back to SQLite silently. On SQLite the tests marked
  `postgres` are deselected, and the summary counts them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

_DATA_DIR = Path(tempfile.mkdtemp(prefix="gpuproxy-test-"))
os.environ["GPUPROXY_DATA_DIR"] = str(_DATA_DIR)

SQLITE_REQUESTED = os.environ.get("GPUPROXY_TEST_SQLITE", "") == "1"
_HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_deselected: list[str] = []


def _on_postgresql() -> bool:
    from django.conf import settings

    return settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "postgres: needs PostgreSQL itself (LISTEN/NOTIFY, advisory locks, "
                   "its SQL); deselected under `make test-sqlite`")
    if _on_postgresql() and SQLITE_REQUESTED:
        raise pytest.UsageError("GPUPROXY_TEST_SQLITE=1 asks for SQLite, but DATABASE_URL "
                                "names PostgreSQL; unset one of them")
    if not _on_postgresql() and not SQLITE_REQUESTED:
        raise pytest.UsageError(
            "the test suite runs on PostgreSQL, and DATABASE_URL is not set (or not "
            "postgres://). Run `make test`, which finds or starts the local cluster, or set "
            "DATABASE_URL=postgres://user@host:port/db; `make test-sqlite` runs the suite on "
            "SQLite instead, without the tests that need PostgreSQL.")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_DATA_DIR, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    from django.conf import settings

    db = settings.DATABASES["default"]
    where = (f"PostgreSQL at {db['HOST'] or 'localhost'}:{db['PORT'] or 5432}"
             if _on_postgresql() else "SQLite (make test-sqlite)")
    return [f"gpuproxy: database {where}; this run's data dir {_DATA_DIR}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _on_postgresql():
        return
    deselected = [item for item in items if item.get_closest_marker("postgres")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("postgres")]
        _deselected.extend(item.nodeid for item in deselected)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _deselected:
        terminalreporter.write_line(
            f"gpuproxy: {len(_deselected)} tests need PostgreSQL and did not run on SQLite; "
            "`make test` runs them", yellow=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_stale_databases(db: dict, pattern: re.Pattern[str]) -> None:
    """Drop the test databases of runs on this host whose process is gone (a killed run)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(host=db["HOST"] or None, port=db["PORT"] or None,
                         user=db["USER"] or None, password=db["PASSWORD"] or None,
                         dbname=db["NAME"], connect_timeout=5, autocommit=True) as conn:
        names = [row[0] for row in conn.execute("SELECT datname FROM pg_database")]
        for name in names:
            m = pattern.fullmatch(name)
            if m and not _alive(int(m.group(1))):
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))


def name_test_database() -> None:
    """This run's own test database name (see above); for pytest-django's
    `django_db_modify_db_settings` fixture, which tests/conftest.py overrides with it (a plugin's
    fixture would lose to pytest-django's own)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    test = db.setdefault("TEST", {})
    if not _on_postgresql():
        # A file, not memory: the `gpuproxy serve` subprocesses of the tests share it.
        test["NAME"] = str(_DATA_DIR / "test.sqlite3")
        return
    base = (test.get("NAME") or f"test_{db['NAME']}")[:40]
    test["NAME"] = f"{base}_{_HOST_TAG}_{os.getpid()}"
    drop_stale_databases(db, re.compile(re.escape(f"{base}_{_HOST_TAG}_") + r"(\d+)"))
