"""Shared fixtures: the real database (PostgreSQL under `make test`) and free ports."""

from __future__ import annotations

import socket

import pytest
from django.db import connections


@pytest.fixture(scope="session", autouse=True)
def _close_db_pool_at_end(django_db_setup, django_db_blocker):
    """A psycopg pool keeps sessions open, and DROP DATABASE at teardown would then fail."""
    yield
    with django_db_blocker.unblock():
        for conn in connections.all():
            close_pool = getattr(conn, "close_pool", None)
            if close_pool is not None:
                close_pool()
            conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
