"""The upstream HTTP client: one pooled httpx client for all upstreams, timeouts fit for LLMs.

Connect is short (the upstream is local and was just health-checked); the read timeout is per
socket read, so it bounds the wait for the first token and any silence mid-stream, not the
length of a generation. Bytes are relayed raw (no decompression, no re-chunking).
"""

from __future__ import annotations

import httpx

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0  # longest time-to-first-token or silence we accept from an upstream

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
RESPONSE_DROP = HOP_BY_HOP - {b"content-length"}

_client: httpx.AsyncClient | None = None


def client() -> httpx.AsyncClient:
    """The shared client; created lazily in the serving loop."""
    global _client
    if _client is None:
        _client = httpx.AsyncClient(
            timeout=httpx.Timeout(CONNECT_TIMEOUT, read=READ_TIMEOUT, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=30.0),
            trust_env=False,  # a system HTTP proxy must never sit between us and localhost
            follow_redirects=False,
        )
    return _client


async def close() -> None:
    global _client
    if _client is not None:
        await _client.aclose()
        _client = None


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
