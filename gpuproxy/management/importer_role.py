"""Which node's `--config` writes the shared definitions (issue 24, item 2).

Nodes on one database share the model definitions, so N config files would overwrite each
other at every start, SIGHUP and `-watch-config`. One source writes them: the node named in
`ProxySettings.importer_node`, or the admin alone (`-`). Every other node may start with a
file identical to the last import (nothing is written) and refuses one that differs.

A single box must not suffer for it: a container whose host name (its default node name)
changes at each start would otherwise be locked out by its own previous name. So a node about
to import claims the role when none is named, or when the named node is not up in the fleet
view (down, stopped, never seen; on SQLite there is no fleet view, so always). The claim
takes the settings row's lock, so two nodes cannot both claim it; at start it also runs
under the setup lock (gpuproxy/shell/instance.py). Blocking ORM code: the database thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import connections, transaction

from scheduling.models import ConfigImport, ProxySettings
from scheduling.nodes import ADMIN_ONLY

logger = logging.getLogger("gpuproxy.serve")


@dataclass(frozen=True)
class Role:
    """This node's part: whether it imports, the importer after the decision, and a line to
    log when this node took the role."""

    imports: bool
    importer: str
    note: str = ""
    took_over: bool = False  # from a named node that is not up: a warning, not news

    def log(self) -> None:
        if self.note:
            logger.log(logging.WARNING if self.took_over else logging.INFO, "%s", self.note)


def importer_state(name: str) -> str:
    """The named node's status in the fleet view: up, down, stopped, or "never seen"; on
    SQLite (one box, no fleet view) "not in a fleet"."""
    if connections["default"].vendor != "postgresql":
        return "not in a fleet (SQLite)"
    from activity import fleet

    for member in fleet.fleet():
        if member.row.node == name:
            return member.status
    return "never seen in the fleet view"


def claim(node: str) -> Role:
    """Decide this node's part, claiming the role when it may (see the module's docstring).
    The claim writes only `importer_node`, without a version bump: nothing the running
    proxies read changes."""
    from activity import fleet

    with transaction.atomic():
        ProxySettings.load()  # the row exists from here on
        row = ProxySettings.objects.select_for_update().get(pk=1)
        current = row.importer_node
        if current == node:
            return Role(True, node)
        if current == ADMIN_ONLY:
            return Role(False, ADMIN_ONLY)
        state = importer_state(current) if current else ""
        if current and state == fleet.UP:
            return Role(False, current)
        ProxySettings.objects.filter(pk=1).update(importer_node=node)
    if current:
        note = (f"node {node} takes over importing the config from node {current}, which is "
                f"{state}; the admin's proxy settings (Fleet: importer node) now name {node}")
    else:
        note = (f"node {node} is now the importer: the first node to import a config file "
                "(the admin's proxy settings, Fleet: importer node, name it)")
    return Role(True, node, note, took_over=bool(current))


def same_as_last_import(fingerprint: str | None) -> bool:
    """Whether a file whose content hash is `fingerprint` is what the database last
    imported (ConfigSource.fingerprint is the import's own hash)."""
    last = ConfigImport.last()
    return fingerprint is not None and last is not None and last.content_hash == fingerprint


def refusal(node: str, importer: str, source: str, *, flag: str = "--config") -> str:
    """Why this node does not import `source`, and what the operator can do."""
    who = ("the admin alone writes the definitions (importer node `-`)"
           if importer == ADMIN_ONLY else
           f"node {importer} is the importer and is up")
    return (f"{source} differs from the definitions in the database (its last import), and "
            f"this node ({node}) does not import it: {who}. Start this node without {flag} "
            "(it serves the shared definitions), or give it the importer's file, or make "
            f"{node} the importer in the admin (Proxy settings, Fleet: importer node)")
