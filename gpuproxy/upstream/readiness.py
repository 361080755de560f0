"""Whether an upstream may start, and when it is ready: its port, then its health endpoint.

Before a start, something else already listening on the model's local port fails it at once
(`port_holder`): its server would exit with "address already in use" while the stranger
answered the health check and then served the model's traffic. After the spawn, `poll_health`
GETs the health endpoint until a 200 or the deadline. Both are plain functions of the spec and
the clock that never touch an upstream's state: the start awaits `port_holder`'s answer, and
`poll_health` reports through the callbacks it is given (events on the owner's queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from gpuproxy.upstream.orphans import command_of
from gpuproxy.upstream.states import clip
from scheduling.spec import UpstreamSpec

HEALTH_POLL_INTERVAL = 0.05  # llama-swap polls once a second; readiness must show within 100 ms
HEALTH_TRY_TIMEOUT = 1.0  # one health GET; a wedged upstream must not stall the poll for long
PORT_PROBE_TIMEOUT = 0.5  # connecting to the model's port before a start


def port_of(proxy: str) -> int | None:
    try:
        parts = urlsplit(proxy)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def _local_addresses(proxy: str) -> list[str]:
    """Where to probe the model's port from here: its proxy URL's host when that is this
    machine (localhost, a loopback or unspecified address, one of our interfaces' addresses);
    empty for anything else (a remote server, a name we would have to resolve)."""
    try:
        host = urlsplit(proxy).hostname
    except ValueError:
        return []
    if host is None:
        return []
    if host == "localhost":
        return ["127.0.0.1", "::1"]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return []
    if ip.is_unspecified:
        return ["127.0.0.1" if ip.version == 4 else "::1"]
    if ip.is_loopback:
        return [str(ip)]
    import psutil  # type: ignore[import-untyped]  # no stubs installed (types-psutil)

    ours = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return [str(ip)] if str(ip) in ours else []


def _listener_of(port: int) -> str:
    """Who listens on `port`, for a person: pid and command (psutil maps the socket to its
    process), or a sentence saying it cannot be seen (another user's, another namespace)."""
    import psutil  # (untyped: mypy reports it once, above)

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        conns = []
    pids = sorted({c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr
                   and c.laddr.port == port and c.pid})
    if not pids:
        return "a process this proxy cannot see (another user's, or a container's)"
    return ", ".join(f"pid {pid} ({clip(command_of(pid), 200)})" for pid in pids)


async def port_holder(spec: UpstreamSpec) -> tuple[int, str] | None:
    """(port, who holds it) when something already listens on the model's local port.

    Its server would exit with "address already in use" while the health check passed,
    answered by the stranger, which would then serve the model's traffic. Only a
    connection that is accepted counts (a port in TIME_WAIT after our own stop is free)."""
    port = port_of(spec.proxy)
    if port is None:
        return None
    for address in await asyncio.to_thread(_local_addresses, spec.proxy):
        try:
            async with asyncio.timeout(PORT_PROBE_TIMEOUT):
                _, writer = await asyncio.open_connection(address, port)
        except (OSError, TimeoutError):
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return port, await asyncio.to_thread(_listener_of, port)
    return None


async def poll_health(url: str, deadline: float, now: Callable[[], float],
                      healthy: Callable[[], None], timed_out: Callable[[str], None]) -> None:
    """GET `url` until it answers 200, then call `healthy()`; or, once `deadline` (in
    `now()`'s clock) has passed, `timed_out()` with what the last probe saw."""
    last = "no answer yet"
    timeout = httpx.Timeout(HEALTH_TRY_TIMEOUT)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout) as client:
        while True:
            try:
                response = await client.get(url)
            except httpx.ConnectError:
                last = "connection refused"
            except httpx.TimeoutException:
                last = f"no answer within {HEALTH_TRY_TIMEOUT:g} s"
            except httpx.HTTPError as exc:
                last = f"last error: {type(exc).__name__}"
            else:
                if response.status_code == 200:
                    healthy()
                    return
                last = f"last answer: HTTP {response.status_code}"
            remaining = deadline - now()
            if remaining <= 0:
                timed_out(last)
                return
            await asyncio.sleep(min(HEALTH_POLL_INTERVAL, remaining))
