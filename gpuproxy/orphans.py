"""No upstream outlives its proxy, and one proxy per GPU box.

A model server holds gigabytes of GPU memory; one left behind by a crashed proxy makes every
later load fail. Three defences, each covering what the previous cannot:

1. `pdeathsig_argv`: the upstream is started through util-linux's `setpriv --pdeathsig
   SIGKILL`, so the kernel kills it the moment the proxy dies, even by SIGKILL (nothing in
   the proxy runs then). It reaches only the process the proxy started, not what that one
   started in turn (a wrapper script's children).
2. `ProcessRecords`: every upstream's process group is written to the data dir while it
   runs. At the next start the proxy stops the groups an earlier run left (checking the
   process start time, so a recycled pid is never hit).
3. `InstanceLock`: a second `gpuproxy serve` on the same data dir (a file lock) or the same
   PostgreSQL database (an advisory lock) refuses to start: two schedulers would fight over
   one GPU.

No Django here: `serve` passes the paths and the connection settings.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpuproxy.orphans")

_SETPRIV = shutil.which("setpriv")
LOCK_KEY = 0x67707278  # "gprx": the advisory lock id of "a gpuproxy serves this database"


def pdeathsig_argv(argv: list[str]) -> list[str]:
    """`argv` prefixed so that the kernel SIGKILLs it when the proxy dies (Linux)."""
    if _SETPRIV is None:
        return argv
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat):
    with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class ProcessRecords:
    """One small JSON file per running upstream, named by its process group id."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, pgid: int) -> Path:
        return self.dir / f"{pgid}.json"

    def add(self, model: str, pid: int, cmd: str) -> None:
        record = {"model": model, "pgid": pid, "cmd": cmd, "start_time": _start_time(pid),
                  "proxy_pid": os.getpid()}
        try:
            self._path(pid).write_text(json.dumps(record))
        except OSError as exc:
            logger.warning("cannot record upstream %r (pid %d) in %s: %s; if the proxy "
                           "crashes it may survive it", model, pid, self.dir, exc)

    def remove(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(pid).unlink()

    def sweep(self, grace: float = 5.0) -> list[str]:
        """Stop every process group an earlier proxy left running; returns their models.
        SIGTERM first, SIGKILL after `grace` seconds."""
        stopped: list[tuple[int, str]] = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record: dict[str, Any] = json.loads(path.read_text())
                pgid = int(record["pgid"])
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if record.get("proxy_pid") == os.getpid():
                continue  # our own (a second sweep in one process)
            alive = _start_time(pgid)
            if alive is not None and alive == record.get("start_time"):
                logger.warning('stopping model "%s" (process group %d), left running by an '
                               "earlier gpuproxy that did not exit cleanly: %s",
                               record.get("model"), pgid, record.get("cmd", "")[:200])
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGTERM)
                stopped.append((pgid, str(record.get("model"))))
            elif _group_alive(pgid) and alive is None:
                # the leader is gone but members of its group remain (a wrapper's children)
                logger.warning('stopping what is left of model "%s" (process group %d) from '
                               "an earlier gpuproxy", record.get("model"), pgid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGTERM)
                stopped.append((pgid, str(record.get("model"))))
            path.unlink(missing_ok=True)
        deadline = time.monotonic() + grace
        while stopped and time.monotonic() < deadline and any(
                _group_alive(g) for g, _ in stopped):
            time.sleep(0.05)
        for pgid, model in stopped:
            if _group_alive(pgid):
                logger.warning('model "%s" (process group %d) ignored SIGTERM for %g s: '
                               "SIGKILL", model, pgid, grace)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        return [m for _, m in stopped]


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is alive (zombies count as gone)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class AlreadyServing(RuntimeError):
    pass


class InstanceLock:
    """Held for the life of `serve`: a flock on the data dir, and on PostgreSQL a session
    advisory lock on a connection of its own. Both vanish with the process, however it
    ends, so a crash never leaves a stale lock behind."""

    def __init__(self, data_dir: Path, database: dict[str, Any] | None) -> None:
        self.data_dir = data_dir
        self.database = database  # psycopg connect kwargs, or None (SQLite)
        self._file: Any = None
        self._conn: Any = None

    def acquire(self) -> None:
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
                "its own GPUPROXY_DATA_DIR and database if it really drives other GPUs."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        if self.database is not None:
            import psycopg

            conn = psycopg.connect(**self.database, autocommit=True)
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", [LOCK_KEY]).fetchone()[0]
            if not got:
                conn.close()
                self.release()
                where = (f"{self.database.get('dbname')!r} on "
                         f"{self.database.get('host') or 'localhost'}")
                raise AlreadyServing(
                    f"another gpuproxy serve is using the database {where}: one scheduler per "
                    "GPU box. Stop it first, or point this one at its own database "
                    "(DATABASE_URL).")
            self._conn = conn

    def release(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
                self._file.close()
            self._file = None
