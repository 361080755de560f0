"""The typed reading every section shares: one `Reader` per parse holds the loaded data and
the warnings, and reads a value as a mapping, list, string, boolean, integer or duration,
naming the key path and what was expected when it is something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.macros import ANY_REF
from scheduling.llamaswap.values import describe, join_path, parse_go_duration


class Reader:
    """One parse: holds the data and the warnings collected on the way."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.warnings: list[str] = []

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(f"{path}: {message}")

    # typed readers: each names the path and what was expected ---------------------------

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping (key: value lines), got "
                                    f"{describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(path, f"keys must be strings; quote {key!r}")
        return value

    def seq(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {describe(value)}")
        return value

    def text(self, value: Any, path: str, default: str = "") -> str:
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {describe(value)}; quote it")
        return value

    def boolean(self, value: Any, path: str, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {describe(value)}")
        return value

    def integer(self, value: Any, path: str, default: int, minimum: int | None = None) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {describe(value)}")
        if minimum is not None and value < minimum:
            raise ConfigError(path, f"must be at least {minimum}, got {value}")
        return value

    def duration(self, value: Any, path: str, default: float) -> float:
        """Seconds from a Go duration string; a bare number is refused, as llama-swap refuses it
        (Go would read `every: 15` as 15 nanoseconds, so guessing a unit would mislead)."""
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a duration such as 15s or 1m30s, got "
                                    f"{describe(value)}; add the unit")
        try:
            return parse_go_duration(value)
        except ValueError:
            raise ConfigError(path, f"expected a duration such as 15s or 1m30s (units ns, us, "
                                    f"ms, s, m, h), got {describe(value)}") from None

    def strings(self, value: Any, path: str) -> list[str]:
        return [self.text(item, f"{path}[{i}]") for i, item in enumerate(self.seq(value, path))]

    def no_macros(self, value: str, path: str) -> None:
        if m := ANY_REF.search(value):
            raise ConfigError(path, f"unresolved macro {m.group(0)}; macros are expanded only "
                                    "inside models.*, and ${env.NAME} everywhere")

    def not_a_model(self, name: str) -> str:
        """Why a name in groups/preload/priority matches nothing, for its warning."""
        selectors = self.data.get("selectors")
        if isinstance(selectors, dict) and name in selectors:
            return f"{name!r} is a selector, not a model"
        return f"{name!r} is not a model id or alias"

    def known_keys(self, mapping: Mapping[str, Any], path: str, known: frozenset[str]) -> None:
        for key in mapping:
            if key not in known:
                self.warn(join_path(path, key), "unknown key; ignored (check its spelling; "
                                                "docs/configuration.md lists the supported keys)")
