"""UpstreamProcess against upstreams that misbehave as processes (`gpuproxy.testing.badprocess`):
launchers that daemonise their server, wrappers whose children ignore SIGTERM or keep stdout,
strangers on the model's port, servers that print what they can read.

Real processes only. Every pid a test learns is checked gone at the end (a zombie counts as
gone: it holds nothing), and killed by pid if the code under test left it behind, so a failing
test never leaks a server either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import select
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuproxy.upstream.processes import StartFailed, State, UpstreamProcess
from scheduling.spec import UpstreamSpec
from tests.test_processes import DEADLINE, Make, Recorder, make, wait_for_state, wait_until

__all__ = ["make"]  # the fixture, shared with test_processes

BAD = [sys.executable, "-m", "gpuproxy.testing.badprocess"]


def fake_argv(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(port), *flags]


def bad_spec(port: int, *argv: str, **fields) -> UpstreamSpec:
    fields.setdefault("model_id", "fake")
    return UpstreamSpec(cmd=shlex.join([*BAD, *argv]), proxy=f"http://127.0.0.1:{port}",
                        **fields)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (this box's init reaps orphans lazily)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def spawned_by(nodeid: str) -> list[int]:
    """Live processes started during test `nodeid`: they inherit pytest's
    PYTEST_CURRENT_TEST, which no upstream environment filter removes."""
    mark = f"PYTEST_CURRENT_TEST={nodeid} (".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test and its fixtures: nothing it started may still run. Leftovers are
    killed by pid (so a failure never leaks a server) and fail the test."""
    yield
    left = spawned_by(request.node.nodeid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


async def announced(proc: UpstreamProcess, what: str) -> int:
    """The pid a badprocess announced on its output (`badprocess: daemon PID`)."""
    pattern = re.compile(rf"badprocess: {what} (\d+)")
    found: list[int] = []

    def seen() -> bool:
        for line in proc._log.history():
            if m := pattern.search(line):
                found.append(int(m.group(1)))
                return True
        return False

    await wait_until(seen, 5)
    return found[0]


# -- item 1: a descendant that keeps the output pipe, or ignores SIGTERM, never wedges a model ---


async def test_unload_reaches_a_daemon_that_left_the_group_and_holds_stdout(
        make: Make, port: int) -> None:
    """`sh -c "setsid server & wait"`: SIGTERM to the launcher's group misses the daemon, and
    `Process.wait()` would wait for its pipe; the stop must still reach it, at once."""
    proc = make(bad_spec(port, "daemonize", "--wait", "--", *fake_argv(port),
                         unload_timeout=10))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    leader = proc.pid or 0
    daemon = await announced(proc, "daemon")
    assert os.getsid(daemon) != os.getsid(leader) and alive(daemon)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    await asyncio.wait_for(proc.stop(), DEADLINE)

    assert loop.time() - t0 < 5, "the daemon got SIGTERM with its launcher, not SIGKILL at 10 s"
    assert proc.state is State.STOPPED and proc.pid is None
    assert not alive(daemon) and not alive(leader)
    assert any("fakellm: SIGTERM, exiting" in line for line in proc._log.history()), (
        "the daemon stopped on its own SIGTERM")


async def test_a_sigterm_deaf_daemon_outside_the_group_gets_sigkill_at_the_deadline(
        make: Make, port: int, caplog: pytest.LogCaptureFixture) -> None:
    proc = make(bad_spec(port, "daemonize", "--wait", "--",
                         *fake_argv(port, "--ignore-sigterm"), unload_timeout=1))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    daemon = await announced(proc, "daemon")
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    with caplog.at_level(logging.WARNING, logger="gpuproxy.upstream.processes"):
        await asyncio.wait_for(proc.stop(), DEADLINE)

    took = loop.time() - t0
    assert 1.0 <= took < 4, f"stopped in {took:.2f} s; SIGKILL is due at the 1 s unload timeout"
    assert not alive(daemon)
    assert any("SIGKILL" in r.getMessage() and str(daemon) in r.getMessage()
               for r in caplog.records), "the log names the escaped pid it killed"


async def test_sigkill_reaches_a_same_group_child_after_its_wrapper_exited(
        make: Make, port: int) -> None:
    """The wrapper exits on SIGTERM, its child ignores it and keeps stdout: SIGKILL to the
    group is still due at the deadline, although the leader is already reaped."""
    proc = make(bad_spec(port, "wrap", "--", *fake_argv(port, "--ignore-sigterm"),
                         unload_timeout=1))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    leader = proc.pid or 0
    child = _children(leader)[0]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    await asyncio.wait_for(proc.stop(), DEADLINE)

    assert loop.time() - t0 < 4
    assert not alive(child) and not alive(leader)
    assert proc.state is State.STOPPED


async def test_a_dead_leader_is_a_crash_even_while_its_child_holds_stdout(
        make: Make, port: int) -> None:
    """The leader is the upstream: when it dies, what it left in its group goes too, the model
    is stopped at once (not `ready` with no pid), and the next caller starts it again."""
    seen = Recorder()
    proc = make(bad_spec(port, "wrap", "--", *fake_argv(port, "--ignore-sigterm"),
                         unload_timeout=1), seen)
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    leader = proc.pid or 0
    child = _children(leader)[0]

    os.kill(leader, signal.SIGKILL)
    await wait_for_state(proc, State.STOPPED, timeout=5)

    await wait_until(lambda: not alive(child), 5)
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    assert proc.pid is not None and proc.pid != leader
    assert seen.states == [State.STARTING, State.READY, State.STOPPED, State.STARTING,
                           State.READY]


async def test_a_launcher_that_daemonises_its_server_fails_the_start(
        make: Make, port: int) -> None:
    """Its server answers the health check, but the process we started is gone: not ready,
    a start failure that says why, and the daemon it left is stopped."""
    seen = Recorder()
    proc = make(bad_spec(port, "daemonize", "--", *fake_argv(port), health_check_timeout=15),
                seen)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    daemon = await announced(proc, "daemon")
    err = info.value
    assert (err.reason, err.exit_code) == ("exited", 0)
    assert "exited with code 0 during start" in str(err)
    assert "in the foreground" in str(err), "the remedy: do not daemonise"
    assert State.READY not in seen.states
    await wait_until(lambda: not alive(daemon), 5)


async def test_shutdown_close_does_not_hang_on_a_deaf_daemon(
        make: Make, port: int) -> None:
    proc = make(bad_spec(port, "daemonize", "--wait", "--",
                         *fake_argv(port, "--ignore-sigterm"), unload_timeout=1))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    daemon = await announced(proc, "daemon")

    await asyncio.wait_for(proc.close(), 5)

    assert not alive(daemon)
    with pytest.raises(StartFailed):
        await proc.ensure_ready()


async def test_a_pipe_holder_nothing_ties_to_the_upstream_does_not_hold_its_stop(
        make: Make, port: int) -> None:
    """A helper that cleared its environment (no run mark), left the session and the tree
    (its parent exited) and kept stdout is invisible to every member search; the output is
    still closed after a short drain, instead of waiting for it as `Process.wait()` did."""
    holder = f"29.{port}"  # a sleep no other process runs, to find it by
    script = (f"env -i setsid sh -c 'sleep {holder} &'; "
              f"exec {shlex.join(fake_argv(port))}")
    proc = make(UpstreamSpec(model_id="fake", cmd=shlex.join(["sh", "-c", script]),
                             proxy=f"http://127.0.0.1:{port}", unload_timeout=5))
    try:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
        [sleeper] = _matching(f"sleep {holder}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        await asyncio.wait_for(proc.stop(), DEADLINE)

        assert loop.time() - t0 < 3, "the stop waited for the pipe's last holder"
        assert proc.state is State.STOPPED
        assert alive(sleeper), "(it is out of reach: the drain timeout is what ended the stop)"
    finally:
        for pid in _matching(f"sleep {holder}"):
            os.kill(pid, signal.SIGKILL)


def _matching(fragment: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            with contextlib.suppress(OSError):
                if fragment in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(entry.name))
    return found


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry.name))
    assert out, f"pid {pid} has no child"
    return out


# -- item 3: a server we did not start never answers for a model --------------------------------


@pytest.fixture
def stranger(port: int) -> Iterator[subprocess.Popen]:
    """Something already serving 200 on the model's port (an orphan, another program)."""
    holder = subprocess.Popen([*BAD, "holdport", "--http", "--port", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 10)
        assert ready, "the holder never said it holds the port"
        assert f"holding port {port}" in holder.stdout.readline()
        yield holder
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


async def test_a_port_already_in_use_is_a_start_failure_naming_its_holder(
        make: Make, port: int, stranger: subprocess.Popen) -> None:
    seen = Recorder()
    proc = make(UpstreamSpec(model_id="fake", cmd=shlex.join(fake_argv(port)),
                             proxy=f"http://127.0.0.1:{port}"), seen)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    err = info.value
    assert err.reason == "port_in_use"
    assert f"port {port}" in str(err)
    assert f"pid {stranger.pid}" in str(err) and "holdport" in str(err), str(err)
    assert f"port {port}" in err.public and "holdport" not in err.public
    assert seen.states == [State.STARTING, State.FAILED]
    assert proc.pid is None
    assert stranger.poll() is None, "the stranger is named, not killed"


# -- item 5: what a client may see of a failed start ----------------------------------------------


async def test_the_public_start_failure_has_no_command_line_nor_output(make: Make,
                                                                       port: int) -> None:
    spec = bad_spec(port, "printenv", "--exit", "7", "--", "--api-key", "sk-UPSTREAM-SECRET",
                    env={"ZZ_SECRET_TOKEN": "tok-ENV-SECRET"})
    proc = make(spec)

    with pytest.raises(StartFailed) as info:
        await asyncio.wait_for(proc.ensure_ready(), DEADLINE)

    err = info.value
    detailed = str(err)
    assert "--api-key sk-UPSTREAM-SECRET" in detailed, "the log and the admin get the command"
    assert "ARGV sk-UPSTREAM-SECRET" in detailed, "... and the last output"
    assert any("tok-ENV-SECRET" in line for line in err.output_tail)
    assert "sk-UPSTREAM-SECRET" not in err.public and "tok-ENV-SECRET" not in err.public
    assert err.public == (f'model "fake" failed to start: its command exited with code 7 '
                          f"during start (port {port}); the proxy's log has the details")


# -- item 6: what an upstream inherits --------------------------------------------------------


DENIED = {"DATABASE_URL": "postgres://u:dbpass@h/db", "GPUPROXY_SECRET_KEY": "django-secret",
          "PGPASSWORD": "pgpass", "DJANGO_SETTINGS_MODULE": "gpuproxy.settings"}
KEPT = {"CUDA_VISIBLE_DEVICES": "0,1", "LD_LIBRARY_PATH": "/opt/cuda/lib64",
        "HF_HOME": "/srv/hf", "NVIDIA_VISIBLE_DEVICES": "all"}


def _env_of(lines: list[str]) -> dict[str, str]:
    return dict(line[4:].split("=", 1) for line in lines if line.startswith("ENV "))


async def test_upstreams_inherit_the_environment_without_our_secrets(
        make: Make, port: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in {**DENIED, **KEPT}.items():
        monkeypatch.setenv(name, value)
    stopped = tmp_path / "cmd_stop.env"
    cmd_stop = shlex.join([sys.executable, "-c", "import json, os, signal, sys; "
                           "open(sys.argv[1], 'w').write(json.dumps(dict(os.environ))); "
                           "os.kill(int(sys.argv[2]), signal.SIGTERM)", str(stopped)]) + " ${PID}"
    proc = make(bad_spec(port, "printenv", "--port", str(port), cmd_stop=cmd_stop,
                         env={"MODEL_OWN": "own", "PGAPPNAME": "explicitly-set"}))
    await asyncio.wait_for(proc.ensure_ready(), DEADLINE)
    await wait_until(lambda: any("serving on port" in line for line in proc._log.history()))

    env = _env_of(proc._log.history())
    for name in DENIED:
        assert name not in env, f"{name} reached the upstream"
    assert {n: env.get(n) for n in KEPT} == KEPT
    assert env["MODEL_OWN"] == "own" and env["PGAPPNAME"] == "explicitly-set", (
        "the model's own env is added, even under a denied prefix")
    assert env["PATH"] == os.environ["PATH"]

    await asyncio.wait_for(proc.stop(), DEADLINE)
    stop_env = json.loads(stopped.read_text())
    assert not set(DENIED) & set(stop_env), "cmd_stop gets the same environment"
    assert stop_env["CUDA_VISIBLE_DEVICES"] == "0,1" and stop_env["MODEL_OWN"] == "own"
