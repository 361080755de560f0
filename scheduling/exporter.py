"""Write the database back as a llama-swap config: `import_config`'s inverse.

The export keeps the meaning of the last import (scheduling/meaning.py): macros and `${env.X}`
references as they were written, entries that name no model, API keys as references or
commented placeholders (never silently dropped: a llama-swap started on a file without its
keys would run with no authentication). `describe_changes` compares two exports: the
import's one line per change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduling import affinity_budget
from scheduling.llamaswap import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_CHECK_ENDPOINT,
    DEFAULT_PROXY,
    DEFAULT_SCHEDULER,
    DEFAULT_SWAP_AFFINITY_BONUS,
    dump_yaml,
    format_go_duration,
)
from scheduling.llamaswap.api_keys import export_priority_range
from scheduling.meaning import ExportKey, Restored, api_keys_block, restore
from scheduling.models import (
    ApiKey,
    ConfigImport,
    ModelDefinition,
    ModelGroup,
    ProxySettings,
)
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector


def same_as_stored(a: Any, b: Any) -> bool:
    """Equal as stored: JSON text, so 1 and 1.0 or 1 and true differ, and key order doesn't."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True,
                                                                    default=str)


def _unport(text: str, port: int | None) -> str:
    """Put `${PORT}` back where import wrote the allocated port, so a re-import re-allocates.

    Import hands out ports again in sorted model-id order from startPort, so the same set of
    `${PORT}` models gets the same numbers back.
    """
    if port is None:
        return text
    return re.sub(rf"(?<![0-9]){port}(?![0-9])", "${PORT}", text)


def _explicit_aliases(model: ModelDefinition) -> list[str]:
    """The aliases without the sorted tail that import adds for `setParamsByID` keys."""
    aliases = list(model.aliases)
    by_id = set(model.set_params_by_id or {}) - {model.model_id}
    for cut in range(len(aliases) + 1):
        head = aliases[:cut]
        if head + sorted(by_id - set(head)) == aliases:
            return head
    return aliases


def _export_model(m: ModelDefinition) -> dict[str, Any]:
    """One `models.<id>` entry, leaving out every value that equals llama-swap's default."""
    out: dict[str, Any] = {"cmd": _unport(m.cmd, m.port)}
    optional: Iterable[tuple[str, Any, Any]] = (
        ("cmdStop", _unport(m.cmd_stop, m.port), ""),
        ("proxy", _unport(m.proxy, m.port), DEFAULT_PROXY),
        ("checkEndpoint", m.check_endpoint, DEFAULT_CHECK_ENDPOINT),
        ("name", m.name, ""),
        ("description", m.description, ""),
        ("ttl", m.ttl, -1),
        ("unloadTimeout", m.unload_timeout, 0),
        ("aliases", _explicit_aliases(m), []),
        ("env", list(m.env), []),
        ("unlisted", m.unlisted, False),
        ("useModelName", m.use_model_name, ""),
        ("concurrencyLimit", m.concurrency_limit, 0),
        ("parallel", m.parallel, None),  # a derived one stays the command's
        ("sendLoadingState", m.send_loading_state, None),
        ("enabled", m.enabled, True),
        ("vllmPriority", m.vllm_priority, False),
        ("streamIdleTimeout", m.stream_idle_timeout, 600),
        ("nodes", list(m.nodes or []), []),
        ("metadata", m.metadata, {}),
        ("capabilities", m.capabilities, {}),
    )
    for key, value, default in optional:
        if value != default or type(value) is not type(default):
            out[key] = value
    filters = {key: value for key, value in (("stripParams", m.strip_params),
                                             ("setParams", m.set_params),
                                             ("setParamsByID", m.set_params_by_id)) if value}
    if filters:
        out["filters"] = filters
    return out


def export_config() -> dict[str, Any]:
    """The database as a llama-swap-shaped mapping that `import_config` maps back to it.

    Settings are written in full; model entries leave out defaults. Where the last import's
    file used macros or `${env.…}` and the value is unchanged since, the file's text is
    written back (scheduling/meaning.py). API keys imported as `${env.X}` are written as
    that reference under `apiKeys`; the others only as `apiKeyHashes` (the database never
    had the keys themselves), which `export_document` reports.
    """
    restored = _restored()
    data = dict(restored.data)
    if restored.api_keys:
        data["apiKeys"] = list(restored.api_keys)
    return data


def _restored() -> Restored:
    last = ConfigImport.last()
    keys = [ExportKey(name=k.name, sha256=k.key_hash, prefix=k.prefix, admin=k.admin,
                      peer=k.trusted_peer, priority=export_priority_range(k.priority_range()))
            for k in ApiKey.objects.order_by("name")]
    restored = restore(_llamaswap_routing(plain_export()), last.meaning if last else {}, keys)
    router = restored.data.get("routing", {}).get("router")
    if router is not None and "groups" in restored.data:
        # llama-swap refuses top-level groups beside routing.router: they go under it
        router.setdefault("settings", {})["groups"] = restored.data.pop("groups")
    return restored


def _llamaswap_routing(plain: dict[str, Any]) -> dict[str, Any]:
    """`routing.scheduler` as llama-swap reads it where it can: `use` only for fifo (serial,
    ours, is what a file without it gets here, and llama-swap refuses the name), the serial
    settings only when not the defaults; nothing when nothing is left."""
    scheduler = plain["routing"]["scheduler"]
    settings = dict(scheduler["settings"])
    if settings["serial"] == {"agingDivisor": DEFAULT_AGING_DIVISOR,
                              "swapAffinityBonus": DEFAULT_SWAP_AFFINITY_BONUS}:
        del settings["serial"]
    out = {"use": scheduler["use"]} if scheduler["use"] != DEFAULT_SCHEDULER else {}
    if settings:
        out["settings"] = settings
    trimmed = {k: v for k, v in plain.items() if k != "routing"}
    routing = {k: v for k, v in (("router", plain["routing"].get("router")),
                                 ("scheduler", out)) if v}
    if routing:
        trimmed["routing"] = routing
    return trimmed


@dataclass(frozen=True)
class ExportDocument:
    """The exported YAML, and what a person must know before using it (a key it could not
    write)."""

    text: str
    warnings: tuple[str, ...]


def export_document() -> ExportDocument:
    restored = _restored()
    header = ("# Exported by `gpuproxy export_config`: a llama-swap config plus gpuproxy's\n"
              "# extensions (parallel, enabled, queue, apiKeyHashes, the serial scheduler's\n"
              "# settings). `gpuproxy import_config` of this file recreates the same state.\n")
    text = header + dump_yaml(restored.data) + api_keys_block(restored, dump_yaml)
    return ExportDocument(text=text, warnings=tuple(restored.warnings))


def plain_export() -> dict[str, Any]:
    """The database in llama-swap's shape, every value as stored (expanded): what the
    export starts from, and what an import's change lines compare."""
    s = ProxySettings.objects.filter(pk=1).first() or ProxySettings()
    defs = list(ModelDefinition.objects.select_related("group").order_by("model_id"))
    out: dict[str, Any] = {
        "healthCheckTimeout": s.health_check_timeout,
        "globalTTL": s.global_ttl,
        "unloadTimeout": s.unload_timeout,
        "startPort": s.start_port,
        "sendLoadingState": s.send_loading_state,
        "includeAliasesInList": s.include_aliases_in_list,
        "performance": {"disabled": not s.performance_monitoring,
                        "every": format_go_duration(s.performance_interval)},
        "queue": _export_queue(s),
        "captureBuffer": s.capture_buffer_mb,
        "models": {m.model_id: _export_model(m) for m in defs},
    }
    groups = list(ModelGroup.objects.order_by("group_id"))
    if groups:
        out["groups"] = {
            g.group_id: {"swap": g.swap, "exclusive": g.exclusive, "persistent": g.persistent,
                         "members": [m.model_id for m in defs if m.group_id == g.pk]}
            for g in groups}
    serial: dict[str, Any] = {"agingDivisor": s.aging_divisor,
                              "swapAffinityBonus": s.swap_affinity_bonus}
    budget = affinity_budget.parse_budget(s.affinity_budget).value()
    if budget is not None:  # off is not written: a file without the key means off
        serial["affinityBudget"] = budget
    scheduler_settings: dict[str, Any] = {"serial": serial}
    priority = {m.model_id: m.fifo_priority for m in defs if m.fifo_priority}
    if priority:
        scheduler_settings["fifo"] = {"priority": priority}
    out["routing"] = {"scheduler": {"use": s.scheduler, "settings": scheduler_settings}}
    matrix = {k: v for k, v in (
        ("vars", s.matrix_vars),
        ("evict_costs", s.matrix_evict_costs),
        ("sets", dict(MatrixSet.objects.order_by("position", "name").values_list("name",
                                                                               "dsl")))) if v}
    if s.router != "group" or matrix:
        out["routing"]["router"] = {"use": s.router, **({"settings": {"matrix": matrix}}
                                                         if matrix else {})}
    if s.preload:
        out["hooks"] = {"on_startup": {"preload": list(s.preload)}}
    out.update(_export_routing())
    keys = list(ApiKey.objects.order_by("name"))
    if keys:
        out["apiKeyHashes"] = [{"name": k.name, "sha256": k.key_hash, "prefix": k.prefix,
                                "admin": k.admin, "peer": k.trusted_peer,
                                **({"priority": rng} if (rng := export_priority_range(
                                    k.priority_range())) else {})} for k in keys]
    return out


def _export_routing() -> dict[str, Any]:
    """`peers`, `selectors` and `profiles` in llama-swap's shape, defaults left out."""
    out: dict[str, Any] = {}
    peers = {}
    for p in Peer.objects.order_by("peer_id"):
        filters = {k: v for k, v in (("stripParams", p.strip_params),
                                     ("setParams", p.set_params)) if v}
        peers[p.peer_id] = {k: v for k, v in (
            ("proxy", p.proxy), ("apiKey", p.api_key), ("models", list(p.models_list)),
            ("filters", filters), ("timeouts", p.timeouts),
            ("priorityForward", "" if p.priority_forward == "header" else p.priority_forward),
        ) if v}
    selectors = {}
    for sel in Selector.objects.order_by("selector_id"):
        selectors[sel.selector_id] = {k: v for k, v in (
            ("strategy", sel.strategy), ("targets", list(sel.targets)),
            ("settings", {"spillover": sel.spillover} if sel.spillover != 1 else {}),
            ("name", sel.name), ("description", sel.description), ("unlisted", sel.unlisted),
            ("metadata", sel.metadata)) if v}
    profiles = {p.name: {k: v for k, v in (("description", p.description),
                                           ("pins", {n: t or None for n, t in p.pins.items()}))
                         if v}
                for p in Profile.objects.order_by("name")}
    for key, section in (("peers", peers), ("selectors", selectors), ("profiles", profiles)):
        if section:
            out[key] = section
    return out


def export_yaml() -> str:
    return export_document().text


# --------------------------------------------------------------------------------------------
# Change lines


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), out)
    else:
        out[path] = value


def describe_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """One line per change between two `plain_export()`s, in the file's words.

    Numbers, booleans and settings show old -> new; a model's strings and lists (cmd, env,
    proxy, ...) only say "changed", since they can hold a secret (a key in an env entry).
    """
    lines: list[str] = []
    old_s: dict[str, Any] = {}
    new_s: dict[str, Any] = {}
    skip = ("models", "groups", "apiKeyHashes", "apiKeys", "peers", "selectors", "profiles")
    _flatten({k: v for k, v in before.items() if k not in skip}, "", old_s)
    _flatten({k: v for k, v in after.items() if k not in skip}, "", new_s)
    for key in sorted(old_s.keys() | new_s.keys()):
        a, b = old_s.get(key), new_s.get(key)
        if not same_as_stored(a, b):
            lines.append(f"settings: {key} {_show(a)} -> {_show(b)}")
    for kind, section in (("model", "models"), ("group", "groups"), ("peer", "peers"),
                          ("selector", "selectors"), ("profile", "profiles")):
        old_e, new_e = before.get(section) or {}, after.get(section) or {}
        for name in sorted(old_e.keys() | new_e.keys()):
            if name not in new_e:
                lines.append(f"{kind} {name!r} removed")
            elif name not in old_e:
                lines.append(f"{kind} {name!r} added")
            else:
                a_e, b_e = old_e[name], new_e[name]
                for key in sorted(a_e.keys() | b_e.keys(), key=str):
                    a, b = a_e.get(key), b_e.get(key)
                    if same_as_stored(a, b):
                        continue
                    if (a is None or isinstance(a, bool | int | float)) and (
                            b is None or isinstance(b, bool | int | float)):
                        lines.append(f"{kind} {name!r}: {key} {_show(a)} -> {_show(b)}")
                    else:
                        lines.append(f"{kind} {name!r}: {key} changed")
    old_k = {k["sha256"]: k for k in before.get("apiKeyHashes") or []}
    new_k = {k["sha256"]: k for k in after.get("apiKeyHashes") or []}
    for digest in sorted(old_k.keys() | new_k.keys(),
                         key=lambda d: (new_k.get(d) or old_k[d])["name"]):
        if digest not in new_k:
            lines.append(f"api key {old_k[digest]['name']!r} removed")
        elif digest not in old_k:
            lines.append(f"api key {new_k[digest]['name']!r} added")
        else:
            for key in ("name", "prefix", "admin", "peer", "priority"):
                if old_k[digest].get(key) != new_k[digest].get(key):
                    lines.append(f"api key {new_k[digest]['name']!r}: {key} "
                                 f"{_show(old_k[digest].get(key))} -> "
                                 f"{_show(new_k[digest].get(key))}")
    return lines


def _export_queue(s: ProxySettings) -> dict[str, Any]:
    out: dict[str, Any] = {"maxWaiting": s.max_waiting, "timeout": s.queue_timeout}
    per_band = {b: n for b in ("interactive", "normal", "batch")
                if (n := getattr(s, f"max_waiting_{b}"))}
    if per_band:
        out["maxWaitingPerBand"] = per_band
    if rng := export_priority_range(s.priority_range()):
        out["priority"] = rng
    return out
