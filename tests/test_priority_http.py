"""The X-LlamaSwap-Priority header through HTTP: Daphne, real fake upstreams, PostgreSQL."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate
from tests.helpers import queue_until as wait_queue

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int, scheduler: str) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
      other:
        cmd: {FAKE}
      third:
        cmd: {FAKE}
    groups:
      all:
        swap: true
        members: [solo, other, third]
    routing:
      scheduler:
        use: {scheduler}
        settings:
          fifo:
            priority: {{other: 5}}
    """


class Caller(threading.Thread):
    """One chat request in the background; records when its answer completed."""

    finished: list[str] = []
    lock = threading.Lock()

    def __init__(self, base: str, name: str, model: str, priority: str | None,
                 hold: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.base, self.name, self.model = base, name, model
        self.headers = {"X-Fake-Hold": str(hold)}
        if priority is not None:
            self.headers["X-LlamaSwap-Priority"] = priority
        self.status: int | None = None

    def run(self) -> None:
        with httpx.Client(base_url=self.base, trust_env=False, timeout=60) as h:
            r = h.post("/v1/chat/completions", headers=self.headers, json={
                "model": self.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}]})
        self.status = r.status_code
        with self.lock:
            self.finished.append(self.name)


def test_interactive_overtakes_queued_batch_under_serial(serve):
    start = free_port()
    proxy = serve(config(start, "serial"))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    first = Chat(proxy.base, "solo", gate="first")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    batch = [Chat(proxy.base, "solo", "batch") for _ in range(5)]
    wait_queue(proxy, lambda q: len(q["queued"]) == 5)
    urgent = Chat(proxy.base, "solo", "interactive")
    q = wait_queue(proxy, lambda q: len(q["queued"]) == 6)
    assert q["scheduler"] == "serial"
    head = q["queued"][0]
    assert (head["band"], head["position"]) == ("interactive", 1)
    open_gate(start + 1, "first")  # solo sorts after other: the second port
    for c in [first, *batch, urgent]:
        assert c.answered().status_code == 200
    # the upstream's own count: exact order, where test threads noticing answers is not
    assert first.served < urgent.served < min(c.served for c in batch)


def test_unparseable_header_counts_as_zero(serve):
    proxy = serve(config(free_port(), "serial"))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    first = Caller(proxy.base, "first", "solo", None, hold=1.0)
    first.start()
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    # (surrounding spaces are unit-tested: HTTP clients strip them before they reach us)
    callers = [Caller(proxy.base, "junk", "solo", "1e3"), Caller(proxy.base, "plus", "solo",
                                                                  "+7")]
    for c in callers:
        c.start()
    q = wait_queue(proxy, lambda q: len(q["queued"]) == 2)
    assert [(w["priority"], w["band"]) for w in q["queued"]] == [(7, "normal"), (0, "normal")]
    for c in [first, *callers]:
        c.join(60)
        assert c.status == 200  # a bad header is not an error


def test_fifo_adds_the_header_to_the_model_priority(serve):
    proxy = serve(config(free_port(), "fifo"))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    busy = Caller(proxy.base, "busy", "solo", None, hold=1.5)
    busy.start()
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    # other and third would evict busy `solo`: they queue, ordered by fifo priority + header
    callers = [Caller(proxy.base, "o-batch", "other", "batch"),  # 5 - 100 = -95
               Caller(proxy.base, "t-normal", "third", None),  # 0
               Caller(proxy.base, "t-batch", "third", "-96")]  # -96
    for n, c in enumerate(callers, 1):
        c.start()
        wait_queue(proxy, lambda q, n=n: len(q["queued"]) == n)
    q = proxy.http.get("/api/queue").json()
    assert q["scheduler"] == "fifo"
    assert [(w["model"], w["priority"]) for w in q["queued"]] == [
        ("third", 0), ("other", -100), ("third", -96)]
    for c in [busy, *callers]:
        c.join(60)
        assert c.status == 200


def test_reimport_switches_the_scheduler_live_keeping_the_queue(serve, tmp_path):
    """A re-import from another process while requests wait: the running proxy switches
    fifo -> serial at once (no restart) and every waiting request is still served."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from tests.conftest import database_url

    start = free_port()
    proxy = serve(config(start, "fifo"), extra_env={"GPUPROXY_RELOAD_SECONDS": "0.1"})
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    busy = Caller(proxy.base, "busy", "solo", None, hold=3)
    busy.start()
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    waiting = [Caller(proxy.base, f"w{i}", m, p) for i, (m, p) in
               enumerate([("other", "batch"), ("third", None), ("other", "interactive")])]
    for c in waiting:
        c.start()
    wait_queue(proxy, lambda q: len(q["queued"]) == 3 and q["scheduler"] == "fifo")

    new = tmp_path / "serial.yaml"
    new.write_text(textwrap.dedent(config(start, "serial")))
    env = {**os.environ, "DATABASE_URL": database_url(),
           "GPUPROXY_DATA_DIR": str(tmp_path / "data")}
    subprocess.run([str(Path(sys.executable).with_name("gpuproxy")), "import_config", str(new)],
                   check=True, env=env, capture_output=True)
    q = wait_queue(proxy, lambda q: q["scheduler"] == "serial")
    assert sorted(w["model"] for w in q["queued"]) == ["other", "other", "third"]
    assert q["queued"][0]["band"] == "interactive"  # ranked by score now
    for c in [busy, *waiting]:
        c.join(60)
        assert c.status == 200
