"""Where a config comes from: one file, or a directory (`-config-dir`) whose `*.yml` and
`*.yaml` files merge into one document the way llama-swap's `internal/config/merge.go` does.

The merge works on YAML nodes after each file's `${env.NAME}` substitution (as llama-swap's):
mappings merge key by key, sequences concatenate, equal scalars agree, a null gives way to the
other side, anything else is a conflict. Under an identity map (`models`, `groups`, ...) a key
names one thing, so the same key in two files is an error; unlike llama-swap's message ours
names both files, since the user has to pick one of them.

`content_hash` is what startup compares with the last import: the files' names and bytes, and
the values of the environment variables they reference (a changed `${env.KEY}` is a changed
config even when no file changed). It is a SHA-256, so no value can be read back from it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scheduling.llamaswap.dialect import Dumper, Loader
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.loading import (
    ENV_REF,
    check_duplicate_keys,
    load_yaml,
    substitute_env,
)

IDENTITY_MAPS = frozenset({
    "models", "groups", "profiles", "selectors", "peers", "matrix",
    "routing.router.settings.groups", "routing.router.settings.matrix",
})


@dataclass(frozen=True)
class Source:
    """The text to parse (one file's, or the directory's merged document), where it came
    from, and the raw texts (before `${env.…}`), which the export reads references from."""

    path: Path
    files: tuple[Path, ...]
    text: str
    raw_texts: tuple[str, ...]
    content_hash: str
    merged: bool  # text is a merged document already substituted: parse it with no env


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                     "save the file as UTF-8") from None


def yaml_files(directory: Path) -> list[Path]:
    """The top-level `*.yml`/`*.yaml` files, sorted by name (llama-swap's `listYAMLFiles`)."""
    return sorted((p for p in directory.iterdir()
                   if p.is_file() and p.name.endswith((".yml", ".yaml"))),
                  key=lambda p: str(p))


def content_hash(files: list[Path], texts: list[str], env: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    for path, text in zip(files, texts, strict=True):
        digest.update(path.name.encode() + b"\0" + text.encode() + b"\0")
    names = sorted({m.group(1) for text in texts for m in ENV_REF.finditer(text)})
    for name in names:
        value = env.get(name)
        digest.update(name.encode() + (b"\1" if value is None else b"=" + value.encode())
                      + b"\0")
    return digest.hexdigest()


def read_source(path: Path, env: Mapping[str, str]) -> Source:
    """Read a config file or directory. FileNotFoundError when `path` is neither;
    ConfigError for an unreadable or conflicting file."""
    if path.is_dir():
        files = yaml_files(path)
        if not files:
            raise ConfigError(str(path), "no *.yml or *.yaml file in this directory; put the "
                                         "config files there, or pass a file")
        texts = [_read(f) for f in files]
        return Source(path=path, files=tuple(files), text=merge_texts(files, texts, env),
                      raw_texts=tuple(texts), content_hash=content_hash(files, texts, env),
                      merged=True)
    if not path.is_file():
        raise FileNotFoundError(str(path))
    text = _read(path)
    return Source(path=path, files=(path,), text=text, raw_texts=(text,),
                  content_hash=content_hash([path], [text], env), merged=False)


def _compose(path: Path, text: str, env: Mapping[str, str]) -> yaml.Node | None:
    try:
        substituted = substitute_env(text, env)
        node = yaml.compose(substituted, Loader=Loader)
        check_duplicate_keys(node, "", set())
        return node
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc.path}" if exc.path else path.name,
                          exc.message) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path.name}, line {mark.line + 1}" if mark is not None else path.name
        raise ConfigError(where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}"
                          ) from None


def merge_texts(files: list[Path], texts: list[str], env: Mapping[str, str]) -> str:
    """One YAML document: the files' documents merged in order (llama-swap's rules)."""
    merged: yaml.MappingNode | None = None
    owners: dict[tuple[str, str], Path] = {}  # (identity map, key) -> the file defining it
    for path, text in zip(files, texts, strict=True):
        node = _compose(path, text, env)
        if node is None or (isinstance(node, yaml.ScalarNode) and node.value == ""):
            continue  # an empty file (or only comments)
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(path.name, "the top level must be a mapping of settings")
        if merged is None:
            merged = node
            _record_owners(node, "", path, owners)
            continue
        _merge_nodes(merged, node, "", path, owners)
    if merged is None:
        return ""
    return yaml.serialize(merged, Dumper=Dumper, allow_unicode=True, width=1_000_000)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _index(node: yaml.MappingNode) -> dict[str, yaml.Node]:
    return {k.value: v for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _record_owners(node: yaml.MappingNode, path: str, source: Path,
                   owners: dict[tuple[str, str], Path]) -> None:
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        child = _join(path, key.value)
        if child in IDENTITY_MAPS and isinstance(value, yaml.MappingNode):
            for entry, _ in value.value:
                if isinstance(entry, yaml.ScalarNode):
                    owners.setdefault((child, entry.value), source)
        elif isinstance(value, yaml.MappingNode):
            _record_owners(value, child, source, owners)


def _is_null(node: yaml.Node) -> bool:
    return (isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null", "Null",
                                                                   "NULL")
            and node.style is None and node.tag in ("tag:yaml.org,2002:null", "", None))


def _merge_nodes(dst: yaml.MappingNode, src: yaml.MappingNode, path: str, source: Path,
                 owners: dict[tuple[str, str], Path]) -> None:
    dst_index = _index(dst)
    for key, src_value in src.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        child = _join(path, key.value)
        dst_value = dst_index.get(key.value)
        if dst_value is None:
            dst.value.append((key, src_value))
            if child in IDENTITY_MAPS and isinstance(src_value, yaml.MappingNode):
                _record_owners(yaml.MappingNode("tag:yaml.org,2002:map",
                                                [(key, src_value)]), path, source, owners)
            elif isinstance(src_value, yaml.MappingNode):
                _record_owners(src_value, child, source, owners)
            continue
        if child in IDENTITY_MAPS:
            _merge_identity(dst, key.value, dst_value, src_value, child, source, owners)
            continue
        _merge_value(dst, key.value, dst_value, src_value, child, source, owners)


def _replace(dst: yaml.MappingNode, key: str, value: yaml.Node) -> None:
    dst.value[:] = [(k, value if isinstance(k, yaml.ScalarNode) and k.value == key else v)
                    for k, v in dst.value]


def _merge_identity(dst: yaml.MappingNode, key: str, dst_value: yaml.Node,
                    src_value: yaml.Node, path: str, source: Path,
                    owners: dict[tuple[str, str], Path]) -> None:
    if _is_null(src_value):
        return
    if _is_null(dst_value):
        _replace(dst, key, src_value)
        if isinstance(src_value, yaml.MappingNode):
            for entry, _ in src_value.value:
                owners.setdefault((path, entry.value), source)
        return
    if not (isinstance(dst_value, yaml.MappingNode) and isinstance(src_value, yaml.MappingNode)):
        raise ConfigError(path, f"{source.name} gives it as something other than a mapping, "
                                "unlike an earlier file; make both mappings")
    existing = _index(dst_value)
    for entry, value in src_value.value:
        name = entry.value
        if name in existing:
            first = owners.get((path, name))
            where = f"{first.name} and {source.name}" if first else source.name
            raise ConfigError(f"{path}.{name}", f"defined in two files ({where}); "
                                                "define it in one of them")
        dst_value.value.append((entry, value))
        existing[name] = value
        owners[(path, name)] = source


def _merge_value(dst: yaml.MappingNode, key: str, dst_value: yaml.Node, src_value: yaml.Node,
                 path: str, source: Path, owners: dict[tuple[str, str], Path]) -> None:
    if isinstance(dst_value, yaml.MappingNode) and isinstance(src_value, yaml.MappingNode):
        _merge_nodes(dst_value, src_value, path, source, owners)
    elif isinstance(dst_value, yaml.SequenceNode) and isinstance(src_value,
                                                                 yaml.SequenceNode):
        dst_value.value.extend(src_value.value)
    elif _is_null(dst_value):
        _replace(dst, key, src_value)
    elif _is_null(src_value):
        return
    elif isinstance(dst_value, yaml.ScalarNode) and isinstance(src_value, yaml.ScalarNode):
        if dst_value.value != src_value.value:
            raise ConfigError(path, f"{source.name} sets a different value than an earlier "
                                    "file; set it in one file only")
    else:
        raise ConfigError(path, f"{source.name} gives a different kind of value (mapping, "
                                "list or scalar) than an earlier file; make them agree")


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: plain in any YAML scalar style
_HELD_REF = re.compile(f"{_OPEN}([A-Za-z_][A-Za-z0-9_]*){_CLOSE}")


def _restore_refs(value: Any) -> Any:
    if isinstance(value, str):
        return _HELD_REF.sub(lambda m: f"${{env.{m.group(1)}}}", value)
    if isinstance(value, list):
        return [_restore_refs(v) for v in value]
    if isinstance(value, dict):
        return {_restore_refs(k): _restore_refs(v) for k, v in value.items()}
    return value


def raw_document(source: Source) -> dict[str, Any]:
    """The document as written: `${env.NAME}` references kept (each held as a token while
    the YAML is read, since the raw text may not be valid YAML around them) and macros
    unexpanded. What the export writes back where a value has not changed since."""
    names = {m.group(1) for text in source.raw_texts for m in ENV_REF.finditer(text)}
    held = {name: f"{_OPEN}{name}{_CLOSE}" for name in names}
    if source.merged:
        text = merge_texts(list(source.files), list(source.raw_texts), held)
        data = load_yaml(text, {}) if text.strip() else {}
    else:
        data = load_yaml(source.text, held)
    return _restore_refs(data)
