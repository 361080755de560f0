"""The client's address behind reverse proxies: `X-Forwarded-For` and `Forwarded` (RFC 7239)
read only when the TCP peer is one of `GPUPROXY_TRUSTED_PROXIES`.

Anyone can send those headers, so believing them from any peer would let a client write
whatever address it likes into the activity log (docs/security.md). Behind a trusted proxy,
the chain is read from the right, where the hops we trust appended their peers: the first
address that is not itself a trusted proxy is the client. Everything left of it was written by
the client or by proxies we do not know, and is ignored. An entry that is not an address
(`unknown`, an obfuscated `_name`, garbage) stops the walk: the last address reached, a
trusted proxy's, is all that is known. `Forwarded` is read when present, else
`X-Forwarded-For`; repeated header lines are one list, in order.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any

from django.conf import settings

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

__all__ = ["client_ip", "from_twisted", "parse_trusted", "resolve"]


def parse_trusted(value: str) -> tuple[Network, ...]:
    """`10.0.0.1, 10.1.0.0/16, ::1`: addresses and CIDR networks, comma-separated. Raises
    ValueError naming the entry that is neither."""
    networks = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or a CIDR network "
                             "(10.0.0.1, 10.0.0.0/8, ::1, fd00::/8)") from None
    return tuple(networks)


def _address(text: str) -> Address | None:
    """An address as a forwarding header writes it: `1.2.3.4`, `1.2.3.4:80`, `::1`,
    `[::1]`, `[::1]:80`; an IPv4-mapped IPv6 address as its IPv4 one. None for the rest."""
    text = text.strip().strip('"').strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not text[end + 1:].startswith(":")):
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port (an IPv6 address has two colons or more)
        text = text.split(":", 1)[0]
    if "%" in text:  # a zone id says nothing about the client
        text = text.split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _split_quoted(text: str, separator: str) -> list[str]:
    """`text` split on `separator` outside double quotes (RFC 7230 quoted-string, with
    backslash escapes)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def forwarded_for(values: Iterable[str]) -> list[str]:
    """The `for=` node of each element of RFC 7239 `Forwarded` header values, in order; an
    element without one is an empty string (not an address: it stops the walk)."""
    nodes = []
    for value in values:
        for element in _split_quoted(value, ","):
            if not element.strip():
                continue
            node = ""
            for pair in _split_quoted(element, ";"):
                name, _, val = pair.partition("=")
                if name.strip().lower() == "for":
                    node = val.strip()
            nodes.append(node)
    return nodes


def resolve(peer: str, chain: Sequence[str], trusted: Sequence[Network]) -> str:
    """The client's address: `peer` unless it is trusted, then the rightmost `chain` entry
    that is not a trusted proxy (`chain`: the forwarding header's entries, client first)."""
    current = _address(peer)
    if current is None or not trusted:
        return peer
    for entry in reversed(chain):
        if not any(current in network for network in trusted):
            break
        found = _address(entry)
        if found is None:
            break
        current = found
    return str(current)


def client_ip(scope: dict[str, Any]) -> str:
    """The client's address for an ASGI request scope (the activity row's `client_ip`, and
    its `client` while no API key names the caller); "" without a peer (a Unix socket)."""
    peer = (scope.get("client") or ("", 0))[0] or ""
    trusted: Sequence[Network] = getattr(settings, "GPUPROXY_TRUSTED_PROXIES", ())
    if not trusted or not peer:
        return peer
    forwarded: list[str] = []
    xff: list[str] = []
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"forwarded":
            forwarded.append(value.decode("latin-1"))
        elif name == b"x-forwarded-for":
            xff.append(value.decode("latin-1"))
    if forwarded:
        chain = forwarded_for(forwarded)
    else:
        chain = [entry for value in xff for entry in value.split(",")]
    return resolve(peer, chain, trusted)


def from_twisted(peer: Any, request: Any) -> str:
    """The same for a request refused at the edge (gpuproxy/proxy/edge.py), before there is a
    scope: Twisted's peer address and request headers."""
    headers = [(name.lower(), value)
               for name, values in request.requestHeaders.getAllRawHeaders() for value in values]
    return client_ip({"client": (getattr(peer, "host", "") or "", 0), "headers": headers})
