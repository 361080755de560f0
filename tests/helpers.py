"""What the end-to-end tests share: background chat requests, the fake upstream's gates, and
polling the proxy's own HTTP views with a deadline (the one allowed way to wait for state
that lands asynchronously in another process)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")


def one_model(start: int, extra: str = "", *, cmd: str | None = None) -> str:
    """A config with one model, `solo`, on the fake upstream at `start`, plus `extra` YAML."""
    from tests.conftest import FAKE

    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {cmd or FAKE}
    {extra}
    """


def until(what: str, predicate: Callable[[], T], within: float = 20.0) -> T:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"never happened within {within} s: {what}")
        time.sleep(0.02)


def queue_until(proxy: Any, predicate: Callable[[dict], bool], within: float = 20.0) -> dict:
    """Poll `GET /api/queue` (the scheduler's own advisory view) until `predicate` holds."""
    last: dict = {}

    def check() -> dict | None:
        nonlocal last
        last = proxy.http.get("/api/queue").json()
        return last if predicate(last) else None

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if (q := check()) is not None:
            return q
        time.sleep(0.01)
    pytest.fail(f"the queue never matched within {within} s: {last}")


def running(proxy: Any) -> dict[str, dict]:
    """`GET /running` by model id."""
    return {m["model"]: m for m in proxy.http.get("/running").json()["running"]}


def open_gate(port: int, gate: str) -> None:
    """Let the fake upstream on `port` answer the requests it holds on `gate`."""
    r = httpx.post(f"http://127.0.0.1:{port}/fake/gates/open", json={"gate": gate},
                   trust_env=False)
    assert r.status_code == 200, r.text


def memory_total_bytes() -> int:
    """MemTotal from /proc/meminfo: the kernel's own figure, not psutil's reading of it (the
    code under test uses psutil)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "MemTotal":
            number, unit = value.split()
            assert unit == "kB", line
            return int(number) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, as a service manager stops a serve (it drains), then SIGKILL after `grace`
    seconds: a test's cleanup must end even when the drain hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Chat(threading.Thread):
    """One chat request in the background.

    `served` is the upstream's own count of the request (the fake's `chatcmpl-fake-N` id):
    exact order for requests one upstream process served, where the order in which test
    threads notice their answers is not. `done` (optional) collects names as answers arrive.
    """

    def __init__(self, base: str, model: str, priority: str | None = None, *,
                 gate: str | None = None, name: str = "", max_tokens: int = 1,
                 done: list[str] | None = None, start: bool = True) -> None:
        super().__init__(daemon=True)
        self.base, self.model, self.name_, self.max_tokens = base, model, name, max_tokens
        self.headers: dict[str, str] = {}
        if priority is not None:
            self.headers["X-LlamaSwap-Priority"] = priority
        if gate is not None:
            self.headers["X-Fake-Gate"] = gate
        self.done = done
        self.response: httpx.Response | None = None
        self.status: int | None = None
        self.served = -1
        if start:
            self.start()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, trust_env=False, timeout=60) as h:
            r = h.post("/v1/chat/completions", headers=self.headers, json={
                "model": self.model, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "x"}]})
        self.response, self.status = r, r.status_code
        if r.status_code == 200:
            self.served = int(r.json()["id"].rsplit("-", 1)[1])
        if self.done is not None:
            self.done.append(self.name_)

    def answered(self, within: float = 30.0) -> httpx.Response:
        self.join(within)
        assert self.response is not None, f"no answer for {self.model} within {within} s"
        return self.response


def tool(command: str, package: str) -> str:
    """The path of a program a test drives; never a skip when it is missing, since then what
    it checks would go unchecked while the suite passes."""
    path = shutil.which(command)
    if path is None:
        pytest.fail(f"{command} is not on PATH: `make test` installs it "
                    f"(scripts/ensure-test-tools), or run: apt-get install -y {package}")
    return path


async def runtime_on(config_yaml: str) -> Any:
    """The in-process runtime of the ASGI tests on `config_yaml` (llama-swap's format),
    imported into the test database first; the test ends it with `runtime.shutdown()`."""
    from gpuproxy.shell import runtime
    from scheduling.importer import import_config
    from scheduling.llamaswap import parse_config

    parsed = parse_config(config_yaml, {})
    await runtime.run_db(lambda: import_config(parsed))
    return await runtime.get()


def chat_communicator(headers: list[tuple[bytes, bytes]] | None = None,
                      client: str = "127.0.0.1") -> Any:
    """A POST /v1/chat/completions to the real ASGI application, in-process (Channels'
    ApplicationCommunicator): the test sends its body and disconnect when it chooses."""
    from channels.testing import ApplicationCommunicator

    from gpuproxy.asgi import application

    return ApplicationCommunicator(application, {
        "type": "http", "http_version": "1.1", "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "scheme": "http",
        "headers": [(b"content-type", b"application/json"), *(headers or [])],
        "client": (client, 50000), "server": ("127.0.0.1", 8080),
    })
