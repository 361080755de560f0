"""Shared fixtures: the real database (PostgreSQL under `make test`) and free ports."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.db import connection, connections

from gpuproxy.testing.pytest_isolation import name_test_database


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix) -> None:
    """This run's own test database: two runs on one cluster never drop each other's."""
    name_test_database()


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


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_next_block = [0]
BLOCK = 10


def free_port() -> int:
    """A port p such that p .. p+9 are all free, below the kernel's ephemeral range.

    Configs allocate `${PORT}` from startPort upwards, so a test needs a block of free
    ports, not one; and ports inside the ephemeral range can be taken at any moment by an
    outgoing connection (the proxy's own, to its upstreams), which made starts flaky.
    Each call hands out a different block, from a per-process random base.
    """
    low, _ = _ephemeral_range()
    top = min(low, 32768) - BLOCK
    bottom = 20000
    if not _next_block[0]:
        _next_block[0] = bottom + (os.getpid() * 7919) % (top - bottom)
    for _ in range((top - bottom) // BLOCK):
        start = _next_block[0]
        _next_block[0] = start + BLOCK if start + 2 * BLOCK < top else bottom
        if all(_bindable(p) for p in range(start, start + BLOCK)):
            return start
    raise RuntimeError("no block of free ports below the ephemeral range")


@pytest.fixture
def port() -> int:
    return free_port()


FAKE = f"{sys.executable} -m gpuproxy.testing.fakellm --port ${{PORT}} --model ${{MODEL_ID}}"


def database_url() -> str:
    """The test database, for the `gpuproxy` subprocesses a test starts."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def processes_matching(fragment: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `fragment`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if fragment in cmdline and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found


class Proxy:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path,
                 verify: ssl.SSLContext | bool = True) -> None:
        self.proc = proc
        self.base = base
        self.log = log
        self.workers = 1  # `serve --workers N`
        self.http = httpx.Client(base_url=base, timeout=60, trust_env=False, verify=verify)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _worker_counts() -> list[int]:
    """`serve --workers N` for each serve-based test: 1 and 2 (one process, and a supervisor
    with a scheduler process and two request processes); GPUPROXY_TEST_WORKERS=2 (or 1)
    runs one of them only, when iterating."""
    raw = os.environ.get("GPUPROXY_TEST_WORKERS", "1,2")
    return [int(n) for n in raw.split(",")]


@pytest.fixture(params=_worker_counts(), ids=lambda n: f"workers{n}")
def serve_workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def serve(tmp_path: Path, serve_workers: int) -> Iterator:
    started: list[Proxy] = []

    def start(config: str, extra_env: dict[str, str] | None = None, args: tuple[str, ...] = (),
              https_ca: Path | None = None) -> Proxy:
        """`args`: more serve flags; `https_ca`: serve speaks HTTPS with a certificate this
        CA file vouches for (the flags that make it are in `args`)."""
        if "${PORT}" in config and "startPort:" not in config:
            pytest.fail("the config hands out ${PORT} from the default startPort, 5800, the "
                        "demo's (`make run`); give it `startPort: {free_port()}`")
        cfg = tmp_path / "config.yaml"
        cfg.write_text(textwrap.dedent(config))
        port = free_port()
        log = tmp_path / f"serve-{port}.log"
        env = {**os.environ, "DATABASE_URL": database_url(),
               "GPUPROXY_DATA_DIR": str(tmp_path / "data"), **(extra_env or {})}
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
             "--listen", f"127.0.0.1:{port}", "--workers", str(serve_workers), *args],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        p = Proxy(proc, f"{'https' if https_ca else 'http'}://127.0.0.1:{port}", log,
                  verify=ssl.create_default_context(cafile=https_ca) if https_ca else True)
        p.workers = serve_workers
        started.append(p)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}:\n{p.output()}")
            try:
                # Ours, not another process that holds the port (it said it listens there).
                if (p.http.get("/health", timeout=1).status_code == 200
                        and f"listening on {p.base}" in p.output()):
                    return p
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        pytest.fail(f"serve did not answer /health within 60 s:\n{p.output()}")

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        p.http.close()


