"""`selectors` and `profiles`: names that stand for other names.

Only their shape is read here (llama-swap's `internal/config/selectors.go` and `config.go`'s
`ProfileConfig`): a selector's strategy, targets, spillover and listing fields; a profile's
description and pins, where YAML null and "" both disable the pinned name. What the names
point at (a model, an alias, a peer's model, a selector) is checked against the whole config
by scheduling/routing_checks.py, which the admin shares.
"""

from __future__ import annotations

from typing import Any

from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import SELECTOR_STRATEGIES, ParsedProfile, ParsedSelector
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.values import check_json

_SELECTOR_KEYS = frozenset({"strategy", "targets", "settings", "name", "description",
                            "unlisted", "metadata"})


def read_selectors(r: Reader) -> tuple[ParsedSelector, ...]:
    selectors: list[ParsedSelector] = []
    for selector_id, raw in r.mapping(r.data.get("selectors"), "selectors").items():
        path = f"selectors.{selector_id}"
        if not selector_id.strip():
            raise ConfigError("selectors", "selector names cannot be empty")
        raw = r.mapping(raw, path)
        r.known_keys(raw, path, _SELECTOR_KEYS)
        strategy = r.text(raw.get("strategy"), f"{path}.strategy")
        if not strategy:
            raise ConfigError(f"{path}.strategy", "is required (warm, pin or spillover)")
        if strategy not in SELECTOR_STRATEGIES:
            raise ConfigError(f"{path}.strategy", f"unknown strategy {strategy!r} (valid: "
                                                  "warm, pin, spillover)")
        targets = r.strings(raw.get("targets"), f"{path}.targets")
        if not targets:
            raise ConfigError(f"{path}.targets", "must contain at least one entry: the "
                                                 "models the selector picks from, in order")
        for i, target in enumerate(targets):
            r.no_macros(target, f"{path}.targets[{i}]")
        settings = r.mapping(raw.get("settings"), f"{path}.settings")
        r.known_keys(settings, f"{path}.settings", frozenset({"spillover"}))
        spillover = r.integer(settings.get("spillover"), f"{path}.settings.spillover", 1)
        if strategy == "spillover" and spillover < 1:
            raise ConfigError(f"{path}.settings.spillover", f"must be >= 1, got {spillover}: "
                                                            "the requests each target takes "
                                                            "before the next one starts")
        if spillover < 0:
            raise ConfigError(f"{path}.settings.spillover", f"must be >= 1, got {spillover}")
        metadata = r.mapping(raw.get("metadata"), f"{path}.metadata")
        check_json(metadata, f"{path}.metadata")
        selectors.append(ParsedSelector(
            selector_id=selector_id, strategy=strategy, targets=tuple(targets),
            spillover=spillover, name=r.text(raw.get("name"), f"{path}.name"),
            description=r.text(raw.get("description"), f"{path}.description"),
            unlisted=r.boolean(raw.get("unlisted"), f"{path}.unlisted", False),
            metadata=metadata))
    return tuple(selectors)


def read_profiles(r: Reader) -> tuple[ParsedProfile, ...]:
    profiles: list[ParsedProfile] = []
    for name, raw in r.mapping(r.data.get("profiles"), "profiles").items():
        path = f"profiles.{name}"
        if not name.strip():
            raise ConfigError("profiles", "profile names cannot be empty")
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(path, "profile must be a mapping with description and pins; "
                                    "the legacy list syntax is no longer supported")
        raw = r.mapping(raw, path)
        r.known_keys(raw, path, frozenset({"description", "pins"}))
        pins: dict[str, str | None] = {}
        for pin, target in r.mapping(raw.get("pins"), f"{path}.pins").items():
            where = f"{path}.pins.{pin}"
            if not pin.strip():
                raise ConfigError(f"{path}.pins", "pin names cannot be empty")
            pins[pin] = _pin_target(r, target, where)
        if not pins:
            raise ConfigError(f"{path}.pins", "must contain at least one entry: requested "
                                              "name → target (or ~ to disable the name)")
        profiles.append(ParsedProfile(
            name=name, pins=pins,
            description=r.text(raw.get("description"), f"{path}.description")))
    return tuple(profiles)


def _pin_target(r: Reader, target: Any, where: str) -> str | None:
    """A pin's target; None for YAML null and "" alike (llama-swap reads both as "")."""
    text = r.text(target, where)
    if not text:
        return None
    r.no_macros(text, where)
    return text
