"""One proxy per GPU box: `serve` holds a lock for its whole life, and keeps holding it.

Two schedulers on one GPU would each believe the memory is theirs. A second `gpuproxy serve`
on the same data dir (a file lock) or for the same node (GPUPROXY_NODE) on the same PostgreSQL
database (a session advisory lock keyed by the node) refuses to start; other nodes share the
database. Both locks vanish with the process, however it ends, so a crash never leaves a stale
lock behind.

The node's lock is `pg_try_advisory_lock(LOCK_KEY, node_key(node))`: a CRC-32 of the name, the
same in every process and release (Python's `hash()` is salted per process). Beside it each
serve holds the single-key lock of the releases before node names (`LOCK_KEY` as a bigint)
shared, so an older serve, which takes that one exclusively, and a newer one refuse each
other on one database rather than both driving it.

Migrating and importing the config at start are not per node: nodes started together would
race the same migration (Django's `migrate` takes no lock of its own; one dies with "column
already exists"). `setup()` holds the database-wide `pg_advisory_lock(LOCK_KEY, 0)` around
them, on a connection of its own, waiting at most SETUP_WAIT seconds, and lets go at once.

The advisory lock lives exactly as long as the database session that took it, and a session
ends with any blip of the network or the database (the field report: a 1 s outage, and a
second `serve` started beside the first). So the lock is watched: a thread checks it on its
own connection every GPUPROXY_LOCK_CHECK_SECONDS and takes it again after a loss. If another
instance got it first, this one must not go on as a second scheduler: `on_lost` is told who
holds it (from pg_locks and pg_stat_activity) and `serve` stops loudly, with a non-zero exit.

The same check is the proxy's view of the database's health (`database_status`): it runs
whether or not requests come, on a connection outside Django's pool, so `/health` and the
activity API know about an outage without waiting for a pool timeout themselves.

No Django here: `serve` passes the paths and the connection settings.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpuproxy.shell.instance")

LOCK_KEY = 0x67707278  # "gprx": the advisory lock class of "a gpuproxy serves this database"
SETUP_KEY = 0  # pg_advisory_lock(LOCK_KEY, SETUP_KEY): one node at a time migrates and imports
SETUP_WAIT = 120.0  # seconds: a migration of the partitioned tables takes a few at most

# pg_locks shows pg_try_advisory_lock(int4, int4) as classid = key1, objid = key2 (unsigned),
# objsubid = 2; the old pg_try_advisory_lock(bigint) as classid = high 32 bits, objid = low
# ones, objsubid = 1.
_HOLDS = ("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
          "AND classid = %s AND objid = %s AND objsubid = 2 AND granted "
          "AND pid = pg_backend_pid() AND database = "
          "(SELECT oid FROM pg_database WHERE datname = current_database()))")
# This node's holder, or a serve from before node names (the old key, held exclusively).
_HOLDER = ("SELECT l.pid, a.application_name, a.client_addr::text, a.backend_start, "
           "l.objsubid = 1 FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
           "WHERE l.locktype = 'advisory' AND l.granted AND l.pid <> pg_backend_pid() AND "
           "((l.classid = %s AND l.objid = %s AND l.objsubid = 2) OR (l.classid = 0 AND "
           "l.objid = %s AND l.objsubid = 1 AND l.mode = 'ExclusiveLock')) AND l.database = "
           "(SELECT oid FROM pg_database WHERE datname = current_database()) "
           "ORDER BY l.objsubid DESC LIMIT 1")
# A dead peer is noticed by TCP, not only at the next query that happens to fail.
_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
              "keepalives_count": 3, "tcp_user_timeout": 15000}


def node_key(node: str) -> int:
    """The node's half of its lock key: CRC-32 of its UTF-8 name, as a signed int4."""
    crc = zlib.crc32(node.encode())
    return crc - (1 << 32) if crc >= 1 << 31 else crc


# Some session of this database holds the node's lock: a serve of that node runs (from before
# its setup until its process ends). The importer rule's liveness (management/importer_role).
NODE_HELD = ("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
             "AND classid = %s AND objid = %s AND objsubid = 2 AND granted "
             "AND pid <> pg_backend_pid() AND database = "
             "(SELECT oid FROM pg_database WHERE datname = current_database()))")


def node_held_params(node: str) -> list[int]:
    """NODE_HELD's parameters for `node` (pg_locks shows the key unsigned)."""
    return [LOCK_KEY, node_key(node) & 0xFFFFFFFF]


class SetupTimeout(RuntimeError):
    """Another node held the database's setup lock for longer than this one would wait."""


class AlreadyServing(RuntimeError):
    pass


class LockLost(RuntimeError):
    """Another instance holds the database lock this one had."""


@dataclass(frozen=True)
class DatabaseStatus:
    """The database as the lock's own check last saw it: unreachable since `since` (UTC)."""

    since: dt.datetime
    detail: str


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _utc(wall: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(wall, tz=dt.UTC).replace(microsecond=0)


_current: InstanceLock | None = None


def current() -> InstanceLock | None:
    """The lock this process holds (None outside `serve`)."""
    return _current


class InstanceLock:
    """Held for the life of `serve`: a flock on the data dir, and on PostgreSQL a session
    advisory lock on a connection of its own, watched by `watch()`."""

    def __init__(self, data_dir: Path, database: dict[str, Any] | None,
                 check_every: float = 1.0, pid: int | None = None, node: str = "") -> None:
        # The pid a person should look for: this process, or the supervisor of the
        # scheduler process that holds the lock under `serve --workers N`.
        self.pid = os.getpid() if pid is None else pid
        self.data_dir = data_dir
        self.node = node or socket.gethostname()  # GPUPROXY_NODE, from serve
        self._key = node_key(self.node)
        self.database = database  # psycopg connect kwargs, or None (SQLite)
        self.check_every = check_every
        self._file: Any = None
        self._conn: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # wall time of the first failed check
        self._down_detail = ""
        self._lost_at: float | None = None  # monotonic: the lock's session went away
        self._probe_started: float | None = None  # monotonic, while a check runs
        self._backend_pid: int | None = None  # the session that holds (or held) the lock

    # ---- taking and releasing ------------------------------------------------------------

    def acquire(self) -> None:
        global _current
        path = self.data_dir / "serve.lock"
        f = path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise AlreadyServing(
                f"another gpuproxy serve (pid {holder}) is running on the data dir "
                f"{self.data_dir}: one scheduler per GPU box. Stop it first, or give this one "
                "its own GPUPROXY_DATA_DIR and GPUPROXY_NODE if it really drives other GPUs."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(self.pid))
        f.flush()
        self._file = f
        if self.database is not None:
            conn = self._connect()
            if not self._try_lock(conn):
                _, holder = self._describe_holder(conn)
                conn.close()
                self.release()
                raise AlreadyServing(
                    f"another gpuproxy serve for the node {self.node!r} is using the database "
                    f"{self._where()} (the lock is held by {holder}): one scheduler per node. "
                    "Stop it first; if this one drives other GPUs, give it its own "
                    "GPUPROXY_NODE (or its own database, DATABASE_URL).")
            self._conn = conn
            self._backend_pid = conn.info.backend_pid
        _current = self

    def release(self) -> None:
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.check_every + 1)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
                self._file.close()
            self._file = None

    # ---- watching ------------------------------------------------------------------------

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Check the lock every `check_every` seconds on a thread of its own (a hung query
        must not stall the event loop), re-take it after a loss, and call `on_lost(message)`
        once, from that thread, if another instance holds it."""
        if self.database is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, args=(on_lost,),
                                        name="instance-lock", daemon=True)
        self._thread.start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        while not self._stop.wait(self.check_every):
            self._probe_started = time.monotonic()
            try:
                self._check()
            except LockLost as exc:
                on_lost(str(exc))
                return
            except Exception as exc:
                self._unreachable(exc)
            else:
                self._reachable()
            finally:
                self._probe_started = None

    def _check(self) -> None:
        conn = self._conn
        if conn is not None:
            try:
                if conn.execute(_HOLDS, [LOCK_KEY, self._key & 0xFFFFFFFF]).fetchone()[0]:
                    return
                # The session is alive but does not hold the lock (nothing here unlocks it):
                # take it again on this session, like after a reconnect.
                if self._try_lock(conn):
                    logger.warning("the one-proxy-per-node lock was not held by its own "
                                   "session; took it again")
                    return
                raise LockLost(self._lost_message(self._describe_holder(conn)[1]))
            except LockLost:
                raise
            except Exception as exc:
                if self._lost_at is None:
                    self._lost_at = time.monotonic()
                    logger.warning("the database connection holding the one-proxy lock on %s "
                                   "was lost (%s); taking the lock again as soon as the "
                                   "database answers", self._where(), _one_line(exc))
                self._conn = None
                with contextlib.suppress(Exception):
                    conn.close()
                self._unreachable(exc)
        self._retake()

    def _retake(self) -> None:
        conn = self._connect()
        try:
            got = self._try_lock(conn)
            holder = ""
            # Our own old session may still be on its way out (terminated a moment ago, its
            # locks not yet released): that is no other instance. Give it a moment.
            deadline = time.monotonic() + 2.0
            while not got:
                holder_pid, holder = self._describe_holder(conn)
                if holder_pid is None or holder_pid != self._backend_pid \
                        or time.monotonic() > deadline or self._stop.wait(0.05):
                    break
                got = self._try_lock(conn)
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            raise LockLost(self._lost_message(holder or "another session"))
        self._conn = conn
        self._backend_pid = conn.info.backend_pid
        lost_for = time.monotonic() - self._lost_at if self._lost_at is not None else 0.0
        self._lost_at = None
        logger.warning("re-took the one-proxy-per-node lock on %s after %.1f s without it",
                       self._where(), lost_for)

    def _lost_message(self, holder: str) -> str:
        return (f"another process took the lock of the node {self.node!r} on {self._where()} "
                f"while this gpuproxy serve (pid {self.pid}) had lost its connection: the "
                f"lock is held by {holder}. Two schedulers must not drive one GPU: this one "
                "stops now. If the other is a gpuproxy serve, it carries on; otherwise stop "
                "what holds the lock and start this one again.")

    # ---- the database's health, as the check sees it -------------------------------------

    def database_status(self) -> DatabaseStatus | None:
        """None while the database answers (or nothing is watched: SQLite); else since when
        it does not and why. A check that has not returned within two periods counts as
        unreachable too (a database that accepts bytes but never answers)."""
        if self._down_since is not None:
            return DatabaseStatus(_utc(self._down_since), self._down_detail)
        started = self._probe_started
        if started is not None:
            waited = time.monotonic() - started
            if waited > max(2 * self.check_every, 2.0):
                return DatabaseStatus(_utc(time.time() - waited),
                                      f"no answer for {waited:.0f} s")
        return None

    def _unreachable(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.time()
            logger.warning("database %s unreachable (%s); requests are still served, activity "
                           "rows are buffered, and the lock is checked again every %g s",
                           self._where(), _one_line(exc), self.check_every)
        self._down_detail = _one_line(exc)

    def _reachable(self) -> None:
        if self._down_since is not None:
            logger.info("database %s reachable again after %.1f s", self._where(),
                        time.time() - self._down_since)
            self._down_since = None
            self._down_detail = ""

    @contextlib.contextmanager
    def setup(self, wait: float = SETUP_WAIT,
              say: Callable[[str], Any] = logger.warning) -> Any:
        """Held around `migrate` and the config import at start: one node of the database at
        a time. Nothing to share on SQLite (one serve per file, by the data dir's lock)."""
        if self.database is None:
            yield
            return
        conn = self._connect()
        try:
            if not conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                                [LOCK_KEY, SETUP_KEY]).fetchone()[0]:
                holder = self._setup_holder(conn)
                say(f"waiting up to {wait:g} s for the database {self._where()}'s setup lock "
                    f"(pg_advisory_lock({LOCK_KEY}, {SETUP_KEY})): another node's serve "
                    f"holds it to apply migrations and import its config ({holder})")
                started = time.monotonic()
                self._wait_for_setup(conn, wait, holder)
                say(f"got the setup lock after {time.monotonic() - started:.1f} s; "
                    "migrating and importing")
            yield
        finally:
            conn.close()  # the session's advisory lock goes with it

    def wait_taken_over(self, within: float, stop: threading.Event) -> bool:
        """After `release()`: wait until another session holds this node's lock (under
        `serve --workers N` the supervisor lets go and its scheduler process takes it), at
        most `within` seconds or until `stop`. False when that did not happen."""
        if self.database is None:
            return False
        deadline = time.monotonic() + within
        try:
            with contextlib.closing(self._connect()) as conn:
                while not conn.execute(NODE_HELD, node_held_params(self.node)).fetchone()[0]:
                    if time.monotonic() > deadline or stop.wait(0.05):
                        return False
        except Exception as exc:
            logger.warning("could not see the scheduler process take the lock of the node %r: "
                           "%s", self.node, _one_line(exc))
            return False
        return True

    def _wait_for_setup(self, conn: Any, wait: float, holder: str) -> None:
        from psycopg import errors

        conn.execute("SELECT set_config('lock_timeout', %s, false)", [f"{int(wait * 1000)}ms"])
        try:
            conn.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_KEY, SETUP_KEY])
        except errors.LockNotAvailable:
            raise SetupTimeout(
                f"gave up after {wait:g} s waiting for the database {self._where()}'s setup "
                f"lock (pg_advisory_lock({LOCK_KEY}, {SETUP_KEY})), held by {holder}. If that "
                "serve is stuck, stop it (or end that backend with pg_terminate_backend) and "
                "start this one again") from None

    def _setup_holder(self, conn: Any) -> str:
        row = conn.execute(
            "SELECT l.pid, a.application_name FROM pg_locks l LEFT JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = "
            "%s AND l.objsubid = 2 AND l.granted AND l.database = (SELECT oid FROM "
            "pg_database WHERE datname = current_database()) LIMIT 1",
            [LOCK_KEY, SETUP_KEY]).fetchone()
        if row is None:
            return "a session that let go as this one looked"
        return f"backend pid {row[0]}" + (f", application_name {row[1]!r}" if row[1] else "")

    # ---- PostgreSQL ----------------------------------------------------------------------

    def _connect(self) -> Any:
        import psycopg

        assert self.database is not None
        params = {"connect_timeout": 5, **self.database, **_KEEPALIVE,
                  # who holds the lock, for the message another instance shows
                  "application_name": f"gpuproxy serve pid {self.pid} node {self.node} "
                                      f"on {socket.gethostname()}"}
        params["connect_timeout"] = min(int(params["connect_timeout"]), 5)
        return psycopg.connect(**params, autocommit=True)

    def _try_lock(self, conn: Any) -> bool:
        """The node's lock, and the old whole-database one shared (against older serves)."""
        old, mine = conn.execute("SELECT pg_try_advisory_lock_shared(%s), "
                                 "pg_try_advisory_lock(%s, %s)",
                                 [LOCK_KEY, LOCK_KEY, self._key]).fetchone()
        return bool(old and mine)

    def _describe_holder(self, conn: Any) -> tuple[int | None, str]:
        """Who holds the lock (its backend pid, and in words), as far as pg_stat_activity
        tells this role."""
        try:
            row = conn.execute(_HOLDER, [LOCK_KEY, self._key & 0xFFFFFFFF, LOCK_KEY]
                               ).fetchone()
        except Exception as exc:
            return None, f"another session (not readable: {_one_line(exc)})"
        if row is None:
            return None, "another session (it let go as this one looked)"
        pid, app, addr, since, whole_database = row
        parts = [f"backend pid {pid}"]
        if app:
            parts.append(f"application_name {app!r}")
        parts.append(f"from {addr}" if addr else "over a local socket")
        if since is not None:
            parts.append(f"connected since {since.astimezone(dt.UTC):%Y-%m-%d %H:%M:%S} UTC")
        if whole_database:
            parts.append("a gpuproxy from before GPUPROXY_NODE, which locks the whole database: "
                         "upgrade it")
        return pid, ", ".join(parts)

    def _where(self) -> str:
        assert self.database is not None
        return (f"{self.database.get('dbname')!r} on "
                f"{self.database.get('host') or 'localhost'}")
