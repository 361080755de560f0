"""The `apiKeys` (plain) and `apiKeyHashes` (name + SHA-256) sections: keys checked for
duplicates and names, and an exported plain key's `admin:`, `peer:` (a trusted peer,
whose forwarded priority and arrival time are believed) and `priority:` (its range, see
`read_priority_range`) told apart from a new key.
"""

from __future__ import annotations

import hashlib
import re

from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import API_KEY_NAME_MAX, ParsedApiKey, api_key_name
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.values import describe

Range = tuple[int | None, int | None, int | None]  # (min, max, default); None: unset
_BOUNDS = ("min", "max", "default")
_ALIASES = {"interactive": 100, "normal": 0, "batch": -100}  # scheduling/core/priority.py's
_INT64 = (-(2**63), 2**63 - 1)


def read_priority_range(r: Reader, value: object, where: str) -> Range:
    """`priority: {min, max, default}` (gpuproxy): each an integer or a band alias
    (interactive, normal, batch), absent or null for no bound / no default; a min above the
    max, or a default outside them, is refused here with the path rather than at save."""
    raw = r.mapping(value, where)
    r.known_keys(raw, where, frozenset(_BOUNDS))
    out: list[int | None] = []
    for bound in _BOUNDS:
        v = raw.get(bound)
        if isinstance(v, str) and v.lower() in _ALIASES:
            v = _ALIASES[v.lower()]
        elif v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                or not _INT64[0] <= v <= _INT64[1]):
            raise ConfigError(f"{where}.{bound}", f"expected a signed 64-bit integer or one of "
                                                  f"interactive, normal, batch; got {describe(v)}")
        out.append(v)
    lo, hi, default = out
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"{where}.max", f"{hi} is below min {lo}: no priority would fit")
    if default is not None and ((lo is not None and default < lo)
                                or (hi is not None and default > hi)):
        raise ConfigError(f"{where}.default", f"{default} lies outside min..max; set it "
                                              "inside the range")
    return lo, hi, default


def export_priority_range(rng: Range) -> dict[str, int]:
    """The `priority:` mapping for a range, unset values left out ({} for none)."""
    return {b: v for b, v in zip(_BOUNDS, rng, strict=True) if v is not None}

_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


def read_api_keys(r: Reader) -> tuple[tuple[str, ...], tuple[ParsedApiKey, ...],
                                      dict[str, bool], dict[str, bool], dict[str, Range]]:
    """`apiKeys` and `apiKeyHashes`: (plain keys, hashed keys, {sha256: admin},
    {sha256: trusted peer} and {sha256: priority range} of exported plain keys listed beside
    the key)."""
    plain: list[str] = []
    first_at: dict[str, int] = {}  # sha256 -> index in apiKeys
    names: dict[str, str] = {}  # name -> where it was given
    for i, key in enumerate(r.strings(r.data.get("apiKeys"), "apiKeys")):
        where = f"apiKeys[{i}]"
        if not key or any(c.isspace() for c in key):
            raise ConfigError(where, "an API key must be non-empty and contain no spaces")
        r.no_macros(key, where)
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest in first_at:
            r.warn(where, f"the same key as apiKeys[{first_at[digest]}]; kept once")
            continue
        name = api_key_name(key)
        if name in names:
            raise ConfigError(where, f"two keys share the name {name}; list one of them "
                                     "under apiKeyHashes with its own name")
        first_at[digest] = i
        names[name] = where
        plain.append(key)
    hashed: list[ParsedApiKey] = []
    plain_admin: dict[str, bool] = {}
    plain_peer: dict[str, bool] = {}
    plain_priority: dict[str, Range] = {}
    plain_names = {api_key_name(k): h for k, h in zip(plain, first_at, strict=True)}
    seen_hashes = set(first_at)
    for i, raw in enumerate(r.seq(r.data.get("apiKeyHashes"), "apiKeyHashes")):
        where = f"apiKeyHashes[{i}]"
        raw = r.mapping(raw, where)
        r.known_keys(raw, where, frozenset({"name", "sha256", "prefix", "admin", "peer",
                                                  "priority"}))
        admin = (None if raw.get("admin") is None
                 else r.boolean(raw.get("admin"), f"{where}.admin", False))
        peer = (None if raw.get("peer") is None
                else r.boolean(raw.get("peer"), f"{where}.peer", False))
        priority = (None if "priority" not in raw
                    else read_priority_range(r, raw["priority"], f"{where}.priority"))
        name = r.text(raw.get("name"), f"{where}.name")
        digest = r.text(raw.get("sha256"), f"{where}.sha256").lower()
        if not name or name != name.strip() or len(name) > API_KEY_NAME_MAX:
            raise ConfigError(f"{where}.name", f"required: who uses this key, 1.."
                                               f"{API_KEY_NAME_MAX} characters")
        if not _SHA256.match(digest):
            raise ConfigError(f"{where}.sha256", "required: the key's SHA-256 as 64 hex "
                                                 "digits (printf %s KEY | sha256sum)")
        prefix = raw.get("prefix")
        if prefix is not None:
            prefix = r.text(prefix, f"{where}.prefix")
            if len(prefix) > 12:
                raise ConfigError(f"{where}.prefix", "at most 12 characters")
        if plain_names.get(name) == digest:
            # an export of a plain key listed next to the key itself: only its rank counts
            if admin is not None:
                plain_admin[digest] = admin
            if peer is not None:
                plain_peer[digest] = peer
            if priority is not None:
                plain_priority[digest] = priority
            continue
        if digest in seen_hashes:
            raise ConfigError(f"{where}.sha256", "the same key is already listed (under "
                                                 "apiKeys or apiKeyHashes); list it once")
        if name in names:
            raise ConfigError(f"{where}.name", f"{name!r} is already used by {names[name]}; "
                                               "key names must be unique")
        seen_hashes.add(digest)
        names[name] = where
        hashed.append(ParsedApiKey(name=name, sha256=digest, prefix=prefix, admin=admin,
                                   peer=peer, priority=priority))
    return tuple(plain), tuple(hashed), plain_admin, plain_peer, plain_priority
