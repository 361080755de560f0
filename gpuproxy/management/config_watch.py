"""The config file `serve` was given, re-imported live: on SIGHUP and, with `-watch-config`,
when its content changes.

llama-swap reloads its config on SIGHUP and, with `-watch-config`, when a 2 s poll sees the
file change. Here the file is imported into the database (scheduling/importer.py: only when
its content differs from the last import's); the import's commit then reaches the running
proxy the way an admin save does (scheduling/signals.py), and only what changed is applied.
A file with an error changes nothing, as llama-swap keeps its old config on a failed reload.
In a fleet only the importer node imports (gpuproxy/management/importer_role.py): on any
other node a changed file is refused, logged once per change, and the node keeps serving the
shared definitions, which reach it through NOTIFY as the importer writes them.

The import is blocking ORM code: it runs on the runtime's database thread, never on the event
loop. One re-import runs at a time; a signal that arrives during one asks for one more after
it, never for a queue of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduling.importer import ImportReport

logger = logging.getLogger("gpuproxy.serve")

WATCH_EVERY = 2.0  # seconds between polls: llama-swap's -watch-config interval


class ConfigSource:
    """`-config FILE` or `-config-dir DIR` (every `*.yaml`/`*.yml` in it, merged)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def fingerprint(self) -> str | None:
        """The import's own hash of what it would read (the names and contents of the files,
        and the values of the `${env.X}` they use: scheduling/llamaswap/sources.py), or None
        when unreadable now. Content, not mtime: two saves within one mtime tick, or an
        editor that restores the mtime, still count as a change."""
        from scheduling.llamaswap.sources import content_hash, yaml_files

        try:
            files = yaml_files(self.path) if self.path.is_dir() else [self.path]
            texts = [path.read_text(encoding="utf-8-sig") for path in files]
        except (OSError, UnicodeDecodeError):
            return None
        return content_hash(files, texts, os.environ)

    def import_now(self, *, force: bool = False) -> ImportReport:
        """Import it (blocking ORM code). Raises ConfigError (nothing written) or OSError."""
        from scheduling.importer import import_path

        return import_path(self.path, force=force)


def log_report(source: ConfigSource, report: ImportReport, why: str) -> None:
    """One line per change applied, or one that says nothing changed: what an operator
    reads to know a reload did what they meant."""
    for warning in report.warnings:
        logger.warning("%s: %s", source, warning)
    if report.unchanged:
        logger.info("%s: %s unchanged since the last import; nothing to apply", why, source)
        return
    if not report.changes:
        logger.info("%s: %s imported; the database already matched it", why, source)
    for change in report.changes:
        logger.info("%s: %s: %s", why, source, change)


class Reimporter:
    """Re-imports `source` on request, on the event loop's side: `run_db` runs the import
    on the database thread (gpuproxy/shell/runtime.py). `reread` (the runtime's
    `request_reload`) follows every re-import, whatever it did: a file unchanged since the
    last import still leaves the database to re-read, as SIGHUP without a file does (an edit
    made behind Django's back), and a change committed reloads once either way."""

    def __init__(self, source: ConfigSource,
                 run_db: Callable[[Callable[[], Any]], Awaitable[Any]],
                 reread: Callable[[], None]) -> None:
        self.source = source
        self._run_db = run_db
        self._reread = reread
        self._refused = ""  # the content hash last refused (not the importer): logged once
        self._wanted: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    def request(self, why: str) -> None:
        """Re-import soon (on the loop). Requests during a re-import fold into one more."""
        if why not in self._wanted:
            self._wanted.append(why)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="config-reimport")

    async def _run(self) -> None:
        while self._wanted:
            why = " and ".join(self._wanted)
            self._wanted.clear()
            await self.reimport(why)
            self._reread()

    async def reimport(self, why: str) -> None:
        from scheduling.llamaswap import ConfigError

        logger.info("%s: re-importing %s", why, self.source)
        try:
            outcome = await self._run_db(self._as_importer)
        except (ConfigError, OSError) as exc:
            logger.error("%s: %s was not applied: %s; the running config is kept (fix the "
                         "file and signal again)", why, self.source, exc)
            return
        except Exception:
            # The database away, a bug: the proxy must go on serving what it has.
            logger.exception("%s: re-importing %s failed; the running config is kept", why,
                             self.source)
            return
        if isinstance(outcome, _Refused):
            if outcome.fingerprint != self._refused:
                self._refused = outcome.fingerprint
                logger.error("%s: not imported: %s; the running definitions are kept", why,
                             outcome.message)
            else:  # said once per change: a reply to the signal, not the refusal again
                logger.info("%s: %s still differs from the definitions' last import; not "
                            "imported (this node does not import)", why, self.source)
            return
        self._refused = ""
        if outcome is None:
            logger.info("%s: %s is the same as the definitions' last import; nothing to "
                        "apply (this node does not import)", why, self.source)
            return
        log_report(self.source, outcome, why)

    def _as_importer(self) -> ImportReport | _Refused | None:
        """On the database thread: import when this node is (or becomes) the importer; else
        nothing for a file the database last imported, `_Refused` for one that differs."""
        from django.conf import settings

        from gpuproxy.management import importer_role

        node = settings.GPUPROXY_NODE
        with importer_role.claiming(node) as role:  # the claim and the import: one commit
            if role.imports:
                outcome: ImportReport | _Refused | None = self.source.import_now()
            else:
                fingerprint = self.source.fingerprint()
                outcome = (None if importer_role.same_as_last_import(fingerprint) else
                           _Refused(fingerprint or "(unreadable)", importer_role.refusal(
                               node, role.importer, str(self.source))))
        role.log()
        return outcome

    def watch(self, every: float = WATCH_EVERY) -> None:
        """`-watch-config`: poll the file (or directory) and re-import when it changes."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._poll(every),
                                                                 name="config-watch")
            logger.info("watching %s for changes (every %g s, -watch-config)", self.source,
                        every)

    async def _poll(self, every: float) -> None:
        last = await asyncio.to_thread(self.source.fingerprint)
        while True:
            await asyncio.sleep(every)
            now = await asyncio.to_thread(self.source.fingerprint)
            if now is not None and now != last:
                last = now
                self.request("-watch-config: the file changed")

    def stop(self) -> None:
        for task in (self._watch, self._task):
            if task is not None:
                task.cancel()


class _Refused:
    """A changed file on a node that does not import it."""

    def __init__(self, fingerprint: str, message: str) -> None:
        self.fingerprint = fingerprint
        self.message = message


def on_sighup(reimporter: Reimporter | None, request_reload: Callable[[], None]) -> None:
    """SIGHUP, llama-swap's "reload the config": re-import the `-config` file (or
    `-config-dir`) when serve was given one; either way, re-read the definitions from the
    database now (an edit made behind Django's back: no save signal, no NOTIFY), as the
    periodic check would. Never a stop: a file with an error leaves the running config as
    it is."""
    if reimporter is not None:
        reimporter.request("SIGHUP")
    else:
        logger.info("SIGHUP: re-reading the model definitions")
        request_reload()
