"""Which node's `--config` writes the shared definitions (issue 24, item 2).

Nodes on one database share the model definitions, so N config files would overwrite each
other at every start, SIGHUP and `-watch-config`. One source writes them: the node named in
`ProxySettings.importer_node`, or the admin alone (`-`). Every other node may start with a
file identical to the last import (nothing is written) and refuses one that differs.

A single box must not suffer for it: a container whose host name (its default node name)
changes at each start would otherwise be locked out by its own previous name. So a node about
to import claims the role when none is named, or when no serve of the named node runs: no
session holds its instance lock (gpuproxy/shell/instance.py). A serve holds that lock from
before its setup (migrate, this import) until its process ends, however it ends, so a box
whose name changed takes over at once, and a node that started a moment ago keeps the role.
Its fleet heartbeat would not do: a serve writes none until its runtime starts, after its
setup, so two nodes started together (a rollout, a restart after a power cut) would each find
the other stopped or never seen, and with GPUPROXY_FLEET_SECONDS=0 no node is ever up. The
fleet row only colours the message. On SQLite there is one box: it always claims.

The decision and the import run in one transaction that holds the settings row's lock
(`claiming`), so two nodes cannot both claim, and the role cannot change between the claim
and the import (at start this also runs under the setup lock). Blocking ORM code: the
database thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import connections, transaction

from gpuproxy.shell import instance
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


def serve_runs(name: str) -> bool:
    """Whether a serve of node `name` runs on this database: its instance lock is held."""
    with connections["default"].cursor() as cursor:
        cursor.execute(instance.NODE_HELD, instance.node_held_params(name))
        return bool(cursor.fetchone()[0])


def fleet_row(name: str) -> str:
    """The named node's last word in the fleet view, for the message only."""
    from activity import fleet

    for member in fleet.fleet():
        if member.row.node == name:
            return f"its fleet row says {member.status}"
    return "never seen in the fleet view"


@contextmanager
def claiming(node: str) -> Iterator[Role]:
    """Decide this node's part, claiming the role when it may (see the module's docstring),
    and keep the settings row locked while the caller acts on it (the import): one
    transaction, so an import that fails leaves the claim undone too. The claim writes only
    `importer_node`, without a version bump: nothing the running proxies read changes.
    Log the role's note after the block (it is true only once committed)."""
    with transaction.atomic():
        ProxySettings.load()  # the row exists from here on
        current = ProxySettings.objects.select_for_update().values_list(
            "importer_node", flat=True).get(pk=1)
        yield _decide(node, current)


def claim(node: str) -> Role:
    """`claiming` for a caller with nothing to do under the lock."""
    with claiming(node) as role:
        return role


def _decide(node: str, current: str) -> Role:
    if current == node:
        return Role(True, node)
    if current == ADMIN_ONLY:
        return Role(False, ADMIN_ONLY)
    postgres = connections["default"].vendor == "postgresql"
    if current and postgres and serve_runs(current):
        return Role(False, current)
    ProxySettings.objects.filter(pk=1).update(importer_node=node)
    named = f"the admin's proxy settings (Fleet: importer node) now name {node}"
    if not current:
        return Role(True, node, f"node {node} is now the importer: the first node to import a "
                                "config file (the admin's proxy settings, Fleet: importer "
                                "node, name it)")
    why = (f"no serve of {current} holds its node lock on this database ({fleet_row(current)})"
           if postgres else "one box on SQLite")
    return Role(True, node, f"node {node} takes over importing the config from node "
                            f"{current}: {why}; {named}", took_over=True)


def same_as_last_import(fingerprint: str | None) -> bool:
    """Whether a file whose content hash is `fingerprint` is what the database last
    imported (ConfigSource.fingerprint is the import's own hash)."""
    last = ConfigImport.last()
    return fingerprint is not None and last is not None and last.content_hash == fingerprint


def refusal(node: str, importer: str, source: str, *, flag: str = "--config") -> str:
    """Why this node does not import `source`, and what the operator can do."""
    who = ("the admin alone writes the definitions (importer node `-`)"
           if importer == ADMIN_ONLY else
           f"node {importer} is the importer and a serve of it is running")
    return (f"{source} differs from the definitions in the database (its last import), and "
            f"this node ({node}) does not import it: {who}. Start this node without {flag} "
            "(it serves the shared definitions), or give it the importer's file, or make "
            f"{node} the importer in the admin (Proxy settings, Fleet: importer node)")
