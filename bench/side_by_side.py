"""What users run, side by side: the upstream direct, gpuproxy on PostgreSQL and llama-swap.

One run, one config, one upstream program, one client: the fake upstream alone (the baseline),
`gpuproxy serve` on PostgreSQL (a database of its own, dropped at the end), and the real
llama-swap when `../shared/peers/llama-swap/llama-swap` is there (or `LLAMASWAP_BIN`). Both
proxies read the same llama-swap YAML and start the same fake (`gpuproxy.testing.fakellm`) as
their model; the direct baseline is another copy of it. Rounds are interleaved (the order
rotates every round) after a warm-up, so a noisy machine's drift falls on every side alike.

    .venv/bin/python bench/side_by_side.py [--seconds 2] [--rounds 4] [--no-llamaswap]
        [--workers N] [--proxy-cpus N] [--clients K]

`--proxy-cpus N --workers N --clients K` is the box with cores: each proxy on N CPUs (every
process of gpuproxy's `serve --workers N` pinned to them, llama-swap's threads too), and K
client processes on the rest, so that the client is not what limits a proxy on many cores.

The figure that matters on a box the client and the upstream share with the proxy is the
proxy's **CPU per request** (and per SSE chunk): every proxy process together (utime + stime
from /proc, its upstreams not counted), with the proxy pinned by `sched_setaffinity` to CPU 0
and the client, the upstreams and everything the proxy starts moved to the other CPUs, so the
proxy's figure is its own. The goals of issue 17 are printed PASS or GAP; nothing exits
non-zero on a timing.

Cases (issue 17's table): JSON chat completions (16 tokens) at c=1 and c=32: req/s and added
p50 latency; SSE streams of 100 chunks at c=1 and c=32: chunks/s and added time to the first
chunk (TTFB).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_overhead import (
    JSON_BODY,
    ROOT,
    SSE_BODY,
    Conn,
    Run,
    cpu_seconds,
    drive,
    fake_command,
    free_port,
    goal,
    http,
    request_bytes,
    start_fake,
    terminate,
)

CASES = [("json", 1), ("json", 32), ("sse100", 1), ("sse100", 32)]
PROXY_CPUS = {0}  # `--proxy-cpus N`: the first N CPUs


# ---- CPUs -----------------------------------------------------------------------------------

def other_cpus() -> set[int]:
    cpus = os.sched_getaffinity(0)
    rest = cpus - PROXY_CPUS
    return rest or cpus


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of all its threads, recursively)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                continue
            out += kids
            todo += kids
    return out


def ours(pid: int) -> bool:
    """Whether `pid` is a gpuproxy process (`serve --workers N`'s scheduler and request
    processes are), not an upstream."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gpuproxy.cli\0serve" in f.read()
    except FileNotFoundError:
        return False


def proxy_processes(pid: int) -> list[int]:
    """The proxy process and, under `--workers N`, its own children: the CPU counted."""
    return [pid, *(p for p in descendants(pid) if ours(p))]


def unpin_children(pid: int) -> None:
    """The upstreams a pinned proxy started inherited its CPU: move them off it."""
    for child in descendants(pid):
        if ours(child):
            continue
        try:
            os.sched_setaffinity(child, other_cpus())
        except ProcessLookupError:
            pass


# ---- the systems ----------------------------------------------------------------------------

@dataclass
class Side:
    """One thing the client drives: its port, and the pids whose CPU is the proxy's."""

    name: str
    port: int
    proc: subprocess.Popen | None = None
    counted: list[int] = field(default_factory=list)  # proxy processes (not upstreams)
    stop_hooks: list[Callable[[], object]] = field(default_factory=list)

    def cpu(self) -> float:
        total = 0.0
        for pid in self.counted:
            try:
                total += cpu_seconds(pid)
            except FileNotFoundError:
                pass
        return total

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)
        for hook in self.stop_hooks:
            hook()


def config_yaml() -> str:
    """The config both proxies read: llama-swap's format, one model on the fake. Each gets
    its own copy, alike but for `startPort`: both start their upstream at once."""
    return textwrap.dedent(f"""\
        startPort: {free_port()}
        healthCheckTimeout: 60
        models:
          solo:
            cmd: {fake_command("${PORT}")}
            concurrencyLimit: 1000
            parallel: 64
        """)


def write_config(path: Path) -> Path:
    path.write_text(config_yaml())
    return path


def wait_health(side: Side, path: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if side.proc is not None and side.proc.poll() is not None:
            raise RuntimeError(f"{side.name} exited {side.proc.returncode}:\n"
                               + log.read_text(errors="replace")[-3000:])
        try:
            if http("GET", side.port, path, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{side.name} did not answer {path} within 120 s")


def postgres_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith(("postgres://", "postgresql://")):
        return url
    found = subprocess.run([str(ROOT / "scripts" / "ensure-postgres")], capture_output=True,
                           text=True)
    if found.returncode != 0 or not found.stdout.strip():
        sys.exit("side_by_side measures gpuproxy on PostgreSQL, as users run it: "
                 f"{found.stderr.strip() or 'no DATABASE_URL and no local cluster'}")
    return found.stdout.strip()


def own_database(url: str) -> tuple[str, Callable[[], None]]:
    """A fresh database on the cluster of `url`, and the hook that drops it."""
    import psycopg

    name = f"gpuproxy_bench_{uuid.uuid4().hex[:8]}"
    base = url.rsplit("/", 1)[0]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{base}/{name}", drop


def start_gpuproxy(cfg: Path, work: Path, workers: int) -> Side:
    url, drop = own_database(postgres_url())
    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "GPUPROXY_DATA_DIR": str(work / "gpuproxy"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                      os.environ.get("PYTHONPATH")]))}
    log = work / "gpuproxy.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "serve", "--config",
                             str(cfg), "--listen", f"127.0.0.1:{port}",
                             "--workers", str(workers)], cwd=ROOT,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, PROXY_CPUS))
    side = Side("gpuproxy", port, proc, [proc.pid], [drop])
    wait_health(side, "/health", log)
    status, body = http("POST", port, "/api/models/load/solo", timeout=120)
    if status != 200:
        raise RuntimeError(f"gpuproxy could not load solo: {status} {body[:300]!r}")
    side.counted = proxy_processes(proc.pid)
    return side


def llamaswap_binary() -> Path | None:
    given = os.environ.get("LLAMASWAP_BIN")
    path = Path(given) if given else ROOT.parent / "shared" / "peers" / "llama-swap" / "llama-swap"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def start_llamaswap(binary: Path, cfg: Path, work: Path) -> Side:
    port = free_port()
    log = work / "llama-swap.log"
    proc = subprocess.Popen([str(binary), "-config", str(cfg), "-listen", f"127.0.0.1:{port}"],
                            cwd=work, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, PROXY_CPUS))
    side = Side("llama-swap", port, proc, [proc.pid])
    wait_health(side, "/health", log)
    status, body = http("POST", port, "/v1/chat/completions", JSON_BODY, timeout=120)
    if status != 200:  # its first request loads the model
        raise RuntimeError(f"llama-swap could not serve solo: {status} {body[:300]!r}")
    return side


# ---- measuring ------------------------------------------------------------------------------

@dataclass
class Case:
    kind: str
    concurrency: int
    runs: dict[str, Run] = field(default_factory=dict)


def _client_round(port: int, data: bytes, conc: int, seconds: float) -> Run:
    """One client process's share of a round (`--clients K`): its own connections."""
    return asyncio.run(drive(port, data, conc, seconds))


class Clients:
    """Who sends a round's requests: this process (one client, its connections kept from
    round to round), or `--clients K` processes with `conc / K` connections each, for a box
    where one Python client would be the limit (the proxies on many cores)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool: ProcessPoolExecutor | None = None
        if count > 1:
            self.pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context(
                "spawn"))
            list(self.pool.map(abs, range(count)))  # started now, outside the event loop

    def split(self, conc: int) -> list[int]:
        k = min(self.count, conc)
        return [conc // k + (1 if i < conc % k else 0) for i in range(k)]

    async def round(self, port: int, data: bytes, conc: int, seconds: float,
                    conns: list[Conn]) -> Run:
        if self.pool is None or conc == 1:
            return await drive(port, data, conc, seconds, conns)
        loop = asyncio.get_running_loop()
        runs = await asyncio.gather(*(
            loop.run_in_executor(self.pool, _client_round, port, data, n, seconds)
            for n in self.split(conc)))
        merged = Run()
        for run in runs:
            merged.results += run.results
        merged.seconds = max(run.seconds for run in runs)
        return merged

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


async def measure(sides: list[Side], seconds: float, rounds: int,
                  clients: Clients) -> list[Case]:
    cases = []
    for kind, conc in CASES:
        body = SSE_BODY if kind == "sse100" else JSON_BODY
        case = Case(kind, conc, {s.name: Run() for s in sides})
        own = clients.pool is None or conc == 1
        pools = {s.name: [await Conn.open(s.port) for _ in range(conc)] if own else []
                 for s in sides}
        data = {s.name: request_bytes(s.port, body) for s in sides}
        for s in sides:  # warm-up
            await clients.round(s.port, data[s.name], conc, min(0.5, seconds), pools[s.name])
        for r in range(rounds):
            for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                cpu0 = s.cpu()
                run = await clients.round(s.port, data[s.name], conc, seconds, pools[s.name])
                run.cpu = s.cpu() - cpu0
                case.runs[s.name].merge(run)
        for pool in pools.values():
            for c in pool:
                c.close()
        cases.append(case)
    return cases


def per_unit(case: Case, name: str) -> float:
    """Proxy CPU in µs per request (JSON) or per SSE chunk."""
    run = case.runs[name]
    n = sum(r.events for r in run.results) if case.kind == "sse100" else len(run.results)
    return run.cpu / n * 1e6 if n else float("nan")


def _cpus(cpus: set[int]) -> str:
    ordered = sorted(cpus)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return str(ordered)


def report(cases: list[Case], names: list[str], seconds: float, rounds: int,
           workers: int = 1, clients: int = 1) -> None:
    print(f"side_by_side: direct vs {' vs '.join(n for n in names if n != 'direct')} "
          f"(gpuproxy on PostgreSQL, --workers {workers}); {rounds} interleaved rounds of "
          f"{seconds:g} s per side and case; proxies pinned to CPU {_cpus(PROXY_CPUS)}, "
          f"client ({clients} process{'es' if clients > 1 else ''}) and upstreams on "
          f"{_cpus(other_cpus())}")
    print(f"{'case':8} {'conc':>4} {'side':11} {'reqs':>6} {'req/s':>8} {'p50 ms':>8} "
          f"{'chunks/s':>9} {'ttfb p50':>9} {'proxy CPU':>14} {'err':>4}")
    for c in cases:
        for name in names:
            run = c.runs[name]
            unit = "µs/chunk" if c.kind == "sse100" else "µs/req"
            cpu = f"{per_unit(c, name):7.1f} {unit}" if name != "direct" else "-"
            ev = f"{run.event_rate():9.0f}" if c.kind == "sse100" else f"{'-':>9}"
            ttfb = f"{run.ttfb_ms(0.5):9.2f}" if c.kind == "sse100" else f"{'-':>9}"
            print(f"{c.kind:8} {c.concurrency:>4} {name:11} {len(run.results):>6} "
                  f"{run.rate():>8.0f} {run.latency_ms(0.5):>8.2f} {ev} {ttfb} {cpu:>14} "
                  f"{run.errors:>4}")
    print()
    print("added by each proxy (against direct, same run):")
    for c in cases:
        d = c.runs["direct"]
        for name in names:
            if name == "direct":
                continue
            p = c.runs[name]
            if c.kind == "sse100":
                print(f"  {c.kind}@c{c.concurrency} {name}: chunks/s {p.event_rate():.0f} "
                      f"({p.event_rate() / d.event_rate():.2f}x direct), added TTFB p50 "
                      f"{p.ttfb_ms(0.5) - d.ttfb_ms(0.5):+.2f} ms, "
                      f"{per_unit(c, name):.1f} µs CPU/chunk")
            else:
                print(f"  {c.kind}@c{c.concurrency} {name}: req/s {p.rate():.0f} "
                      f"({p.rate() / d.rate():.2f}x direct), added p50 "
                      f"{p.latency_ms(0.5) - d.latency_ms(0.5):+.2f} ms, "
                      f"{per_unit(c, name):.0f} µs CPU/req")
    by = {(c.kind, c.concurrency): c for c in cases}
    j1, j32, s32 = by["json", 1], by["json", 32], by["sse100", 32]
    print()
    print("goals (issue 17):")
    goal(per_unit(j32, "gpuproxy") <= 500,
         f"gpuproxy CPU per JSON request at c=32: {per_unit(j32, 'gpuproxy'):.0f} µs (≤ 500)")
    goal(per_unit(s32, "gpuproxy") <= 7,
         f"gpuproxy CPU per SSE chunk at c=32: {per_unit(s32, 'gpuproxy'):.1f} µs (≤ 7)")
    if "llama-swap" in names:
        def added(c: Case, name: str) -> float:
            return c.runs[name].latency_ms(0.5) - c.runs["direct"].latency_ms(0.5)

        ratio = added(j1, "gpuproxy") / max(added(j1, "llama-swap"), 1e-9)
        goal(ratio <= 2, f"added p50 at c=1: {ratio:.1f}x llama-swap's (≤ 2x)")
        rps = j32.runs["gpuproxy"].rate() / j32.runs["llama-swap"].rate()
        goal(rps >= 0.5, f"JSON c=32 req/s: {rps:.2f}x llama-swap's (≥ 0.5x)")
        cps = s32.runs["gpuproxy"].event_rate() / s32.runs["llama-swap"].event_rate()
        goal(cps >= 0.6, f"SSE c=32 chunks/s: {cps:.2f}x llama-swap's (≥ 0.6x)")
        ttfb = s32.runs["gpuproxy"].ttfb_ms(0.5) - s32.runs["direct"].ttfb_ms(0.5)
        goal(ttfb <= 5, f"SSE c=32 added TTFB: {ttfb:.1f} ms (≤ 5 ms)")
    else:
        print("  (no llama-swap binary: the ratios against it are not measured)")
    errors = sum(r.errors for c in cases for r in c.runs.values())
    goal(errors == 0, f"errors: {errors} (goal 0)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="length of one round on one side (default 2)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="interleaved rounds per side and case (default 4)")
    parser.add_argument("--no-llamaswap", action="store_true",
                        help="leave llama-swap out even when its binary is there")
    parser.add_argument("--workers", type=int, default=1,
                        help="gpuproxy's `serve --workers N` (default 1, its default on a box "
                             "of at most 2 cores); every process of it is pinned and counted")
    parser.add_argument("--proxy-cpus", type=int, default=1,
                        help="pin each proxy to the first N CPUs (default 1); the client and "
                             "the upstreams get the others")
    parser.add_argument("--clients", type=int, default=1,
                        help="client processes sharing a case's connections (default 1; more "
                             "where one Python client cannot keep the proxies busy)")
    args = parser.parse_args()
    PROXY_CPUS.clear()
    PROXY_CPUS.update(sorted(os.sched_getaffinity(0))[:max(1, args.proxy_cpus)])
    if len(os.sched_getaffinity(0)) < 2:
        print("side_by_side: one CPU only: the proxy cannot be pinned apart (figures shared)")
    os.sched_setaffinity(0, other_cpus())  # the client, and the direct upstream it starts
    work = Path(tempfile.mkdtemp(prefix="gpuproxy-side-by-side-"))
    sides: list[Side] = []
    try:
        direct_port = free_port()
        fake = start_fake(direct_port)
        sides.append(Side("direct", direct_port, stop_hooks=[fake.terminate, fake.wait]))
        sides.append(start_gpuproxy(write_config(work / "gpuproxy.yaml"), work, args.workers))
        binary = None if args.no_llamaswap else llamaswap_binary()
        if binary is not None:
            sides.append(start_llamaswap(binary, write_config(work / "llama-swap.yaml"), work))
        for s in sides:
            if s.proc is not None:
                unpin_children(s.proc.pid)
        clients = Clients(args.clients)
        try:
            cases = asyncio.run(measure(sides, args.seconds, args.rounds, clients))
        finally:
            clients.close()
    finally:
        for s in reversed(sides):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(cases, [s.name for s in sides], args.seconds, args.rounds, args.workers,
           args.clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
