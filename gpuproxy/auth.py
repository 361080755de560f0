"""API keys, checked the same way on every path: Bearer, X-Api-Key, or a Basic password.

Keys are stored as SHA-256 hashes; the presented key is hashed and compared with every stored
hash in constant time, so timing tells nothing about which prefix matched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

WWW_AUTHENTICATE = 'Bearer realm="gpuproxy", Basic realm="gpuproxy"'


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


def key_name(key: str | None, api_keys: Mapping[str, str]) -> str | None:
    """The name of the matching key, or None. `api_keys` maps sha256 hex -> name."""
    if not key:
        return None
    digest = hashlib.sha256(key.encode()).hexdigest()
    found = None
    for stored, name in api_keys.items():
        if hmac.compare_digest(stored, digest):
            found = name
    return found
