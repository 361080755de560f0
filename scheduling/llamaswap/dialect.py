"""The YAML dialect: Go's yaml.v3 (YAML 1.2 core schema), which llama-swap uses.

PyYAML defaults to YAML 1.1, where `on` is true, `010` is 8, `1:30` is 90 and `2024-01-01` is a
date; a config must mean the same here as in llama-swap. `Loader` reads that way (used by
loading.py) and `dump_yaml` writes so that both dialects read the text back unchanged (the
export, scheduling/importer.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

_RESOLVERS: list[tuple[str, re.Pattern[str], list[str]]] = [
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
     list("tTfF")),
    ("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
     list("-+0123456789")),
    ("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"]),
]


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars."""


Loader.yaml_implicit_resolvers = {}
for _tag, _regexp, _first in _RESOLVERS:
    Loader.add_implicit_resolver(_tag, _regexp, _first)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = node.value
    try:
        if text.startswith("0x"):
            return int(text[2:], 16)
        if text.startswith("0o"):
            return int(text[2:], 8)
        return int(text, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer", node.start_mark) from None


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = node.value.lower()
    if text in (".inf", "+.inf"):
        return math.inf
    if text == "-.inf":
        return -math.inf
    if text == ".nan":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{node.value!r} is not a number", node.start_mark) from None


Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or 1.2 would read as something else."""


for _tag, _regexp, _first in _RESOLVERS:
    _Dumper.add_implicit_resolver(_tag, _regexp, _first)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)
Dumper = _Dumper  # for yaml.serialize of composed nodes (a -config-dir merge, sources.py)


def dump_yaml(data: Mapping[str, Any]) -> str:
    """YAML that `parse_config` reads back to the same values (no line wrapping)."""
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                     default_flow_style=False, width=1_000_000)
