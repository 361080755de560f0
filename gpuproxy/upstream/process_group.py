"""Launching an upstream's process group, killing it, and what escapes it.

The process manager's dealings with the kernel, kept apart from its state machine: the
checks before exec, the protocol that hears the leader's exit from the child watcher the moment
it happens (never from `Process.wait()`, which also waits for every pipe to close), signalling
a group, asking whether the leader still runs without reaping it, and `Run`, the record of one
spawned leader with its members (what it started, found and signalled by `orphans`), its helper
tasks and its timers. The owner (`processes.UpstreamProcess`) decides; this carries it out.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from gpuproxy.upstream.states import OUTPUT_TAIL_LINES
from scheduling.spec import UpstreamSpec

FAILED_START_GRACE = 5.0  # SIGTERM → SIGKILL grace when a start times out (llama-swap: 5 s)
READER_DRAIN = 0.5  # after the exit, how long to wait for the last output before reporting it
GROUP_SWEEP_WAIT = 2.0  # after SIGKILL to leftovers of a group, how long to wait for them to go
KILL_GIVE_UP = 5.0  # after SIGKILL, how long a leader that does not exit is waited for
MEMBER_POLL = 0.05  # members are not our children: nothing signals their end, so poll
STREAM_LIMIT = 1 << 20  # longest upstream output line read whole (asyncio's default is 64 KiB)


def check_executable(program: str, path: str | None) -> None:
    """Raise what exec would, before exec: the upstream starts through `setpriv`, whose own
    failure to find the program would otherwise look like a server that exited at start."""
    found = shutil.which(program, mode=os.F_OK, path=path) if os.sep not in program else (
        program if os.path.exists(program) else None)
    if found is None:
        raise FileNotFoundError(program)
    if not os.access(found, os.X_OK) or os.path.isdir(found):
        raise PermissionError(program)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; False when it is already gone (nothing to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class LeaderProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus the leader's exit as it happens.

    The transport hears of the exit from the child watcher and calls `process_exited`
    (base_subprocess._process_exited) whatever its pipes do; `Process.wait()` resolves only
    in `_call_connection_lost`, once every pipe has closed too. `exited` carries the exit
    code (negative: the signal), as `Process.returncode` would."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._subprocess: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # The base keeps it too, as `_transport`, untyped: the same object, typed here.
        self._subprocess = cast(asyncio.SubprocessTransport, transport)

    def process_exited(self) -> None:
        transport = self._subprocess
        code = transport.get_returncode() if transport is not None else None
        if not self.exited.done():
            self.exited.set_result(code if code is not None else 255)
        super().process_exited()


@dataclass
class Run:
    """One spawned process and its helpers; created and dropped only by the owner."""

    gen: int
    spec: UpstreamSpec  # the spec it was started with (update_spec affects only the next run)
    cmd: str
    proc: asyncio.subprocess.Process
    transport: asyncio.SubprocessTransport
    exited: asyncio.Future[int]  # the leader's exit code, the moment it exits
    mark: str  # the value of RUN_MARK in its environment, inherited by all it starts
    leader_start: str | None  # the leader's start time (with its pid, it names the process)
    port: int | None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    reader: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    health: asyncio.Task[None] | None = None
    kill_timer: asyncio.TimerHandle | None = None
    give_up_timer: asyncio.TimerHandle | None = None
    kill_at: float | None = None
    killed_at: float | None = None  # when SIGKILL went to the group and the members
    # Set when a stop ends a start, or the leader exits during it: the start's waiters get
    # this StartFailed reason when the run is over.
    start_failure: str | None = None
    health_detail: str = ""
    stop_began: float | None = None
    idle_stop: bool = False  # the stop was its ttl's (the exit is an idle unload)
    leader_gone: bool = False  # the leader exited (or was given up on); members may remain
    members: dict[int, str] = field(default_factory=dict)  # every member seen: pid -> start
    left_at_exit: list[str] = field(default_factory=list)  # members alive when it exited
    survivors: dict[int, str] = field(default_factory=dict)  # members SIGKILL did not end

    @property
    def pid(self) -> int:
        return self.proc.pid


def leader_alive(run: Run) -> bool:
    """Whether the leader still runs, asked of the kernel without reaping it (WNOWAIT leaves
    its exit status to asyncio's child watcher): the exit notice may still be on its way."""
    if run.leader_gone or run.exited.done() or run.proc.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, run.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already
        return False


def pid_list(members: Iterable[int]) -> str:
    return ", ".join(str(p) for p in sorted(members))


def proc_state(pid: int) -> str:
    """A process's state letter (D: stuck in the kernel), for an error a person reads."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "gone"
