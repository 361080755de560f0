"""Does a database outage cost the proxy anything? Request rate with PostgreSQL up vs stopped.

Runs the real `gpuproxy serve` (Daphne, one fake upstream) against the scratch database
`gpuproxy_bench`, sends the same burst of non-streaming chat requests three times: database
up, database refusing every connection (ALLOW_CONNECTIONS false and every session
terminated), database back. Prints req/s and p50 latency per phase, the outage/up ratio (goal:
the same within noise), and whether every request's activity row arrived after recovery.

    .venv/bin/python bench/activity_outage.py [--requests 300] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activity_writer import DEFAULT_URL, ensure_database


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admin_conn(url: str) -> psycopg.Connection:
    parts = urlsplit(url)
    return psycopg.connect(host=parts.hostname or "127.0.0.1", port=parts.port or 5432,
                           user=parts.username or "postgres", password=parts.password,
                           dbname="postgres", autocommit=True)


def outage(url: str, on: bool) -> None:
    name = urlsplit(url).path.lstrip("/")
    with admin_conn(url) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"false" if on else "true"}')
        if on:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s", [name])


def burst(base: str, n: int, concurrency: int) -> tuple[float, float, int]:
    """(req/s, p50 ms, errors) for n requests."""
    body = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    latencies: list[float] = []
    errors = 0

    def one(client: httpx.Client) -> float | None:
        t = time.perf_counter()
        try:
            r = client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError:
            return None
        return time.perf_counter() - t if r.status_code == 200 else None

    clients = [httpx.Client(base_url=base, trust_env=False, timeout=30)
               for _ in range(concurrency)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one, clients[i % concurrency]) for i in range(n)]
        for f in futures:
            value = f.result()
            if value is None:
                errors += 1
            else:
                latencies.append(value)
    elapsed = time.perf_counter() - start
    for c in clients:
        c.close()
    p50 = statistics.median(latencies) * 1000 if latencies else float("nan")
    return n / elapsed, p50, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL") or DEFAULT_URL
    try:
        bench_url = ensure_database(url)
    except psycopg.OperationalError as exc:
        print(f"PostgreSQL not reachable at {url}: {exc}; nothing measured")
        return 0
    with psycopg.connect(bench_url, autocommit=True) as conn:
        conn.execute("DELETE FROM activity_requestlog")
    work = Path(tempfile.mkdtemp(prefix="gpuproxy-outage-"))
    cfg = work / "config.yaml"
    cfg.write_text(textwrap.dedent(f"""
        startPort: {free_port()}
        models:
          solo:
            cmd: {sys.executable} -m gpuproxy.testing.fakellm --port ${{PORT}} --model solo
            concurrencyLimit: 1000
            parallel: {args.concurrency}
    """))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DATABASE_URL": bench_url, "GPUPROXY_DATA_DIR": str(work)}
    log = (work / "serve.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("gpuproxy")), "serve",
                             "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            try:
                if httpx.post(base + "/api/models/load/solo", trust_env=False,
                              timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        burst(base, 50, args.concurrency)  # warm-up
        results = {"up": burst(base, args.requests, args.concurrency)}
        outage(bench_url, True)
        try:
            results["down"] = burst(base, args.requests, args.concurrency)
        finally:
            outage(bench_url, False)
        results["back"] = burst(base, args.requests, args.concurrency)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    sent = 50 + 3 * args.requests
    with psycopg.connect(bench_url, autocommit=True) as conn:
        rows = conn.execute("SELECT count(*) FROM activity_requestlog").fetchone()[0]
        conn.execute("DELETE FROM activity_requestlog")
    print(f"{'phase':8} {'req/s':>8} {'p50 ms':>8} {'errors':>7}")
    for phase, (rps, p50, errors) in results.items():
        print(f"{phase:8} {rps:>8.1f} {p50:>8.2f} {errors:>7}")
    print(f"activity rows after recovery: {rows} of {sent} requests")
    ratio = results["down"][0] / results["up"][0]
    print(f"outage/up req/s ratio: {ratio:.2f} (goal: the same within noise); "
          f"rows lost: {sent - rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
