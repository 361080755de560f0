"""No upstream outlives its proxy, and one proxy per GPU box.

A model server holds gigabytes of GPU memory; one left behind by a crashed proxy makes every
later load fail. Three defences, each covering what the previous cannot:

1. `pdeathsig_argv`: the upstream is started through util-linux's `setpriv --pdeathsig
   SIGKILL`, so the kernel kills it the moment the proxy dies, even by SIGKILL (nothing in
   the proxy runs then). It reaches only the process the proxy started, not what that one
   started in turn (a wrapper script's children).
2. `ProcessRecords`: every upstream's process group, run mark and escaped members are
   written to the data dir while it runs. At the next start the proxy stops what an earlier
   proxy that is gone left (checking process start times, so a recycled pid is never hit, and
   leaving alone the upstreams of a proxy that still runs).
3. One proxy per data dir and per database: `gpuproxy/shell/instance.py` (`InstanceLock`).

No Django here: `serve` passes the paths and the connection settings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpuproxy.upstream.orphans")

_SETPRIV = shutil.which("setpriv")


def pdeathsig_argv(argv: list[str]) -> list[str]:
    """`argv` prefixed so that the kernel SIGKILLs it when the proxy dies (Linux)."""
    if _SETPRIV is None:
        return argv
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def _read(path: str) -> bytes | None:
    """A whole small /proc file (raw os calls: a scan reads hundreds of them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (field 3 on), or None if gone."""
    raw = _read(f"/proc/{pid}/stat")
    return raw.rsplit(b")", 1)[1].split() if raw else None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat):
    with the pid, it names one process for good."""
    fields = _stat(pid)
    return fields[19].decode() if fields else None


# -- the processes of one upstream ---------------------------------------------------------------
#
# An upstream is more than the process the proxy started (its leader): a wrapper script's
# children share its process group, but a launcher that daemonises its server (double fork,
# `setsid`), or a server that starts helpers in sessions of their own, leaves the group, and
# the parent-death signal reaches only the leader. So an upstream's members are found by
# everything that can tie a process to it, each covering what the others cannot:
#   - its process group and its session (the leader leads both: `start_new_session`);
#   - descent: children of the leader or of a member, at the moment of the scan;
#   - its run mark: the environment variable RUN_MARK, set to a value unique to the run, which
#     every descendant inherits, even one that left the tree and was reparented to init.
# No child subreaper (PR_SET_CHILD_SUBREAPER): orphans would then become the proxy's children,
# and reaping them without stealing the exit status of a child that asyncio, or a
# `subprocess.run` on some other thread, waits for is not possible in general.

RUN_MARK = "GPUPROXY_RUN"


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int


def _proc_table() -> dict[int, _Proc]:
    """Every live process (zombies left out: they hold nothing), from /proc."""
    table: dict[int, _Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat(name)
        if fields is None or fields[0] in (b"Z", b"X"):
            continue
        pid = int(name)
        table[pid] = _Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]),
                           int(fields[19]))
    return table


def _has_mark(pid: int, mark: bytes) -> bool:
    environ = _read(f"/proc/{pid}/environ")
    return environ is not None and mark in environ.split(b"\0")


def find_members(leader: int, leader_start: str | None, mark: str | None,
                 known: dict[int, str] | None = None) -> dict[int, str]:
    """The live processes of the upstream led by `leader` (started at `leader_start`), the
    leader left out, as pid -> start time: its group, its session, its descendants and those
    of `known` members, and every process carrying its run mark.

    Group and session ids count only while the leader's pid is its own or free: the kernel
    keeps a pid that is still some group's or session's id from being reused, so a pid reused
    by another process means its old group is empty, and that process's group is not ours."""
    table = _proc_table()
    now_start = start_time(leader)
    ours = now_start is None or now_start == leader_start
    found: dict[int, str] = {}
    roots = [leader] if ours else []
    for pid, start in (known or {}).items():
        p = table.get(pid)
        if p is not None and str(p.start) == start:
            found[pid] = start
            roots.append(pid)
    oldest = int(leader_start) if leader_start is not None else 0
    wanted = f"{RUN_MARK}={mark}".encode() if mark else None
    skip = (leader, os.getpid())
    for p in table.values():
        if p.pid in skip or p.pid in found:
            continue
        if (ours and (p.pgid == leader or p.sid == leader)) or (
                wanted is not None and p.start >= oldest and _has_mark(p.pid, wanted)):
            found[p.pid] = str(p.start)
            roots.append(p.pid)
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    while roots:
        for child in children.get(roots.pop(), ()):
            if child not in found and child not in skip:
                found[child] = str(table[child].start)
                roots.append(child)
    return found


def signal_members(members: dict[int, str], sig: int) -> list[int]:
    """Signal each member that is still the same process (pid and start time); returns the
    pids signalled."""
    hit = []
    for pid, start in members.items():
        if start_time(pid) != start:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            hit.append(pid)
    return hit


def alive_members(members: dict[int, str]) -> dict[int, str]:
    """Those of `members` that still run (a zombie does not)."""
    out = {}
    for pid, start in members.items():
        fields = _stat(pid)
        if fields is not None and fields[0] not in (b"Z", b"X") and fields[19].decode() == start:
            out[pid] = start
    return out


def command_of(pid: int) -> str:
    """A process's command line, for a log line or an error a person reads."""
    raw = _read(f"/proc/{pid}/cmdline") or b""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a) or "?"


class ProcessRecords:
    """One small JSON file per running upstream, named by its process group id.

    A record names the proxy that wrote it by pid and start time, so a sweep never touches
    the upstreams of a proxy that still runs (a `make run` beside a test run, a second serve
    refused by the instance lock); and it carries the run's mark and the members found
    outside the group, so a sweep after a crash stops those too."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, pgid: int) -> Path:
        return self.dir / f"{pgid}.json"

    def add(self, model: str, pid: int, cmd: str, mark: str | None = None) -> None:
        me = os.getpid()
        self._write(pid, {"model": model, "pgid": pid, "cmd": cmd,
                          "start_time": start_time(pid), "proxy_pid": me,
                          "proxy_start_time": start_time(me), "mark": mark, "members": {}})

    def note_members(self, pid: int, members: dict[int, str]) -> None:
        """Add newly found members to the record of the upstream led by `pid`."""
        try:
            record = json.loads(self._path(pid).read_text())
        except (OSError, ValueError):
            return
        known = record.get("members") or {}
        new = {str(p): s for p, s in members.items() if str(p) not in known}
        if new:
            record["members"] = {**known, **new}
            self._write(pid, record)

    def _write(self, pid: int, record: dict[str, Any]) -> None:
        try:
            self._path(pid).write_text(json.dumps(record))
        except OSError as exc:
            logger.warning("cannot record upstream %r (pid %d) in %s: %s; if the proxy "
                           "crashes it may survive it", record.get("model"), pid, self.dir, exc)

    def remove(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(pid).unlink()

    def sweep(self, grace: float = 5.0) -> list[str]:
        """Stop everything an earlier proxy that is gone left running; returns their models.
        SIGTERM first, SIGKILL after `grace` seconds."""
        stopped: list[tuple[str, dict[int, str], int]] = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record: dict[str, Any] = json.loads(path.read_text())
                pgid = int(record["pgid"])
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if _proxy_alive(record):
                continue  # its proxy runs (this one, or another): its upstreams are its own
            model = str(record.get("model"))
            leader_start = record.get("start_time")
            known = {int(p): str(s) for p, s in (record.get("members") or {}).items()}
            members = find_members(pgid, leader_start, record.get("mark"), known)
            if leader_start is not None and start_time(pgid) == leader_start:
                members[pgid] = leader_start
            if members:
                logger.warning('stopping model "%s" (process group %d, pids %s), left running '
                               "by an earlier gpuproxy that did not exit cleanly: %s", model,
                               pgid, _pids(members), str(record.get("cmd", ""))[:200])
                signal_members(members, signal.SIGTERM)
                stopped.append((model, members, pgid))
            path.unlink(missing_ok=True)
        deadline = time.monotonic() + grace
        while stopped and time.monotonic() < deadline and any(
                alive_members(m) for _, m, _ in stopped):
            time.sleep(0.05)
        for model, members, pgid in stopped:
            left = alive_members(members)
            if left:
                logger.warning('model "%s" (process group %d, pids %s) ignored SIGTERM for %g '
                               "s: SIGKILL", model, pgid, _pids(left), grace)
                signal_members(left, signal.SIGKILL)
        return [m for m, _, _ in stopped]


def _pids(members: dict[int, str]) -> str:
    return ", ".join(str(p) for p in sorted(members))


def _proxy_alive(record: dict[str, Any]) -> bool:
    """Whether the proxy that wrote `record` still runs: the same pid and start time (a
    record of this very process counts; one without a start time is from an older proxy,
    judged by its pid alone only when it is this one)."""
    pid = record.get("proxy_pid")
    if not isinstance(pid, int):
        return False
    if pid == os.getpid():
        return True
    started = record.get("proxy_start_time")
    fields = _stat(pid)
    # A zombie is dead (its files, the instance lock among them, are closed already): the
    # scheduler process of a `--workers N` proxy that was SIGKILLed stays one until init
    # reaps it, and a new proxy can start in that moment.
    return (started is not None and fields is not None and fields[19].decode() == started
            and fields[0] not in (b"Z", b"X"))
