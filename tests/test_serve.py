"""`gpuproxy serve` end to end: a real Daphne process, real fake upstreams, real PostgreSQL.

Each test starts the installed `gpuproxy` command the way a user does, against the test
database, and talks HTTP to it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import FAKE, database_url, free_port, processes_matching

pytestmark = pytest.mark.django_db(transaction=True)

def two_models(start_port: int, extra: str = "") -> str:
    return f"""
    startPort: {start_port}
    healthCheckTimeout: 15
    models:
      alpha:
        cmd: {FAKE}
        aliases: [a]
      beta:
        cmd: {FAKE} --load-seconds 0.3
      broken:
        cmd: {FAKE} --exit-on-start 1
      small:
        cmd: {FAKE}
    groups:
      big:
        swap: true
        exclusive: false
        members: [alpha, beta, broken]
      keep:
        swap: false
        exclusive: false
        persistent: true
        members: [small]
    {extra}
    """


def test_load_then_unload_through_the_api(serve):
    sp = free_port()
    proxy = serve(two_models(sp))
    assert proxy.http.get("/running").json() == {"running": []}

    r = proxy.http.post("/api/models/load/a")  # an alias
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "alpha"
    running = proxy.http.get("/running").json()["running"]
    assert [(m["model"], m["state"]) for m in running] == [("alpha", "ready")]
    assert running[0]["proxy"].endswith(f":{sp}")  # alpha is first in sorted order
    pid = running[0]["pid"]
    os.kill(pid, 0)  # the process exists
    # the upstream itself answers on its port
    assert httpx.get(f"http://127.0.0.1:{sp}/health", trust_env=False).status_code == 200

    r = proxy.http.post("/api/models/unload/alpha")
    assert r.status_code == 200
    assert proxy.http.get("/running").json() == {"running": []}
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_swap_group_unloads_the_other_member(serve):
    proxy = serve(two_models(free_port()))
    assert proxy.http.post("/api/models/load/alpha").status_code == 200
    assert proxy.http.post("/api/models/load/small").status_code == 200
    assert proxy.http.post("/api/models/load/beta").status_code == 200
    running = {m["model"]: m["state"] for m in proxy.http.get("/running").json()["running"]}
    assert running == {"beta": "ready", "small": "ready"}


def test_errors_are_openai_shaped(serve):
    proxy = serve(two_models(free_port()))
    r = proxy.http.post("/api/models/load/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "'nope'" in r.json()["error"]["message"]
    assert proxy.http.post("/api/models/unload/nope").status_code == 404

    r = proxy.http.post("/api/models/load/broken")
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert '"broken"' in message and "code 1" in message
    # the public start failure: what happened, never the upstream's output (the log has it)
    assert "the proxy's log has the details" in message
    assert "simulated start failure" not in message
    assert "simulated start failure" in proxy.output()
    assert proxy.http.get("/running").json() == {"running": []}

    r = proxy.http.get("/api/models/load/alpha")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = proxy.http.get("/no/such/path")
    assert r.status_code == 404 and "error" in r.json()


def test_unload_all_and_logs(serve):
    proxy = serve(two_models(free_port()))
    proxy.http.post("/api/models/load/alpha")
    proxy.http.post("/api/models/load/small")
    assert proxy.http.post("/api/models/unload").json() == {"msg": "ok"}
    assert proxy.http.get("/running").json() == {"running": []}
    logs = proxy.http.get("/logs").text
    assert "fakellm: model alpha listening" in logs  # upstream output
    assert 'model "alpha"' in logs  # the proxy's own lines
    r = proxy.http.get("/logs/stream/nope")
    assert r.status_code == 400


def test_logs_stream_history_then_live(serve):
    proxy = serve(two_models(free_port()))
    proxy.http.post("/api/models/load/small")
    with proxy.http.stream("GET", "/logs/stream/small") as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert "fakellm: model small listening" in next(lines)
        # a live line: the stop's own output arrives while we listen
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=30) as other:
            other.post("/api/models/unload/small")
        for line in lines:
            if "SIGTERM" in line:
                break


def test_logs_stream_of_a_model_with_no_lines_yet_answers_at_once(serve):
    """No history to send (the model never started) is no reason to hold back the head: the
    client gets its 200 now, then the lines as they come."""
    proxy = serve(two_models(free_port()))
    with proxy.http.stream("GET", "/logs/stream/small", timeout=5) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=30) as other:
            other.post("/api/models/load/small")
        for line in r.iter_lines():
            if "fakellm: model small listening" in line:
                break


def test_api_keys_guard_everything_but_health(serve):
    proxy = serve(two_models(free_port(), extra="apiKeys: [sekrit-1]"))
    assert proxy.http.get("/health").status_code == 200
    r = proxy.http.get("/running")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert proxy.http.get("/running", headers={"Authorization": "Bearer wrong"}).status_code \
        == 401
    ok = proxy.http.get("/running", headers={"Authorization": "Bearer sekrit-1"})
    assert ok.status_code == 200
    assert proxy.http.get("/running", headers={"X-Api-Key": "sekrit-1"}).status_code == 200


def test_sigterm_stops_every_upstream(serve):
    sp = free_port()
    proxy = serve(two_models(sp))
    assert proxy.http.post("/api/models/load/alpha").status_code == 200
    assert proxy.http.post("/api/models/load/small").status_code == 200
    pids = [m["pid"] for m in proxy.http.get("/running").json()["running"]]
    assert len(pids) == 2
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for p in range(sp, sp + 4):  # alpha, beta, broken, small: ports in sorted id order
        assert processes_matching(f"--port {p} --model") == []


def test_preload_hook_loads_at_start(serve):
    proxy = serve(two_models(free_port(), extra="hooks: {on_startup: {preload: [small]}}"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = proxy.http.get("/running").json()["running"]
        if [m["state"] for m in running] == ["ready"]:
            break
        time.sleep(0.05)
    assert [(m["model"], m["state"]) for m in running] == [("small", "ready")]


def test_bad_config_fails_with_the_key_path(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("models:\n  m:\n    cmd: x --port ${NOPE}\n")
    env = {**os.environ, "DATABASE_URL": database_url(),
           "GPUPROXY_DATA_DIR": str(tmp_path / "data")}
    r = subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
         "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0
    assert "models.m" in r.stderr and "NOPE" in r.stderr


def test_example_config_serves_the_demo(serve):
    """What `make run` serves: config.example.yaml, with the venv's python first on PATH.

    On ports of its own: with the demo's 5800.., a `make run` on the same machine answered
    this test's requests while the test's own upstreams failed to bind, and the test passed."""
    start = free_port()
    example = (Path(__file__).resolve().parents[1] / "config.example.yaml").read_text()
    example = example.replace("startPort: 5800", f"startPort: {start}")
    assert f"startPort: {start}" in example
    venv_bin = str(Path(sys.executable).parent)
    proxy = serve(example, extra_env={"PATH": venv_bin + os.pathsep + os.environ["PATH"]})
    r = proxy.http.post("/api/models/load/coder")
    assert r.status_code == 200, r.text
    states = {m["model"]: m["state"] for m in proxy.http.get("/running").json()["running"]}
    assert states["big-coder"] == "ready"
    assert proxy.http.post("/api/models/load/big-writer").status_code == 200
    states = {m["model"]: m["state"] for m in proxy.http.get("/running").json()["running"]}
    assert "big-coder" not in states and states["big-writer"] == "ready"
    # the openai client streams from every demo model, alternating; each answer comes from
    # the right upstream (fakellm names model and port in system_fingerprint)
    oa = openai.OpenAI(base_url=proxy.base + "/v1", api_key="x", max_retries=0,
                       http_client=httpx.Client(trust_env=False, timeout=60))
    ports = {"big-coder": start, "big-writer": start + 1, "small-chat": start + 2}  # sorted ids
    for model in ["big-coder", "small-chat", "big-writer", "big-coder", "small-chat"]:
        chunks = list(oa.chat.completions.create(
            model=model, stream=True, max_tokens=3,
            messages=[{"role": "user", "content": "hello"}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == "tok0 tok1 tok2 "
        assert {c.model for c in chunks} == {model}
        assert {c.system_fingerprint for c in chunks} == {f"fakellm:{model}:{ports[model]}"}
    assert proxy.http.post("/api/models/unload").status_code == 200
    assert proxy.http.get("/running").json() == {"running": []}


def test_a_port_that_cannot_be_listened_on_is_a_failed_start(tmp_path):
    """A service manager (systemd, `make run`, a script) must see a failed start, not a clean
    stop: the field report's `serve` on a taken port exited 0."""
    cfg = tmp_path / "one.yaml"
    cfg.write_text(f"startPort: {free_port()}\nmodels:\n  m:\n    cmd: {FAKE}\n")
    env = {**os.environ, "DATABASE_URL": database_url(),
           "GPUPROXY_DATA_DIR": str(tmp_path / "data")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run(
            [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
             "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Address already in use" in r.stderr, r.stderr
