"""No upstream outlives the proxy, even a SIGKILLed one, and one proxy per GPU box."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuproxy.upstream.orphans import ProcessRecords
from tests.conftest import database_url, free_port, processes_matching
from tests.helpers import one_model, process_gone, running, until
from tests.test_process_escapes import alive

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_sigkilled_proxy_takes_its_upstream_with_it(serve):
    proxy = serve(one_model(free_port()))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    pid = running(proxy)["solo"]["pid"]
    proxy.proc.send_signal(signal.SIGKILL)
    proxy.proc.wait(10)
    until("the upstream died with its proxy", lambda: process_gone(pid), within=10)


def test_the_next_start_stops_what_a_crash_left_behind(serve, tmp_path: Path):
    """A wrapper script's child is out of the kernel's reach (the parent-death signal hits
    only the wrapper); the next proxy on the same data dir finds its process group in the
    records and stops it."""
    start = free_port()
    marker = f"orphan-marker-{start}"
    wrapped = (f"sh -c '{sys.executable} -m gpuproxy.testing.fakellm --port {start} "
               f"--model {marker} & wait'")
    proxy = serve(one_model(start, cmd=wrapped))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    [child] = [p for p in processes_matching(marker) if _argv0(p) == sys.executable]
    [wrapper] = [p for p in processes_matching(marker) if p != child]
    proxy.proc.send_signal(signal.SIGKILL)
    proxy.proc.wait(10)
    until("the wrapper died with the proxy", lambda: process_gone(wrapper), within=10)
    assert not process_gone(child), "the grandchild should have survived the crash"

    second = serve(one_model(start, cmd=wrapped))
    until("the leftover is stopped", lambda: process_gone(child), within=20)
    assert "left running by an earlier crash: solo" in second.output()


def _argv0(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def _second_serve(tmp_path: Path, data_dir: Path) -> subprocess.CompletedProcess:
    cfg = tmp_path / "second.yaml"
    cfg.write_text(one_model(free_port()))
    env = {**os.environ, "DATABASE_URL": database_url(), "GPUPROXY_DATA_DIR": str(data_dir)}
    return subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
         "--listen", f"127.0.0.1:{free_port()}"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_second_proxy_on_the_same_data_dir_refuses_to_start(serve, tmp_path: Path):
    first = serve(one_model(free_port()))
    result = _second_serve(tmp_path, tmp_path / "data")
    assert result.returncode != 0
    assert f"another gpuproxy serve (pid {first.proc.pid}) is running on the data dir" \
        in result.stderr
    assert first.http.get("/health").status_code == 200  # the first is untouched


@pytest.mark.postgres
def test_a_second_proxy_on_the_same_database_refuses_to_start(serve, tmp_path: Path):
    first = serve(one_model(free_port()))
    result = _second_serve(tmp_path, tmp_path / "other-data")
    assert result.returncode != 0
    assert "another gpuproxy serve for the node" in result.stderr  # both the host's name
    assert first.http.get("/health").status_code == 200


# A stand-in for another proxy: it starts an upstream in a session of its own (no parent-death
# signal, as if it had escaped it), records it as `gpuproxy serve` does, says the pid and stays
# until its stdin closes or it is killed.
_OTHER_PROXY = textwrap.dedent("""
    import subprocess, sys, pathlib
    from gpuproxy.upstream.orphans import ProcessRecords
    up = subprocess.Popen(["sleep", "600"], start_new_session=True)
    ProcessRecords(pathlib.Path(sys.argv[1])).add("theirs", up.pid, "sleep 600")
    print(up.pid, flush=True)
    sys.stdin.read()
""")


def _other_proxy(records: Path) -> tuple[subprocess.Popen, int]:
    """Another proxy (`_OTHER_PROXY`) with one upstream recorded in `records`."""
    other = subprocess.Popen([sys.executable, "-c", _OTHER_PROXY, str(records)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None
    return other, int(other.stdout.readline())


def _end(other: subprocess.Popen, upstream: int) -> None:
    other.kill()
    other.wait(10)
    if alive(upstream):
        with contextlib.suppress(ProcessLookupError):
            os.kill(upstream, signal.SIGKILL)


def test_a_sweep_leaves_the_upstreams_of_a_proxy_that_still_runs(tmp_path: Path):
    """A record names its proxy by pid and start time: while that proxy runs, a sweep (a
    `make run` beside a test run, a second serve) never stops its upstreams; once it is
    gone, they are stopped."""
    records = tmp_path / "upstreams"
    other, upstream = _other_proxy(records)
    try:
        assert ProcessRecords(records).sweep(grace=1) == []
        assert alive(upstream), "the sweep stopped the upstream of a live proxy"
        assert len(list(records.glob("*.json"))) == 1, "and its record stays"

        other.kill()
        other.wait(10)
        assert ProcessRecords(records).sweep(grace=1) == ["theirs"]
        until("the dead proxy's upstream is stopped", lambda: not alive(upstream), within=5)
        assert not list(records.glob("*.json"))
    finally:
        _end(other, upstream)


def test_a_sweep_counts_a_dead_proxy_not_yet_reaped_as_gone(tmp_path: Path):
    """A SIGKILLed proxy is a zombie until its parent reaps it, with its pid and start time
    still in /proc (the scheduler process of `serve --workers N` whose supervisor was
    killed: init reaps it when it gets to it). A proxy started in that moment must still
    stop what it left."""
    records = tmp_path / "upstreams"
    other, upstream = _other_proxy(records)
    try:
        other.kill()
        os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        assert Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert ProcessRecords(records).sweep(grace=1) == ["theirs"]
        until("the dead proxy's upstream is stopped", lambda: not alive(upstream), within=5)
    finally:
        _end(other, upstream)
