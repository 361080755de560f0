"""A real Prometheus server (Debian's `prometheus`) scrapes a running proxy, with a bearer
token, and answers a query for the queue depth per band."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import tool

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator:
    binary = tool("prometheus", "prometheus")
    procs: list[subprocess.Popen] = []

    def start(target: str, token: str) -> str:
        (tmp_path / "token").write_text(token)
        config = tmp_path / "prometheus.yml"
        config.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: gpuproxy
    authorization:
      type: Bearer
      credentials_file: {tmp_path / "token"}
    static_configs:
      - targets: ["{target}"]
""")
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT))
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_prometheus_scrapes_the_proxy_and_answers_queue_depth(serve, prometheus, tmp_path):
    proxy = serve(f"""
    startPort: {free_port()}
    apiKeys: [scrape-key]
    models:
      solo:
        cmd: {FAKE}
    """)
    base = prometheus(proxy.base.removeprefix("http://"), "scrape-key")
    deadline = time.monotonic() + 60
    result: list = []
    last = ""
    with httpx.Client(base_url=base, trust_env=False, timeout=5) as h:
        while time.monotonic() < deadline:  # a poll: Prometheus has no event to await
            try:
                r = h.get("/api/v1/query", params={"query": "gpuproxy_queue_depth"})
                last = r.text
                result = r.json()["data"]["result"] if r.status_code == 200 else []
            except httpx.TransportError as exc:
                last = repr(exc)
            if len(result) == 3:
                break
            time.sleep(0.2)
        targets = h.get("/api/v1/targets").json()
    log = (tmp_path / "prometheus.log").read_text(errors="replace")
    assert len(result) == 3, f"no answer: {last}\ntargets: {targets}\n{log[-3000:]}"
    by_band = {r["metric"]["band"]: float(r["value"][1]) for r in result}
    assert by_band == {"interactive": 0.0, "normal": 0.0, "batch": 0.0}
    assert {r["metric"]["job"] for r in result} == {"gpuproxy"}
    (target,) = targets["data"]["activeTargets"]
    assert target["health"] == "up", target
