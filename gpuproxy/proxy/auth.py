"""API keys, checked the same way on every path: Bearer, X-Api-Key, or a Basic password.

Keys are stored as SHA-256 hashes; the presented key is hashed and compared with every stored
hash in constant time, so timing tells nothing about which prefix matched. A key is an admin
key or not (`ApiKey.admin`); what each may reach is docs/security.md's "Who can do what".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gpuproxy.upstream import relay

WWW_AUTHENTICATE = 'Bearer realm="gpuproxy", Basic realm="gpuproxy"'
# The refusals' words, one spelling for the edge, Django's views and the proxy consumer.
KEY_REQUIRED = "a valid API key is required: send Authorization: Bearer <key>"


def admin_required(path: str) -> str:
    shown = path if len(path) <= 100 else path[:100] + "…"
    return (f"{shown} needs an admin API key, and this key is not one: admin keys reach the "
            "management API, /logs, /upstream/… and the commands in /running; mark the key "
            "admin in the admin (API keys) or with `admin: true` under apiKeyHashes in the "
            "config")


@dataclass(frozen=True)
class Caller:
    """Who presented a valid key: the key's name (the activity log's client) and its rank."""

    name: str
    admin: bool
    key: str = field(default="", repr=False, compare=False)  # what was presented (never shown)


@dataclass(frozen=True)
class KeyRefusal:
    """Why a request is refused for its key: 401 without a valid one, 403 when the path is for
    admin keys. The edge, the API views and the proxy consumer each render it their way."""

    status: int
    code: str
    message: str
    type: str
    headers: dict[str, str] = field(default_factory=dict)
    caller: Caller | None = None  # a 403's: the key is valid, only not an admin's


def authorize(authorization: str, x_api_key: str, api_keys: Mapping[str, str],
              admin_keys: Collection[str], *, admin: bool, path: str) -> Caller | KeyRefusal:
    """The one key check (keys are defined): who calls, or why they may not. `admin`: the
    path is for admin keys."""
    key = presented_key(authorization, x_api_key)
    who = caller(key, api_keys, admin_keys)
    if who is None or key is None:
        return KeyRefusal(401, "invalid_api_key", KEY_REQUIRED, "authentication_error",
                          {"WWW-Authenticate": WWW_AUTHENTICATE})
    if admin and not who.admin:
        return KeyRefusal(403, "admin_key_required", admin_required(path), "permission_error",
                          caller=who)
    return Caller(who.name, who.admin, key)


def presented_key(authorization: str, x_api_key: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer" and value.strip():
        return value.strip()
    if scheme == "basic" and value.strip():
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return x_api_key.strip() or None


def caller(key: str | None, api_keys: Mapping[str, str],
           admin_keys: Collection[str]) -> Caller | None:
    """The key's holder, or None. `api_keys` maps sha256 hex -> name; `admin_keys` holds the
    hashes of the admin keys."""
    if not key:
        return None
    digest = hashlib.sha256(key.encode()).hexdigest()
    found = None
    for stored, name in api_keys.items():
        if hmac.compare_digest(stored, digest):
            found = Caller(name, stored in admin_keys)
    return found


def key_name(key: str | None, api_keys: Mapping[str, str]) -> str | None:
    """The name of the matching key, or None. `api_keys` maps sha256 hex -> name."""
    found = caller(key, api_keys, ())
    return found.name if found is not None else None


#: Never sent to an upstream or a peer, whoever the caller: Django's CSRF token header (the
#: playground's; gpuproxy/proxy/staff_session.py).
NEVER_FORWARDED = frozenset({b"x-csrftoken"})


def own_cookies() -> frozenset[bytes]:
    """The proxy's own cookies (the admin's session, its CSRF token): kept from every
    upstream and peer, which would otherwise hold a staff member's login (an upstream's web
    UI opened through `/upstream/<model>/` runs on this origin and gets them too). Other
    cookies, the upstream's own, still go."""
    from django.conf import settings

    return frozenset({settings.SESSION_COOKIE_NAME.encode("latin-1"),
                      settings.CSRF_COOKIE_NAME.encode("latin-1")})


def credential_drop(headers: dict[bytes, bytes], key: str) -> frozenset[bytes]:
    """relay.HOP_BY_HOP plus the headers that carried `key`, the gpuproxy API key the request was
    let in with: the proxy's credential, not the upstream's (another credential in the other
    header, say `X-Api-Key` for the upstream's own auth, still goes through)."""
    drop = {b"authorization"} if _carries(headers.get(b"authorization", b""), key) else set()
    if headers.get(b"x-api-key", b"").strip() == key.encode("latin-1", "replace"):
        drop.add(b"x-api-key")
    return relay.HOP_BY_HOP | drop


def _carries(authorization: bytes, key: str) -> bool:
    return presented_key(authorization.decode("latin-1"), "") == key
