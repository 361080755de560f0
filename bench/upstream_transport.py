"""Which httpx transport should the proxy use towards its upstreams?

Measures the client-side CPU per request (this process only: the fake upstream runs in its own
process) for httpx's default transport and for the `httpx-aiohttp` transport, both driving the
same fake upstream in the same run, so the ratio is meaningful on a noisy machine.

    .venv/bin/python bench/upstream_transport.py [--requests 2000]

Cases: non-streaming JSON at concurrency 1 and 32, and SSE streams of 100 chunks at
concurrency 1 and 32. The last line prints aiohttp / default CPU ratios (below 1 = aiohttp
cheaper).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx

try:
    from httpx_aiohttp import AiohttpTransport
except ImportError:  # pragma: no cover - the bench says what to install
    sys.exit("bench/upstream_transport.py needs httpx-aiohttp: pip install httpx-aiohttp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fake() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait for "loaded": an event, not a sleep
        if "loaded" in line:
            break
    return proc, f"http://127.0.0.1:{port}"


def make_client(kind: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(10.0, read=600.0)
    if kind == "aiohttp":
        return httpx.AsyncClient(transport=AiohttpTransport(limits=limits, trust_env=False),
                                 timeout=timeout, trust_env=False)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def one(client: httpx.AsyncClient, base: str, stream: bool) -> int:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100 if stream else 8, "stream": stream}
    req = client.build_request("POST", base + "/v1/chat/completions",
                               content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    resp = await client.send(req, stream=True)
    n = 0
    try:
        async for _chunk in resp.aiter_raw():
            n += 1
    finally:
        await resp.aclose()
    return n


async def case(kind: str, base: str, stream: bool, concurrency: int, total: int
               ) -> tuple[float, float]:
    """(client CPU µs per request, wall seconds) for `total` requests."""
    client = make_client(kind)
    await asyncio.gather(*(one(client, base, stream) for _ in range(concurrency)))  # warm-up
    sem = asyncio.Semaphore(concurrency)

    async def limited() -> None:
        async with sem:
            await one(client, base, stream)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(total)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await client.aclose()
    return cpu / total * 1e6, wall


async def main(total: int) -> None:
    proc, base = start_fake()
    try:
        rows = []
        for stream in (False, True):
            n = total if not stream else max(total // 5, 50)
            for conc in (1, 32):
                result = {}
                for kind in ("default", "aiohttp"):
                    result[kind] = await case(kind, base, stream, conc, n)
                rows.append((("sse100" if stream else "json"), conc, n, result))
    finally:
        proc.terminate()
        proc.wait()
    print(f"{'case':8} {'conc':>4} {'reqs':>5} {'default µs/req':>15} {'aiohttp µs/req':>15} "
          f"{'ratio':>6}")
    ratios = []
    for name, conc, n, result in rows:
        d, a = result["default"][0], result["aiohttp"][0]
        ratios.append(a / d)
        print(f"{name:8} {conc:>4} {n:>5} {d:>15.0f} {a:>15.0f} {a / d:>6.2f}")
    print("aiohttp/default CPU per request: " + ", ".join(
        f"{name}@c{conc}={r:.2f}" for (name, conc, _, _), r in zip(rows, ratios, strict=True)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(parser.parse_args().requests))
