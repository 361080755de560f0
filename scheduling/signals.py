"""A committed change to the definitions reaches the running proxy at once.

Three paths, so that no save is missed and none is applied before it is committed:
- In this process (an admin save served by `gpuproxy serve`): `transaction.on_commit` asks the
  proxy to reload (`scheduling.live.reload`, a no-op when no proxy runs here).
- From any process on PostgreSQL (another `gpuproxy` command, a shell, a second admin):
  `pg_notify` inside the saving transaction. PostgreSQL delivers it only on commit, drops it
  on rollback, and folds the duplicates of one transaction (an import saves hundreds of
  rows) into one; the proxy LISTENs (gpuproxy/shell/runtime.py).
- Everything else (SQLite from another process, a missed notification): the proxy's periodic
  fingerprint check.
"""

from __future__ import annotations

import logging

from django.db import connections, transaction
from django.db.models.signals import post_delete, post_save

from scheduling import live

logger = logging.getLogger("scheduling.signals")

CHANNEL = "gpuproxy_catalog"


def _changed(sender, using: str = "default", **kwargs) -> None:
    conn = connections[using]
    if conn.vendor == "postgresql":
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])
        except Exception:  # the save must not fail for want of a notification
            logger.exception("could not NOTIFY %s; the proxy will pick the change up at its "
                             "next periodic check", CHANNEL)
    # One callback per saved row; the proxy folds them into one reload (it only sets an
    # event), and a rolled-back transaction drops them all.
    transaction.on_commit(_reload, using=using)


def _reload() -> None:
    live.reload()


def connect() -> None:
    from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings
    from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

    for model in (ModelDefinition, ModelGroup, ProxySettings, ApiKey, MatrixSet, Peer,
                  Selector, Profile):
        post_save.connect(_changed, sender=model, dispatch_uid=f"gpuproxy-live-{model.__name__}")
        post_delete.connect(_changed, sender=model,
                            dispatch_uid=f"gpuproxy-live-del-{model.__name__}")
