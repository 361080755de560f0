"""What an export needs to write a config back as it was written, not only as it was read.

The database holds expanded values: a model's `cmd` with its macros filled in, an API key's
hash where the file said `${env.KEY}`, the preload list without the names that were no model.
At import, `capture` keeps beside them the file's own text of each value that used a macro or
an environment reference, and the entries that name no model; at export, `restore` writes
that text back wherever the value is still the one imported. A value edited in the admin
since is written expanded: its macro no longer describes it.

Pure (no Django, no database): the importer passes the data in and stores the result in
`ConfigImport.meaning`. No secret is kept: a value is remembered by its SHA-256, a key by
its reference (`${env.KEY}`), never by what the reference held.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduling.llamaswap import ParsedConfig
from scheduling.llamaswap.loading import ENV_REF


def digest(value: Any) -> str:
    """A value's fingerprint as the export writes it (JSON, key order ignored)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()
                          ).hexdigest()


def _uses_refs(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, list):
        return any(_uses_refs(v) for v in value)
    if isinstance(value, dict):
        return any(_uses_refs(k) or _uses_refs(v) for k, v in value.items())
    return False


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def capture(raw: Mapping[str, Any], parsed: ParsedConfig, plain: Mapping[str, Any],
            env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The meaning of one import: `raw` is the document as written (sources.raw_document),
    `plain` the export of the database right after the import (exporter.plain_export)."""
    env = os.environ if env is None else env
    meaning: dict[str, Any] = {}
    if isinstance(raw.get("macros"), dict) and raw["macros"]:
        meaning["macros"] = raw["macros"]
    models: dict[str, Any] = {}
    raw_models = raw.get("models") if isinstance(raw.get("models"), dict) else {}
    plain_models = plain.get("models") or {}
    for model_id, entry in (raw_models or {}).items():
        if not isinstance(entry, dict) or model_id not in plain_models:
            continue
        values = {key: {"raw": value, "sha256": digest(plain_models[model_id].get(key))}
                  for key, value in entry.items() if key != "macros" and _uses_refs(value)}
        if values:
            models[model_id] = {"values": values}
            if isinstance(entry.get("macros"), dict) and entry["macros"]:
                models[model_id]["macros"] = entry["macros"]
    if models:
        meaning["models"] = models
    peers = {}
    plain_peers = plain.get("peers") or {}
    raw_peers = raw.get("peers") if isinstance(raw.get("peers"), dict) else {}
    for peer_id, entry in (raw_peers or {}).items():
        if isinstance(entry, dict) and peer_id in plain_peers:
            # the apiKey as `${env.X}`: the reference is written back, never the key
            values = {key: {"raw": value, "sha256": digest(plain_peers[peer_id].get(key))}
                      for key, value in entry.items() if _uses_refs(value)}
            if values:
                peers[peer_id] = values
    if peers:
        meaning["peers"] = peers
    keys = []
    for entry in raw.get("apiKeys") or []:
        # only a whole reference: "sk-${env.X}" would keep part of the key in the database
        if isinstance(entry, str) and (ref := ENV_REF.fullmatch(entry.strip())):
            value = env.get(ref.group(1), "")
            keys.append({"ref": entry.strip(),
                         "sha256": hashlib.sha256(value.encode()).hexdigest()})
    if keys:
        meaning["api_keys"] = keys
    preload = _get(raw, "hooks", "on_startup", "preload")
    if isinstance(preload, list) and preload:
        meaning["preload"] = {"raw": preload, "resolved": list(parsed.settings.preload)}
    priority = _get(raw, "routing", "scheduler", "settings", "fifo", "priority")
    if isinstance(priority, dict) and priority:
        meaning["fifo"] = {"raw": priority, "resolved": {
            m.model_id: m.fifo_priority for m in parsed.models if m.fifo_priority}}
    raw_groups = raw.get("groups") or _get(raw, "routing", "router", "settings", "groups")
    if isinstance(raw_groups, dict):
        groups = {}
        for group in parsed.groups:
            members = _get(raw_groups, group.group_id, "members")
            if isinstance(members, list):
                groups[group.group_id] = {"raw": members, "resolved": list(group.members)}
        if groups:
            meaning["groups"] = groups
    return meaning


@dataclass(frozen=True)
class ExportKey:
    """One API key row as the export sees it: never its value, which is not stored."""

    name: str
    sha256: str
    prefix: str
    admin: bool
    peer: bool = False  # a trusted peer (`peer: true`)
    priority: dict[str, int] = field(default_factory=dict)  # `priority: {min, max, default}`


@dataclass
class Restored:
    """`restore`'s result: the document, the `apiKeys` entries (references), the keys that
    could not be written (for the placeholder and the warning), and the warnings."""

    data: dict[str, Any]
    api_keys: list[str] = field(default_factory=list)
    unwritable: list[ExportKey] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _known_names(models: Mapping[str, Any]) -> set[str]:
    names = set(models)
    for entry in models.values():
        names.update(entry.get("aliases") or [])
        names.update((entry.get("filters") or {}).get("setParamsByID") or {})
    return names


def restore(plain: dict[str, Any], meaning: Mapping[str, Any],
            keys: list[ExportKey]) -> Restored:
    """`plain` (the database's export) with the imported text put back where it still
    holds, the entries naming no model added back, and the keys sorted into references
    and placeholders."""
    data = {k: v for k, v in plain.items() if k != "apiKeyHashes"}
    models: dict[str, Any] = {k: dict(v) for k, v in (plain.get("models") or {}).items()}
    any_restored = False
    for model_id, kept in (meaning.get("models") or {}).items():
        entry = models.get(model_id)
        if entry is None:
            continue
        restored = {key: v["raw"] for key, v in kept["values"].items()
                    if digest(entry.get(key)) == v["sha256"]}
        if not restored:
            continue
        any_restored = True
        head = {"macros": kept["macros"]} if kept.get("macros") else {}
        models[model_id] = {**head, **{k: restored.get(k, v) for k, v in entry.items()},
                            **{k: v for k, v in restored.items() if k not in entry}}
    for peer_id, kept_values in (meaning.get("peers") or {}).items():
        peer = (data.get("peers") or {}).get(peer_id)
        if peer is not None:
            peer.update({key: v["raw"] for key, v in kept_values.items()
                         if digest(peer.get(key)) == v["sha256"]})
    known = _known_names(models)
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name == "models" and any_restored and meaning.get("macros"):
            out["macros"] = meaning["macros"]
        out[name] = models if name == "models" else value
    data = out

    def unresolved(raw: list[str]) -> list[str]:
        return [name for name in raw if isinstance(name, str) and name not in known]

    kept_preload = meaning.get("preload")
    if kept_preload:
        preload = list(_get(data, "hooks", "on_startup", "preload") or [])
        preload = (kept_preload["raw"] if preload == kept_preload["resolved"]
                   else preload + [n for n in unresolved(kept_preload["raw"])
                                   if n not in preload])
        if preload:
            data["hooks"] = {"on_startup": {"preload": preload}}
    kept_fifo = meaning.get("fifo")
    if kept_fifo:
        now = dict(_get(data, "routing", "scheduler", "settings", "fifo", "priority") or {})
        if now == kept_fifo["resolved"]:
            now = dict(kept_fifo["raw"])
        else:
            now.update({n: kept_fifo["raw"][n] for n in unresolved(list(kept_fifo["raw"]))
                        if n not in now})
        if now:
            routing = dict(data.get("routing") or {})
            scheduler = dict(routing.get("scheduler") or {})
            settings = dict(scheduler.get("settings") or {})
            settings["fifo"] = {"priority": now}
            scheduler["settings"] = settings
            routing["scheduler"] = scheduler
            data["routing"] = routing
    for group_id, kept_group in (meaning.get("groups") or {}).items():
        group = (data.get("groups") or {}).get(group_id)
        if group is None:
            continue
        members = list(group["members"])
        group["members"] = (kept_group["raw"] if members == kept_group["resolved"]
                            else members + [n for n in unresolved(kept_group["raw"])
                                            if n not in members])
    result = Restored(data=data)
    refs = {k["sha256"]: k["ref"] for k in meaning.get("api_keys") or []}
    hashed: list[dict[str, Any]] = []
    for key in keys:
        if key.sha256 in refs:
            result.api_keys.append(refs[key.sha256])
            if (key.admin or key.peer or key.priority) and (
                    key.name == f"config-{key.sha256[:8]}"):
                # its rank, beside the reference (api_keys.py reads the pair by that name)
                hashed.append({"name": key.name, "sha256": key.sha256,
                               **({"admin": True} if key.admin else {}),
                               **({"peer": True} if key.peer else {}),
                               **({"priority": key.priority} if key.priority else {})})
            continue
        result.unwritable.append(key)
        hashed.append({"name": key.name, "sha256": key.sha256, "prefix": key.prefix,
                       "admin": key.admin, **({"peer": True} if key.peer else {}),
                       **({"priority": key.priority} if key.priority else {})})
        result.warnings.append(
            f"API key {key.name!r} ({key.prefix}…): its value is not stored (only its "
            "SHA-256), so the exported file has no usable key for it: llama-swap ignores "
            "apiKeyHashes. Replace its commented placeholder under apiKeys with the key, or "
            "with an ${env.…} reference to it")
    if result.unwritable and not result.api_keys:
        result.warnings.append(
            "the exported file has no usable API key: a llama-swap started on it runs with "
            "no authentication until apiKeys holds at least one key")
    if hashed:
        data["apiKeyHashes"] = hashed
    return result


def api_keys_block(restored: Restored, dump: Any) -> str:
    """The `apiKeys:` section: the references, then one commented placeholder per key whose
    value is unknown. Empty when there is no key at all."""
    if not restored.api_keys and not restored.unwritable:
        return ""
    lines = [dump({"apiKeys": restored.api_keys}).rstrip("\n")
             if restored.api_keys else "apiKeys:"]
    for key in restored.unwritable:
        lines.append(f"# - <the key of {key.name!r} ({key.prefix}…): its value is not "
                     "stored; write it here, or an ${env.…} reference to it>")
    return "\n".join(lines) + "\n"
