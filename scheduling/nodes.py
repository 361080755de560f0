"""Node names and model placement (issue 24): the one owner of what a node name may be, for
`GPUPROXY_NODE` (gpuproxy/settings.py), a model's `nodes:` in a config file, the Model admin
and the importer setting. Pure: the settings module imports it before Django is set up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# It keys the one-instance lock and marks every activity row: short, and safe in a URL, a
# log line and a file name.
NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")
NODE_NAME_RULE = "1 to 63 letters, digits, '.', '-' or '_'"
# ProxySettings.importer_node: no node imports; the admin alone writes the definitions.
ADMIN_ONLY = "-"


def bad_node_name(name: object) -> str | None:
    """Why `name` cannot name a node, in words a person can act on; None when it can."""
    if not isinstance(name, str):
        return f"a node name must be text, got {name!r}"
    if not NODE_NAME.fullmatch(name):
        return f"{name!r} is not a node name: use {NODE_NAME_RULE} (as GPUPROXY_NODE)"
    return None


def placement_errors(nodes: object) -> str | None:
    """A model's `nodes` as stored (a JSON list; empty = every node), or why not."""
    if not isinstance(nodes, list):
        return 'nodes must be a JSON list of node names, e.g. ["gpu-a", "gpu-b"]; [] = every node'
    seen: set[str] = set()
    for name in nodes:
        why = bad_node_name(name)
        if why:
            return why
        if name in seen:
            return f"node {name!r} is listed twice"
        seen.add(name)
    return None


def placed_on(nodes: Iterable[str], node: str) -> bool:
    """Whether a model placed on `nodes` runs on `node`: an empty placement is every node."""
    listed = tuple(nodes)
    return not listed or node in listed


def placement_text(nodes: Iterable[str]) -> str:
    """A placement as the admin shows it."""
    listed = tuple(nodes)
    return ", ".join(listed) if listed else "all"


def serves_text(node: str, placements: Iterable[tuple[str, Iterable[str]]]) -> str:
    """What `node` runs, from (model id, its nodes) of the enabled models: the ones placed on
    it by name, then how many run on every node; "-" for none."""
    named, everywhere = [], 0
    for model_id, nodes in placements:
        listed = tuple(nodes)
        if not listed:
            everywhere += 1
        elif node in listed:
            named.append(model_id)
    parts = sorted(named)
    if everywhere:
        parts.append(f"all others ({everywhere} on every node)" if named else
                     f"all ({everywhere} on every node)")
    return ", ".join(parts) or "-"
