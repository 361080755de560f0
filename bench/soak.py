"""Soak: mixed-priority traffic with client disconnects and an upstream crash every minute,
against a real `gpuproxy serve`, watching for leaks and for lost requests.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 16] [--crash-every 60]

Not part of `make bench` (it takes ten minutes): run it with `make soak`. It prints a sample
table every 30 s (the proxy's RSS, open file descriptors, threads, asyncio tasks from
`gpuproxy_event_loop_tasks`, requests so far) and a summary: every request the clients sent is
in the activity log (`/api/activity/stats`), and tasks, descriptors and memory at the end
against the start of the steady state (after the first minute, once every model has loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PRIORITIES = ["interactive", "normal", "normal", "batch", "batch", None]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(start: int) -> str:
    fake = f"{sys.executable} -m gpuproxy.testing.fakellm --port ${{PORT}} --model ${{MODEL_ID}}"
    return textwrap.dedent(f"""
    startPort: {start}
    healthCheckTimeout: 30
    models:
      big-a:
        cmd: {fake} --tps 400 --load-seconds 0.5
        concurrencyLimit: 200
      big-b:
        cmd: {fake} --tps 400 --load-seconds 0.5
        concurrencyLimit: 200
      small:
        cmd: {fake} --tps 800
        concurrencyLimit: 200
    groups:
      big: {{swap: true, members: [big-a, big-b]}}
      always: {{swap: false, exclusive: false, persistent: true, members: [small]}}
    """)


def proc_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    threads = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("Threads"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"rss_kib": rss, "fds": fds, "threads": threads}


def loop_tasks(h: httpx.Client) -> int:
    for line in h.get("/metrics").text.splitlines():
        if line.startswith("gpuproxy_event_loop_tasks "):
            return int(float(line.split()[1]))
    return -1


class Counts:
    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.left = 0  # the client disconnected on purpose
        # ...so early that not all of its request had been written: no proxy can log that
        self.unsent = 0
        self.errors: dict[str, int] = {}


async def client(base: str, counts: Counts, stop: asyncio.Event, seed: int) -> None:
    rnd = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=120, trust_env=False) as h:
        while not stop.is_set():
            model = rnd.choice(["big-a", "big-b", "small", "small"])
            priority = rnd.choice(PRIORITIES)
            headers = {"X-LlamaSwap-Priority": priority} if priority else {}
            stream = rnd.random() < 0.6
            leave = rnd.random() < 0.15
            body = {"model": model, "stream": stream, "max_tokens": rnd.randint(4, 40),
                    "messages": [{"role": "user", "content": "soak"}]}
            counts.sent += 1
            try:
                if leave:  # gone while queued or mid-stream
                    written = False

                    async def trace(name: str, info: dict) -> None:
                        nonlocal written
                        if name == "http11.send_request_body.complete":
                            written = True

                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(rnd.uniform(0.1, 0.5)):
                            async with h.stream("POST", "/v1/chat/completions", json=body,
                                                headers=headers,
                                                extensions={"trace": trace}) as r:
                                async for _ in r.aiter_raw():
                                    pass
                    counts.left += 1
                    if not written:  # this very loop was too busy to write it in time
                        counts.unsent += 1
                        counts.sent -= 1
                    continue
                r = await h.post("/v1/chat/completions", json=body, headers=headers)
                if r.status_code == 200:
                    counts.answered += 1
                else:
                    key = str(r.status_code)
                    counts.errors[key] = counts.errors.get(key, 0) + 1
            except httpx.HTTPError as exc:
                key = type(exc).__name__
                counts.errors[key] = counts.errors.get(key, 0) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--crash-every", type=float, default=60.0)
    args = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="gpuproxy-soak-"))
    cfg = data / "config.yaml"
    cfg.write_text(config(free_port()))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(GPUPROXY_DATA_DIR=str(data), GPUPROXY_LOG_LEVEL="WARNING")
    log = (data / "serve.log").open("wb")
    serve = subprocess.Popen([str(Path(sys.executable).with_name("gpuproxy")), "serve",
                              "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
                             env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    h = httpx.Client(base_url=base, timeout=30, trust_env=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if h.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or serve.poll() is not None:
            sys.exit(f"serve did not start: see {data / 'serve.log'}")
        time.sleep(0.1)

    counts = Counts()
    samples: list[tuple[float, dict[str, int]]] = []
    crashes = 0

    async def drive() -> None:
        nonlocal crashes
        stop = asyncio.Event()
        workers = [asyncio.create_task(client(base, counts, stop, i))
                   for i in range(args.clients)]
        started = time.monotonic()
        next_crash = started + args.crash_every
        next_sample = started
        print(f"{'t (s)':>6} {'rss MiB':>8} {'fds':>5} {'threads':>7} {'tasks':>6} "
              f"{'sent':>7} {'answered':>8} {'left':>5} errors")
        while time.monotonic() - started < args.minutes * 60:
            await asyncio.sleep(1)
            now = time.monotonic()
            if now >= next_crash:
                next_crash += args.crash_every
                running = await asyncio.to_thread(lambda: h.get("/running").json()["running"])
                big = [m for m in running if m["model"].startswith("big") and m["pid"]]
                if big:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(big[0]["pid"], signal.SIGKILL)
                    crashes += 1
            if now >= next_sample:
                next_sample += 30
                fig = proc_figures(serve.pid)
                fig["tasks"] = await asyncio.to_thread(loop_tasks, h)
                samples.append((now - started, fig))
                print(f"{now - started:6.0f} {fig['rss_kib'] / 1024:8.1f} {fig['fds']:5d} "
                      f"{fig['threads']:7d} {fig['tasks']:6d} {counts.sent:7d} "
                      f"{counts.answered:8d} {counts.left:5d} {counts.errors}", flush=True)
        stop.set()
        await asyncio.gather(*workers)

    asyncio.run(drive())
    # quiet: let the proxy finish and write its activity rows
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        q = h.get("/api/queue").json()
        stats = h.get("/api/activity/stats", params={"since": "1d"}).json()
        if not q["queued"] and not q["in_flight"] and stats["total"] >= counts.sent:
            break
        time.sleep(0.5)
    time.sleep(3)  # the loop's task count is refreshed every couple of seconds
    end = proc_figures(serve.pid)
    end["tasks"] = loop_tasks(h)
    stats = h.get("/api/activity/stats", params={"since": "1d"}).json()
    serve.send_signal(signal.SIGTERM)
    serve.wait(60)

    steady = next((f for t, f in samples if t >= 60), samples[0][1])
    logged = stats["total"]
    outcomes = {k: v for k, v in stats["outcomes"].items() if v}
    print()
    print(f"{args.minutes:g} min, {args.clients} clients, {crashes} upstream crashes "
          f"(SIGKILL every {args.crash_every:g} s)")
    print(f"requests sent {counts.sent}: answered 200 {counts.answered}, left on purpose "
          f"{counts.left}, other {sum(counts.errors.values())} {counts.errors}")
    print(f"(and {counts.unsent} left before their request was all written: not counted as "
          "sent, since no proxy could see them)")
    print(f"activity log: {logged} rows {outcomes}")
    print(f"at the end vs at 60 s: rss {steady['rss_kib'] / 1024:.1f} -> "
          f"{end['rss_kib'] / 1024:.1f} MiB, fds {steady['fds']} -> {end['fds']}, threads "
          f"{steady['threads']} -> {end['threads']}, asyncio tasks {steady['tasks']} -> "
          f"{end['tasks']} (idle)")
    accounted = "PASS" if logged == counts.sent else "FAIL"
    print(f"  {accounted}  every request in the activity log: {logged} of {counts.sent}")
    growth = (end["rss_kib"] - steady["rss_kib"]) / max(steady["rss_kib"], 1)
    print(f"ratios: logged/sent={logged / max(counts.sent, 1):.3f}, "
          f"rss end/steady={1 + growth:.2f}, fds end-steady={end['fds'] - steady['fds']:+d}, "
          f"tasks end={end['tasks']}")


if __name__ == "__main__":
    main()
