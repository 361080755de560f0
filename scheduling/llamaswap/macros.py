"""Macros: `${name}` expansion in model values, the macro tables' rules, the order one model
sees them in, and the error for whatever stays unresolved.

No state: read_models (model_entries.py) and the global `macros:` (parser.py) call these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import RESERVED_MACROS, Scalar
from scheduling.llamaswap.values import describe, go_str, join_path

_MACRO_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
_MACRO_REF = re.compile(r"\$\{([a-zA-Z0-9_-]+)\}")
ANY_REF = re.compile(r"\$\{([^}]*)\}")


def subst(value: Any, macros: Mapping[str, Any], typed: bool) -> Any:
    """Expand `${name}` for every name in `macros`, recursively through lists and mappings.

    With `typed`, a string that is exactly one macro becomes the macro's value with its type,
    as llama-swap does for metadata (`port: ${PORT}` stays an integer). Mapping keys are always
    strings.
    """
    if isinstance(value, str):
        if "${" not in value:
            return value
        whole = _MACRO_REF.fullmatch(value)
        if typed and whole and whole.group(1) in macros:
            return macros[whole.group(1)]
        return _MACRO_REF.sub(
            lambda m: go_str(macros[m.group(1)]) if m.group(1) in macros else m.group(0), value)
    if isinstance(value, list):
        return [subst(item, macros, typed) for item in value]
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            new_key = subst(key, macros, False) if isinstance(key, str) else key
            if new_key in out:
                raise DuplicateKey(str(new_key))
            out[new_key] = subst(item, macros, typed)
        return out
    return value


class DuplicateKey(Exception):
    """Two mapping keys became the same string after macro expansion."""


def walk_strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string (mapping keys included) inside value, with its key path."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from walk_strings(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield join_path(path, key), key
            yield from walk_strings(item, join_path(path, key))


def macro_table(table: Mapping[str, Any], path: str) -> dict[str, Scalar]:
    """A `macros:` table (read as a mapping by the caller), each name and value checked."""
    for name, macro in table.items():
        where = join_path(path, name)
        if len(name) >= 64:
            raise ConfigError(where, "macro names must be shorter than 64 characters")
        if not _MACRO_NAME.match(name):
            raise ConfigError(where, "macro names may contain only letters, digits, _ "
                                     "and - (^[a-zA-Z0-9_-]+$)")
        if name in RESERVED_MACROS:
            raise ConfigError(where, f"{name} is reserved (gpuproxy fills in ${{{name}}} "
                                     "itself); rename the macro")
        if macro is None or not isinstance(macro, str | int | float):
            raise ConfigError(where, f"a macro value must be a string, number or "
                                     f"boolean, got {describe(macro)}")
        if isinstance(macro, float) and not math.isfinite(macro):
            raise ConfigError(where, "a macro value must be a finite number")
        if isinstance(macro, str) and f"${{{name}}}" in macro:
            raise ConfigError(where, f"refers to itself (${{{name}}}); a macro may only "
                                     "use macros defined above it")
    return dict(table)


def resolve_macros(model_id: str, global_macros: Mapping[str, Scalar],
                   model_macros: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The macros one model sees, each expanded with those above it (llama-swap order).

    `MODEL_ID` comes first, then the global macros (a model macro of the same name takes
    the global one's place), then the model's own new macros.
    """
    merged: dict[str, Scalar] = {"MODEL_ID": model_id}
    for name, value in global_macros.items():
        merged[name] = model_macros.get(name, value)
    for name, value in model_macros.items():
        merged.setdefault(name, value)
    resolved: dict[str, Scalar] = {}
    for name, value in merged.items():
        resolved[name] = subst(value, resolved, typed=True)
    return resolved


def check_unresolved(model_id: str, values: Mapping[str, Any], macro_names: set[str],
                     skip_proxy: bool) -> None:
    for key, value in values.items():
        if key == "proxy" and skip_proxy:
            continue
        for path, text in walk_strings(value, f"models.{model_id}.{key}"):
            for match in ANY_REF.finditer(text):
                name = match.group(1)
                if name == "PID" and key == "cmdStop":
                    continue
                if name == "PID":
                    raise ConfigError(path, "${PID} is only available in cmdStop (the "
                                            "process id to stop)")
                if name == "PORT":
                    raise ConfigError(path, "${PORT} is only available when cmd uses "
                                            "${PORT}; add `--port ${PORT}` (or similar) "
                                            "to cmd, or write the port number")
                if name in macro_names:
                    raise ConfigError(path, f"{match.group(0)} is left unresolved: a macro "
                                            f"may only use macros defined above it; move "
                                            f"`{name}` above the macro that uses it")
                raise ConfigError(path, f"unresolved macro {match.group(0)}; define it "
                                        f"under macros: or models.{model_id}.macros:")
