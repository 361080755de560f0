"""The X-LlamaSwap-Priority header through HTTP: Daphne, real fake upstreams, PostgreSQL."""

from __future__ import annotations

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
    start = free_port()
    proxy = serve(config(start, "serial"))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    first = Chat(proxy.base, "solo", gate="first")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    # (surrounding spaces are unit-tested: HTTP clients strip them before they reach us)
    callers = [Chat(proxy.base, "solo", "1e3"), Chat(proxy.base, "solo", "+7")]
    q = wait_queue(proxy, lambda q: len(q["queued"]) == 2)
    assert [(w["priority"], w["band"]) for w in q["queued"]] == [(7, "normal"), (0, "normal")]
    open_gate(start + 1, "first")  # solo sorts after other: the second port
    for c in [first, *callers]:
        assert c.answered().status_code == 200  # a bad header is not an error


def test_fifo_adds_the_header_to_the_model_priority(serve):
    start = free_port()
    proxy = serve(config(start, "fifo"))
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    busy = Chat(proxy.base, "solo", gate="busy")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    # other and third would evict busy `solo`: they queue, ordered by fifo priority + header
    callers = [Chat(proxy.base, "other", "batch", start=False),  # 5 - 100 = -95
               Chat(proxy.base, "third", None, start=False),  # 0
               Chat(proxy.base, "third", "-96", start=False)]  # -96
    for n, c in enumerate(callers, 1):
        c.start()
        wait_queue(proxy, lambda q, n=n: len(q["queued"]) == n)
    q = proxy.http.get("/api/queue").json()
    assert q["scheduler"] == "fifo"
    assert [(w["model"], w["priority"]) for w in q["queued"]] == [
        ("third", 0), ("other", -100), ("third", -96)]
    open_gate(start + 1, "busy")
    for c in [busy, *callers]:
        assert c.answered().status_code == 200


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
    busy = Chat(proxy.base, "solo", gate="busy")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    waiting = [Chat(proxy.base, m, p) for m, p in
               [("other", "batch"), ("third", None), ("other", "interactive")]]
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
    open_gate(start + 1, "busy")  # only now: the switch happened with all three waiting
    for c in [busy, *waiting]:
        assert c.answered().status_code == 200
