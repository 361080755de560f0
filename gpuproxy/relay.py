"""The upstream HTTP client: one pooled httpx client for all upstreams, timeouts fit for LLMs.

Connect is short (the upstream is local and was just health-checked); the read timeout is per
socket read, so it bounds the wait for the first token and any silence mid-stream, not the
length of a generation. Bytes are relayed raw (no decompression, no re-chunking).

The transport is aiohttp's, behind httpx's API (`httpx-aiohttp`): httpx's own transport cost
1.6-9x more proxy CPU per request here (`bench/upstream_transport.py`, encode/httpx#3215).
"""

from __future__ import annotations

import asyncio
from http.cookiejar import CookieJar

import httpx
from httpx_aiohttp import AiohttpTransport

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0  # longest time-to-first-token or silence we accept from an upstream

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
# The upstream's `Server` (llama.cpp, uvicorn and their versions) is not the client's business:
# the answer comes from gpuproxy, which names itself.
RESPONSE_DROP = (HOP_BY_HOP - {b"content-length"}) | {b"server", b"x-powered-by"}

class _NoCookies(CookieJar):
    """Upstreams set no cookies worth keeping, and a proxy must not carry one client's
    cookies to the next. httpx consults its jar on every request and response, parsing the
    headers with the `email` package: 5 % of the proxy's CPU per request (BENCHMARKS.md)."""

    def add_cookie_header(self, request: object) -> None:
        return None

    def extract_cookies(self, response: object, request: object) -> None:
        return None


_client: httpx.AsyncClient | None = None
_client_loop: asyncio.AbstractEventLoop | None = None


def client() -> httpx.AsyncClient:
    """The shared client, created lazily for the running loop (its pool belongs to it)."""
    global _client, _client_loop
    loop = asyncio.get_running_loop()
    if _client is None or _client_loop is not loop:
        _client_loop = loop
        # aiohttp caps connections at 100 unless told: the scheduler is the real limit.
        limits = httpx.Limits(max_connections=10_000, max_keepalive_connections=256,
                              keepalive_expiry=30.0)
        _client = httpx.AsyncClient(
            # trust_env off: a system HTTP proxy must never sit between us and localhost
            transport=AiohttpTransport(limits=limits, trust_env=False),
            timeout=httpx.Timeout(CONNECT_TIMEOUT, read=READ_TIMEOUT, write=60.0, pool=None),
            trust_env=False,
            follow_redirects=False,
            cookies=_NoCookies(),
        )
    return _client


def timeout(idle: float) -> httpx.Timeout:
    """A request's timeouts with `idle` as the longest silence (first byte or mid-stream)."""
    return httpx.Timeout(CONNECT_TIMEOUT, read=idle, write=60.0, pool=None)


async def close() -> None:
    global _client, _client_loop
    if _client is not None and _client_loop is asyncio.get_running_loop():
        await _client.aclose()
    _client = _client_loop = None


def request_headers(headers: list[tuple[bytes, bytes]], body_len: int
                    ) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
    out.append((b"content-length", str(body_len).encode()))
    return out


def response_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in headers.raw if k.lower() not in RESPONSE_DROP]
    if headers.get("content-type", "").startswith("text/event-stream"):
        out.append((b"x-accel-buffering", b"no"))
    return out
