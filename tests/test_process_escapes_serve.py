"""A real `gpuproxy serve` in front of upstreams that misbehave as processes
(`gpuproxy.testing.badprocess`): nothing they do wedges a model, the scheduler or shutdown,
survives a crash of the proxy, or reaches a client.

Every process a test started is checked gone afterwards, by the pytest marker its environment
inherits (see `no_leftovers`), and killed by pid if not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKE, free_port, processes_matching
from tests.helpers import one_model, running, until
from tests.test_process_escapes import alive, no_leftovers

__all__ = ["no_leftovers"]  # the autouse fixture, shared

pytestmark = pytest.mark.django_db(transaction=True)

BAD = f"{sys.executable} -m gpuproxy.testing.badprocess"


def _fakes(marker: str) -> list[int]:
    """The fake servers (not their launchers) whose command line carries `marker`."""
    return [p for p in processes_matching(marker)
            if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2]
            == b"gpuproxy.testing.fakellm"]


def test_sigterm_to_the_proxy_does_not_hang_on_a_deaf_daemon(serve):
    """F2: a daemon that left the launcher's group, ignores SIGTERM and keeps its stdout used
    to hold the proxy's shutdown for as long as it lived."""
    start = free_port()
    marker = f"deaf-daemon-{start}"
    proxy = serve(one_model(start, "unloadTimeout: 1", cmd=(
        f"{BAD} daemonize --wait -- {FAKE} --ignore-sigterm --model {marker}")))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    [daemon] = _fakes(marker)

    proxy.proc.send_signal(signal.SIGTERM)
    try:
        proxy.proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail("the proxy did not exit within 15 s of SIGTERM (unloadTimeout is 1 s)")

    until("the daemon is gone", lambda: not alive(daemon), within=5)
    assert "shutting down: stopping 1 upstream(s)" in proxy.output()


def test_a_crash_whose_leftovers_hold_stdout_restarts_on_the_next_request(serve):
    """The server dies, its wrapper exits with its code, a sidecar in the group keeps the
    output pipe: the model is stopped (not `ready` with no pid) and the next request starts it
    again instead of getting "connect failed"."""
    start = free_port()
    proxy = serve(one_model(start, cmd=f"{BAD} wrap --sidecar -- {FAKE} --crash-after 2"))
    chat = {"model": "solo", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert proxy.http.post("/v1/chat/completions", json=chat).status_code == 200
    first = running(proxy)["solo"]["pid"]
    with contextlib.suppress(httpx.HTTPError):  # the crash: its answer is cut short
        proxy.http.post("/v1/chat/completions", json=chat)

    until("the crashed model is no longer running", lambda: "solo" not in running(proxy))
    r = proxy.http.post("/v1/chat/completions", json=chat)

    assert r.status_code == 200, r.text
    again = running(proxy)["solo"]["pid"]
    assert again != first
    assert 'model "solo"' in proxy.output() and "exited unexpectedly" in proxy.output()


def test_the_next_start_stops_a_daemon_that_left_the_group_before_the_crash(serve):
    """pdeathsig reaches the launcher only, and the group sweep misses a daemon with a session
    of its own: the records carry the run's mark, so the next proxy still finds it."""
    start = free_port()
    marker = f"escaped-daemon-{start}"
    config = one_model(start, cmd=f"{BAD} daemonize --wait -- {FAKE} --model {marker}")
    proxy = serve(config)
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    [daemon] = _fakes(marker)
    assert os.getsid(daemon) != running(proxy)["solo"]["pid"], "the daemon left the session"

    proxy.proc.send_signal(signal.SIGKILL)
    proxy.proc.wait(10)
    assert alive(daemon), "the daemon survives the proxy's crash"

    second = serve(config)
    until("the leftover daemon is stopped", lambda: not alive(daemon), within=20)
    assert "left running by an earlier crash: solo" in second.output()


def test_a_start_failure_tells_the_client_no_secret(serve):
    """C3: the model's command line (`--api-key ...`) and its output stay in the proxy's log
    and the admin; the client and the activity log get the model, the exit code and the
    port."""
    from activity.models import RequestLog

    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      leaky:
        cmd: {BAD} printenv --exit 7 -- --api-key sk-UPSTREAM-SECRET-123 --port ${{PORT}}
        env: ["ZZ_SECRET_TOKEN=tok-ENV-SECRET-456"]
    """)

    r = proxy.http.post("/v1/chat/completions", json={"model": "leaky", "messages": []})

    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "start_failed"
    assert error["message"] == (f'model "leaky" failed to start: its command exited with code 7 '
                                f"during start (port {start}); the proxy's log has the details")
    assert "sk-UPSTREAM" not in r.text and "tok-ENV" not in r.text
    until("the proxy's log has the command and the output",
          lambda: "--api-key sk-UPSTREAM-SECRET-123" in proxy.output()
          and "ARGV sk-UPSTREAM-SECRET-123" in proxy.output())
    row = until("the activity row is written",
                lambda: RequestLog.objects.filter(model="leaky").first())
    assert "sk-UPSTREAM" not in row.error and "tok-ENV" not in row.error
    assert f"port {start}" in row.error


def test_shutdown_counts_the_upstreams_that_run(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      a:
        cmd: {FAKE}
      b:
        cmd: {FAKE}
      c:
        cmd: {FAKE}
    groups:
      trio: {{swap: false, exclusive: false, members: [a, b, c]}}
    """)
    for m in ("a", "b", "c"):
        assert proxy.http.post(f"/api/models/load/{m}").status_code == 200
    assert proxy.http.post("/api/models/unload/c").status_code == 200
    assert sorted(running(proxy)) == ["a", "b"]

    proxy.proc.send_signal(signal.SIGTERM)
    proxy.proc.wait(30)

    assert "shutting down: stopping 2 upstream(s)" in proxy.output(), proxy.output()[-2000:]
