"""Apply a parsed llama-swap config to the database (its inverse, the export, is
scheduling/exporter.py).

`import_config` makes the database match the file: rows the file does not name are deleted,
the others are updated in place (by model id, group id and key hash), so their primary keys,
creation times and API-key prefixes survive a re-import. A row is written only when a value
changed: importing the same file twice writes nothing, and `ProxySettings.version` (which
tells the proxy to reload) only moves when a setting really changed.

Every instance goes through `full_clean()`, the same rules the admin applies. Everything runs
in one transaction, so a `ConfigError` from any row leaves the database as it was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import DataError, IntegrityError, models, transaction
from django.utils import timezone

from scheduling.exporter import describe_changes, plain_export, same_as_stored
from scheduling.llamaswap import (
    ConfigError,
    ParsedConfig,
    ParsedModel,
    api_key_name,
    parse_config,
)
from scheduling.llamaswap.sources import Source, raw_document, read_source
from scheduling.meaning import capture
from scheduling.models import (
    ApiKey,
    ConfigImport,
    ModelDefinition,
    ModelGroup,
    ProxySettings,
    hash_key,
    key_prefix,
)
from scheduling.routing_checks import check_parsed
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector
from scheduling.slots import Slots, derive_parallel

# Model field -> where it lives in the YAML, for ConfigError paths.
_MODEL_PATHS = {
    "model_id": "", "cmd": "cmd", "cmd_stop": "cmdStop", "proxy": "proxy", "port": "cmd",
    "check_endpoint": "checkEndpoint", "ttl": "ttl", "unload_timeout": "unloadTimeout",
    "aliases": "aliases", "env": "env", "name": "name", "description": "description",
    "unlisted": "unlisted", "use_model_name": "useModelName",
    "concurrency_limit": "concurrencyLimit", "parallel": "parallel",
    "vllm_priority": "vllmPriority", "stream_idle_timeout": "streamIdleTimeout",
    "strip_params": "filters.stripParams", "set_params": "filters.setParams",
    "set_params_by_id": "filters.setParamsByID", "metadata": "metadata",
    "capabilities": "capabilities", "send_loading_state": "sendLoadingState",
    "enabled": "enabled", "nodes": "nodes",
}
_SETTINGS_PATHS = {
    "scheduler": "routing.scheduler.use",
    "aging_divisor": "routing.scheduler.settings.serial.agingDivisor",
    "swap_affinity_bonus": "routing.scheduler.settings.serial.swapAffinityBonus",
    "affinity_budget": "routing.scheduler.settings.serial.affinityBudget",
    "health_check_timeout": "healthCheckTimeout", "global_ttl": "globalTTL",
    "unload_timeout": "unloadTimeout", "start_port": "startPort",
    "send_loading_state": "sendLoadingState", "include_aliases_in_list": "includeAliasesInList",
    "performance_monitoring": "performance.disabled", "performance_interval": "performance.every",
    "max_waiting": "queue.maxWaiting", "queue_timeout": "queue.timeout",
    "max_waiting_interactive": "queue.maxWaitingPerBand.interactive",
    "max_waiting_normal": "queue.maxWaitingPerBand.normal",
    "max_waiting_batch": "queue.maxWaitingPerBand.batch",
    **{f"priority_{b}": f"queue.priority.{b}" for b in ("min", "max", "default")},
    "preload": "hooks.on_startup.preload", "capture_buffer_mb": "captureBuffer",
    "router": "routing.router.use", "matrix_vars": "routing.router.settings.matrix.vars",
    "matrix_evict_costs": "routing.router.settings.matrix.evict_costs",
}
_RANGE = ("priority_min", "priority_max", "priority_default")
_GROUP_PATHS = {"group_id": "", "swap": "swap", "exclusive": "exclusive",
                "persistent": "persistent"}
_KEY_PATHS = {"name": "name", "key_hash": "sha256", "prefix": "prefix", "admin": "admin",
              "trusted_peer": "peer",
              **{f"priority_{b}": f"priority.{b}" for b in ("min", "max", "default")}}
_PEER_PATHS = {"peer_id": "", "proxy": "proxy", "api_key": "apiKey", "models_list": "models",
               "strip_params": "filters.stripParams", "set_params": "filters.setParams",
               "timeouts": "timeouts", "priority_forward": "priorityForward"}
_SELECTOR_PATHS = {"selector_id": "", "strategy": "strategy", "targets": "targets",
                   "spillover": "settings.spillover", "name": "name",
                   "description": "description", "unlisted": "unlisted",
                   "metadata": "metadata"}
_PROFILE_PATHS = {"name": "", "description": "description", "pins": "pins"}


@dataclass(frozen=True)
class ImportReport:
    """What an import did: the file's row counts, rows written and deleted, warnings, and the
    slots read from each command where the file sets no `parallel` (by model id)."""

    models: int
    groups: int
    api_keys: int
    written: int
    deleted: int
    warnings: tuple[str, ...]
    dry_run: bool = False
    derived_slots: tuple[tuple[str, Slots], ...] = ()
    # True when the content hash equals the last import's (and not forced): nothing written
    unchanged: bool = False
    # One line per change, as a person reads it ("model 'x': cmd changed"); no secret values
    changes: list[str] = field(default_factory=list)
    # the file's routing rows, for the summary: (noun, count), only those it has
    routing: tuple[tuple[str, int], ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.written or self.deleted)

    def summary(self, source: str) -> str:
        if self.unchanged:
            return (f"{source} is unchanged since the last import; nothing imported (use "
                    "--force to import it anyway)")
        verb = "would import" if self.dry_run else "imported"
        line = (f"{verb} {_count(self.models, 'model')}, {_count(self.groups, 'group')}, "
                f"{_count(self.api_keys, 'api key')}"
                + "".join(f", {_count(n, noun)}" for noun, n in self.routing)
                + f" from {source}")
        if self.dry_run:
            line += " (dry run: nothing changed)"
        if not self.derived_slots:
            return line
        # The scheduler sends a model this many requests at once: a wrong guess either idles
        # slots or hands the upstream a queue of its own, so the import says what it read.
        return "\n".join([
            line,
            "slots (requests each upstream serves at once), from cmd where `parallel` is not "
            "set:",
            *(f"  {model_id}: {slots.parallel} ({slots.source})"
              for model_id, slots in self.derived_slots)])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _RollBack(Exception):
    """Raised inside the transaction by a dry run, to undo it after every check has run."""

    def __init__(self, report: ImportReport) -> None:
        self.report = report


def load_file(path: str | os.PathLike[str]) -> ParsedConfig:
    """Parse a config file with the process environment supplying `${env.NAME}`.

    Raises FileNotFoundError for a missing file (the command turns it into its own message)
    and ConfigError for anything wrong inside it.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                     "save the file as UTF-8") from None
    return parse_config(text, os.environ)


def import_path(path: Path, *, force: bool = False, dry_run: bool = False) -> ImportReport:
    """Import a config file, or a directory of them merged as llama-swap's `-config-dir`
    does, unless its content hash equals the last import's (`unchanged`; `force` imports
    anyway). Records the import (ConfigImport) unless `dry_run`.

    Raises FileNotFoundError when `path` is neither a file nor a directory, ConfigError for
    anything wrong in the files (nothing is changed then).
    """
    source = read_source(Path(path), os.environ)
    parsed = parse_config(source.text, {} if source.merged else os.environ)
    last = ConfigImport.last()
    if not force and last is not None and last.content_hash == source.content_hash:
        return ImportReport(models=len(parsed.models), groups=len(parsed.groups),
                            api_keys=len(parsed.api_keys) + len(parsed.api_key_hashes),
                            written=0, deleted=0, warnings=tuple(parsed.warnings),
                            dry_run=dry_run, unchanged=True)
    return import_config(parsed, dry_run=dry_run, source=source)


def import_config(parsed: ParsedConfig, *, dry_run: bool = False,
                  source: Source | None = None) -> ImportReport:
    """Make the database match `parsed`, in one transaction; ConfigError changes nothing.

    With `dry_run` every row is still written and validated, then rolled back, so a dry run
    finds the same errors a real import would. With `source` (import_path) the import is
    recorded as the last one.
    """
    try:
        with transaction.atomic():
            before = plain_export()
            importer = _Import(parsed)
            report = importer.run(dry_run)
            changes = describe_changes(before, plain_export())
            if importer.cleared_profile:
                changes.append(f"settings: active profile {importer.cleared_profile!r} "
                               "cleared (the file no longer defines it)")
            report = replace(report, changes=changes)
            if dry_run:
                raise _RollBack(report)
            if source is not None:
                _record(source, parsed)
    except _RollBack as rollback:
        return rollback.report
    except (DataError, IntegrityError) as exc:  # full_clean should catch these first
        raise ConfigError("(database)", f"the database refused the import: {exc}; nothing "
                                        "was changed") from exc
    return report


def _record(source: Source, parsed: ParsedConfig) -> None:
    ConfigImport(
        # absolute: the admin's banner and the report must name it wherever they are read
        source_path=str(source.path.absolute()),
        files=[str(f.absolute()) for f in source.files],
        content_hash=source.content_hash, imported_at=timezone.now(),
        managed={"models": sorted(m.model_id for m in parsed.models),
                 "groups": sorted(g.group_id for g in parsed.groups),
                 "matrix_sets": [name for name, _ in parsed.matrix_sets],
                 "peers": sorted(p.peer_id for p in parsed.peers),
                 "selectors": sorted(s.selector_id for s in parsed.selectors),
                 "profiles": sorted(p.name for p in parsed.profiles),
                 "api_keys": sorted({*map(hash_key, parsed.api_keys),
                                     *(k.sha256 for k in parsed.api_key_hashes)})},
        meaning=capture(raw_document(source), parsed, plain_export()),
    ).save()


def _assign(instance: models.Model, values: Mapping[str, Any]) -> bool:
    """Set fields that differ; True when any did (a new row always counts as changed)."""
    changed = instance._state.adding
    for name, value in values.items():
        if not same_as_stored(getattr(instance, name), value):
            setattr(instance, name, value)
            changed = True
    return changed


def _full_clean(instance: models.Model, path: str, paths: Mapping[str, str]) -> None:
    """`full_clean()`, with a ValidationError turned into a ConfigError at the YAML path."""
    try:
        instance.full_clean()
    except ValidationError as exc:
        if hasattr(exc, "error_dict"):
            name, messages = next(iter(exc.message_dict.items()))
            sub = "" if name == NON_FIELD_ERRORS else paths.get(name, name)
        else:
            sub, messages = "", exc.messages
        where = f"{path}.{sub}" if path and sub else (path or sub)
        raise ConfigError(where, " ".join(messages)) from None


class _Import:
    """One import, step by step; `written`/`deleted` count rows for the report."""

    def __init__(self, parsed: ParsedConfig) -> None:
        self.parsed = parsed
        self.written = 0
        self.deleted = 0
        self.warnings: list[str] = []  # the import's own, after the parser's
        self.cleared_profile = ""  # the active profile, when the file no longer defines it

    def run(self, dry_run: bool) -> ImportReport:
        parsed = self.parsed
        self.warnings += check_parsed(parsed)
        self.settings()
        self.delete_stale()
        groups = self.groups()
        self.models(groups)
        keys = self.api_keys()
        self.routing()
        derived = tuple((m.model_id, derive_parallel(m.cmd, m.env))
                        for m in sorted(parsed.models, key=lambda m: m.model_id)
                        if m.parallel is None)
        return ImportReport(models=len(parsed.models), groups=len(parsed.groups), api_keys=keys,
                            written=self.written, deleted=self.deleted,
                            warnings=(*parsed.warnings, *self.warnings), dry_run=dry_run,
                            derived_slots=derived, routing=tuple(
                                (noun, n) for noun, n in (
                                    ("matrix set", len(parsed.matrix_sets)),
                                    ("peer", len(parsed.peers)),
                                    ("selector", len(parsed.selectors)),
                                    ("profile", len(parsed.profiles))) if n))

    def save(self, instance: models.Model, changed: bool) -> None:
        if changed:
            instance.save()
            self.written += 1

    def settings(self) -> None:
        s = self.parsed.settings
        row = ProxySettings.load()
        changed = _assign(row, {
            "scheduler": s.scheduler, "aging_divisor": s.aging_divisor,
            "swap_affinity_bonus": s.swap_affinity_bonus, "affinity_budget": s.affinity_budget,
            "health_check_timeout": s.health_check_timeout, "global_ttl": s.global_ttl,
            "unload_timeout": s.unload_timeout, "start_port": s.start_port,
            "send_loading_state": s.send_loading_state,
            "include_aliases_in_list": s.include_aliases_in_list,
            "performance_monitoring": s.performance_monitoring,
            "performance_interval": s.performance_interval, "preload": list(s.preload),
            "max_waiting": s.max_waiting, "queue_timeout": s.queue_timeout,
            "capture_buffer_mb": s.capture_buffer_mb,
            **dict(zip(_RANGE, s.priority_range, strict=True)),
            **{f"max_waiting_{b}": s.max_waiting_per_band.get(b, 0)
               for b in ("interactive", "normal", "batch")},
            "router": s.router, "matrix_vars": dict(s.matrix_vars),
            "matrix_evict_costs": dict(s.matrix_evict_costs),
        })
        profiles = {p.name for p in self.parsed.profiles}
        if row.active_profile and row.active_profile not in profiles:
            # llama-swap selects no profile after a reload; ours is a setting, kept while
            # the profile exists, since the admin or the API chose it on purpose
            self.cleared_profile = row.active_profile
            row.active_profile = ""
            changed = True
        _full_clean(row, "", _SETTINGS_PATHS)
        self.save(row, changed)

    def delete_stale(self) -> None:
        """Rows the file does not name go first, so they cannot clash with the new ones."""
        parsed = self.parsed
        self.deleted += ModelDefinition.objects.exclude(
            model_id__in=[m.model_id for m in parsed.models]).delete()[0]
        self.deleted += ModelGroup.objects.exclude(
            group_id__in=[g.group_id for g in parsed.groups]).delete()[0]
        self.deleted += ApiKey.objects.exclude(key_hash__in=list(self._keys())).delete()[0]
        for model, key, names in (
                (MatrixSet, "name", [name for name, _ in parsed.matrix_sets]),
                (Peer, "peer_id", [p.peer_id for p in parsed.peers]),
                (Selector, "selector_id", [s.selector_id for s in parsed.selectors]),
                (Profile, "name", [p.name for p in parsed.profiles])):
            self.deleted += model.objects.exclude(**{f"{key}__in": names}).delete()[0]

    def groups(self) -> dict[str, ModelGroup]:
        existing = {g.group_id: g for g in ModelGroup.objects.all()}
        rows: dict[str, ModelGroup] = {}
        for group in self.parsed.groups:
            row = existing.get(group.group_id) or ModelGroup(group_id=group.group_id)
            changed = _assign(row, {"swap": group.swap, "exclusive": group.exclusive,
                                    "persistent": group.persistent})
            _full_clean(row, f"groups.{group.group_id}", _GROUP_PATHS)
            self.save(row, changed)
            rows[group.group_id] = row
        return rows

    def models(self, groups: Mapping[str, ModelGroup]) -> None:
        existing = {m.model_id: m for m in ModelDefinition.objects.all()}
        planned: list[tuple[ModelDefinition, bool, ParsedModel]] = []
        moving_aliases: list[int] = []
        for model in self.parsed.models:
            row = existing.get(model.model_id) or ModelDefinition(model_id=model.model_id)
            if row.pk is not None and not (
                    same_as_stored(row.aliases, list(model.aliases))
                    and same_as_stored(row.set_params_by_id, model.set_params_by_id)):
                moving_aliases.append(row.pk)
            changed = _assign(row, _model_values(model))
            group = groups[model.group] if model.group else None
            if row.group_id != (group.pk if group else None):
                row.group = group
                changed = True
            planned.append((row, changed, model))
        # An alias may move from one kept model to another. The file is already known to be
        # consistent (the parser checked), but `clean()` compares each row with the others as
        # they are now, so free the moving aliases before validating row by row.
        if moving_aliases:
            ModelDefinition.objects.filter(pk__in=moving_aliases).update(aliases=[],
                                                                         set_params_by_id={})
        for row, changed, model in planned:
            _full_clean(row, f"models.{model.model_id}", _MODEL_PATHS)
            self.save(row, changed)

    def _keys(self) -> dict[str, tuple[str, str | None, bool | None, bool | None, Any]]:
        """sha256 -> (row name, prefix, admin, trusted peer, priority range), in file order;
        None keeps what the database has."""
        keys: dict[str, tuple[str, str | None, bool | None, bool | None, Any]] = {}
        for key in self.parsed.api_keys:
            digest = hash_key(key)
            keys[digest] = (api_key_name(key), key_prefix(key),
                            self.parsed.plain_key_admin.get(digest),
                            self.parsed.plain_key_peer.get(digest),
                            self.parsed.plain_key_priority.get(digest))
        for entry in self.parsed.api_key_hashes:
            keys[entry.sha256] = (entry.name, entry.prefix, entry.admin, entry.peer,
                                  entry.priority)
        return keys

    def api_keys(self) -> int:
        """The file's keys. A key's rank comes from the file when it says (`admin:` under
        apiKeyHashes); otherwise a key keeps what the database has (ticked in the admin, or
        admin since the upgrade that added the flag) and a new one is not admin."""
        keys = self._keys()
        existing = {k.key_hash: k for k in ApiKey.objects.all()}
        # Names are unique too: park renamed rows on a placeholder so a swap of two names
        # does not trip over itself.
        for digest, (name, *_) in keys.items():
            row = existing.get(digest)
            if row is not None and row.name != name:
                ApiKey.objects.filter(pk=row.pk).update(name=f"~import-{row.pk}")
        admins = 0
        for index, (digest, (name, prefix, admin, peer, rng)) in enumerate(keys.items()):
            row = existing.get(digest) or ApiKey(key_hash=digest)
            values: dict[str, Any] = {"name": name}
            if prefix is not None:
                values["prefix"] = prefix
            if admin is not None:
                values["admin"] = admin
            if peer is not None:
                values["trusted_peer"] = peer
            if rng is not None:
                values.update(zip(_RANGE, rng, strict=True))
            changed = _assign(row, values)
            _full_clean(row, _key_path(self.parsed, index), _KEY_PATHS)
            self.save(row, changed)
            admins += row.admin
        if keys and not admins:
            self.warnings.append(
                f"apiKeys: no admin key among the {_count(len(keys), 'API key')}: none reaches "
                "the management API (/api/models/*, /api/queue, /api/activity, /unload), /logs, "
                "/upstream/… or the commands in /running; mark one with `admin: true` under "
                "apiKeyHashes (or tick Admin on it in the admin)")
        return len(keys)

    def routing(self) -> None:
        """The matrix's sets (in order), peers, selectors and profiles, by their ids."""
        parsed = self.parsed
        sets = {m.name: m for m in MatrixSet.objects.all()}
        base = "routing.router.settings.matrix.sets"
        for position, (name, dsl) in enumerate(parsed.matrix_sets):
            set_row = sets.get(name) or MatrixSet(name=name)
            changed = _assign(set_row, {"dsl": dsl, "position": position})
            _full_clean(set_row, f"{base}.{name}", {"name": "", "dsl": "", "position": ""})
            self.save(set_row, changed)
        peers = {p.peer_id: p for p in Peer.objects.all()}
        for peer in parsed.peers:
            peer_row = peers.get(peer.peer_id) or Peer(peer_id=peer.peer_id)
            changed = _assign(peer_row, {
                "proxy": peer.proxy, "api_key": peer.api_key, "models_list": list(peer.models),
                "strip_params": peer.strip_params, "set_params": _json(peer.set_params),
                "timeouts": dict(peer.timeouts), "priority_forward": peer.priority_forward})
            _full_clean(peer_row, f"peers.{peer.peer_id}", _PEER_PATHS)
            self.save(peer_row, changed)
        selectors = {s.selector_id: s for s in Selector.objects.all()}
        for sel in parsed.selectors:
            sel_row = selectors.get(sel.selector_id) or Selector(selector_id=sel.selector_id)
            changed = _assign(sel_row, {
                "strategy": sel.strategy, "targets": list(sel.targets),
                "spillover": sel.spillover, "name": sel.name, "description": sel.description,
                "unlisted": sel.unlisted, "metadata": _json(sel.metadata)})
            _full_clean(sel_row, f"selectors.{sel.selector_id}", _SELECTOR_PATHS)
            self.save(sel_row, changed)
        profiles = {p.name: p for p in Profile.objects.all()}
        for profile in parsed.profiles:
            prof_row = profiles.get(profile.name) or Profile(name=profile.name)
            changed = _assign(prof_row, {"description": profile.description,
                                    "pins": dict(profile.pins)})
            _full_clean(prof_row, f"profiles.{profile.name}", _PROFILE_PATHS)
            self.save(prof_row, changed)


def _json(value: Any) -> Any:
    """Plain JSON data, as the database will give it back (so `_assign` compares alike)."""
    return json.loads(json.dumps(value))


def _model_values(m: ParsedModel) -> dict[str, Any]:
    return {
        "enabled": m.enabled, "name": m.name, "description": m.description, "cmd": m.cmd,
        "cmd_stop": m.cmd_stop, "proxy": m.proxy, "port": m.port,
        "check_endpoint": m.check_endpoint, "ttl": m.ttl, "unload_timeout": m.unload_timeout,
        "aliases": list(m.aliases), "env": list(m.env), "unlisted": m.unlisted,
        "use_model_name": m.use_model_name, "concurrency_limit": m.concurrency_limit,
        "parallel": m.parallel, "strip_params": m.strip_params,
        "set_params": json.loads(json.dumps(m.set_params)),
        "set_params_by_id": json.loads(json.dumps(m.set_params_by_id)),
        "metadata": json.loads(json.dumps(m.metadata)),
        "capabilities": json.loads(json.dumps(m.capabilities)),
        "send_loading_state": m.send_loading_state, "fifo_priority": m.fifo_priority,
        "vllm_priority": m.vllm_priority, "stream_idle_timeout": m.stream_idle_timeout,
        "nodes": list(m.nodes),
    }


def _key_path(parsed: ParsedConfig, index: int) -> str:
    plain = len(parsed.api_keys)
    return f"apiKeys[{index}]" if index < plain else f"apiKeyHashes[{index - plain}]"
