"""How should the proxy send its requests upstream?

Measures the client-side CPU per request (this process only: the fake upstream runs in its own
process) of four ways, all driving the same fake upstream in the same run, so the ratios are
meaningful on a noisy machine:

- `default`: httpx's `AsyncClient` with its own transport;
- `aiohttp`: `AsyncClient` over the `httpx-aiohttp` transport (the proxy until issue 17);
- `transport`: an `httpx.Request` handed straight to that transport's `handle_async_request`,
  URL parsed once (what `gpuproxy/upstream/relay.py` does now);
- `raw`: aiohttp's `ClientSession` alone, no httpx (a reference: httpx is the project's
  upstream client, so this is what that layer costs, not a candidate).

    .venv/bin/python bench/upstream_transport.py [--requests 2000]

Cases: non-streaming JSON at concurrency 1 and 32, and SSE streams of 100 chunks at
concurrency 1 and 32. The last lines print each way's CPU against `default` and against
`transport` (below 1 = cheaper).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
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


KINDS = ("default", "aiohttp", "transport", "raw")


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=10_000),
                                 cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                                 auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"))


def sender(kind: str, url: str, body: bytes
           ) -> tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[None]]]:
    """(send one request and read its answer, close) for one way of sending."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if kind in ("default", "aiohttp"):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(10.0, read=600.0)
        client = (httpx.AsyncClient(transport=AiohttpTransport(client=session, trust_env=False),
                                    timeout=timeout, trust_env=False) if kind == "aiohttp"
                  else httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False))

        async def via_client() -> int:
            resp = await client.send(client.build_request("POST", url, headers=headers,
                                                          content=body), stream=True)
            n = 0
            try:
                async for _chunk in resp.aiter_raw():
                    n += 1
            finally:
                await resp.aclose()
            return n

        return via_client, client.aclose
    if kind == "transport":
        transport = AiohttpTransport(client=session, trust_env=False)
        parsed = httpx.URL(url)
        ext = {"timeout": httpx.Timeout(10.0, read=600.0).as_dict()}

        async def via_transport() -> int:
            resp = await transport.handle_async_request(httpx.Request(
                "POST", parsed, headers=headers, content=body, extensions=ext))
            n = 0
            try:
                async for _chunk in resp.stream:  # type: ignore[union-attr]
                    n += 1
            finally:
                await resp.aclose()
            return n

        return via_transport, transport.aclose
    raw = session()
    to = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=600.0)
    str_headers = [(k.decode(), v.decode()) for k, v in headers]

    async def via_raw() -> int:
        resp = await raw.request("POST", url, headers=str_headers, data=body, timeout=to,
                                 allow_redirects=False)
        n = 0
        try:
            async for _chunk in resp.content.iter_any():
                n += 1
        finally:
            resp.release()
        return n

    return via_raw, raw.close


async def case(kind: str, base: str, stream: bool, concurrency: int, total: int
               ) -> tuple[float, float]:
    """(client CPU µs per request, wall seconds) for `total` requests."""
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 100 if stream else 8, "stream": stream}).encode()
    one, close = sender(kind, base + "/v1/chat/completions", body)
    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
    sem = asyncio.Semaphore(concurrency)

    async def limited() -> None:
        async with sem:
            await one()

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(total)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await close()
    return cpu / total * 1e6, wall


async def main(total: int) -> None:
    proc, base = start_fake()
    try:
        rows = []
        for stream in (False, True):
            n = total if not stream else max(total // 5, 50)
            for conc in (1, 32):
                result: dict[str, list[float]] = {k: [] for k in KINDS}
                for _ in range(2):  # interleaved, the lower of two: the machine is noisy
                    for kind in KINDS:
                        result[kind].append((await case(kind, base, stream, conc, n))[0])
                rows.append((("sse100" if stream else "json"), conc, n,
                             {k: min(v) for k, v in result.items()}))
    finally:
        proc.terminate()
        proc.wait()
    print(f"{'case':8} {'conc':>4} {'reqs':>5} " + " ".join(f"{k + ' µs/req':>17}" for k in KINDS))
    for name, conc, n, cpu in rows:
        print(f"{name:8} {conc:>4} {n:>5} " + " ".join(f"{cpu[k]:>17.0f}" for k in KINDS))
    for base_kind in ("default", "transport"):
        print(f"CPU per request against {base_kind}: " + "; ".join(
            f"{name}@c{conc} " + ", ".join(f"{k} {cpu[k] / cpu[base_kind]:.2f}" for k in KINDS
                                           if k != base_kind)
            for name, conc, _, cpu in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(parser.parse_args().requests))
