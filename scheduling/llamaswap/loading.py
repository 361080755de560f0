"""Step 1: YAML text -> data, with `${env.NAME}` substituted as llama-swap does it, and the
checks PyYAML would skip (a key given twice).

Every YAML error becomes a `ConfigError` with a line and column.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from scheduling.llamaswap.dialect import Loader
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.values import describe, join_path

ENV_REF = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")


def _yaml_error(exc: yaml.YAMLError, substituted: bool) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    detail = f"{context}, {problem}" if context else problem
    after = " after ${env.…} substitution (check the variables' values)" if substituted else ""
    return ConfigError(where, f"not valid YAML{after}: {detail}; fix the syntax (quote values "
                              "that contain ': ' or ' #', or start with a special character)")


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    style: str | None
    path: str


def _scalar_spans(node: yaml.Node | None, path: str, seen: set[int]) -> Iterator[_Span]:
    if node is None or id(node) in seen:  # anchors: an aliased node appears more than once
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        yield _Span(node.start_mark.index, node.end_mark.index, node.style, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _scalar_spans(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        for key, item in node.value:
            key_text = key.value if isinstance(key, yaml.ScalarNode) else "?"
            yield from _scalar_spans(key, join_path(path, key_text), seen)
            yield from _scalar_spans(item, join_path(path, key_text), seen)


def _escape(value: str, style: str | None) -> str:
    if style == '"':
        return value.replace("\\", "\\\\").replace('"', '\\"')
    if style == "'":
        return value.replace("'", "''")
    return value


def substitute_env(text: str, env: Mapping[str, str]) -> str:
    """Replace `${env.NAME}` in the raw text, as llama-swap does before it reads the YAML.

    Only references inside YAML values (or keys) count: the same text inside a comment is
    left alone, so a commented-out line never demands a variable. The value is escaped for
    the quoting style of the scalar it lands in.
    """
    if "${env." not in text:
        return text
    try:
        root = yaml.compose(text, Loader=Loader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, substituted=False) from None
    spans = sorted(_scalar_spans(root, "", set()), key=lambda s: s.start)
    pieces: list[str] = []
    last = 0
    for match in ENV_REF.finditer(text):
        span = next((s for s in spans if s.start <= match.start() and match.end() <= s.end),
                    None)
        if span is None:
            continue  # inside a comment
        name = match.group(1)
        where = span.path or "(top level)"
        if name not in env:
            raise ConfigError(where, f"environment variable {name} is not set; set it in the "
                                     f"environment of the import, or replace ${{env.{name}}} "
                                     "with the value")
        value = env[name]
        if any(c in value for c in "\n\r\0"):
            raise ConfigError(where, f"environment variable {name} contains a line break or "
                                     "NUL, which cannot be placed into YAML; put it in a "
                                     "one-line value")
        pieces.append(text[last:match.start()])
        pieces.append(_escape(value, span.style))
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces)


def check_duplicate_keys(node: yaml.Node | None, path: str, seen: set[int]) -> None:
    """yaml.v3 refuses a key given twice; PyYAML would keep the last one without a word."""
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            check_duplicate_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, item in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in lines:
                raise ConfigError(join_path(path, key.value),
                                  f"given twice (lines {lines[key.value]} and {line}); "
                                  "keep one of them")
            lines[key.value] = line
            check_duplicate_keys(item, join_path(path, key.value), seen)


def load_yaml(text: str, env: Mapping[str, str]) -> dict[str, Any]:
    substituted = substitute_env(text, env)
    loader = Loader(substituted)
    try:
        node = loader.get_single_node()
        check_duplicate_keys(node, "", set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, substituted=substituted != text) from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError("", "the file is empty; a llama-swap config needs at least `models:`")
    if not isinstance(data, dict):
        raise ConfigError("", f"the file holds {describe(data)}, not a mapping of settings; "
                              "a llama-swap config starts with keys such as `models:`")
    return data
