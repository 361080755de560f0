"""`GET /metrics` of a real `gpuproxy serve`: scheduler, request, model and activity series,
parsed with prometheus_client's own text parser (no string grepping)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FAKE, free_port
from tests.helpers import Chat, memory_total_bytes, one_model, open_gate
from tests.helpers import queue_until as wait_queue

pytestmark = pytest.mark.django_db(transaction=True)

BANDS = ("interactive", "normal", "batch")
CHAT_OK = {"endpoint": "chat", "outcome": "ok", "status_class": "2xx"}


class Scrape:
    """One parsed scrape: samples by (name, sorted labels)."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"no sample {name}{labels}"
        return self.samples[key]

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def per_band(self, name: str) -> dict[str, float]:
        return {b: self.get(name, band=b) for b in BANDS}


def scrape(proxy, **headers: str) -> Scrape:
    r = proxy.http.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def scrape_until(proxy, predicate, within: float = 20.0) -> Scrape:
    """Records are counted just after the response is sent: poll until they are in."""
    deadline = time.monotonic() + within
    while True:
        s = scrape(proxy)
        if predicate(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def until_rows(n: int, within: float = 20.0) -> list:
    """The activity log's rows in dispatch order, once `n` are written (the writer batches)."""
    from activity.models import RequestLog

    deadline = time.monotonic() + within
    while True:
        rows = list(RequestLog.objects.exclude(dispatched_at=None).order_by("dispatched_at"))
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def test_queue_depth_dispatches_and_oldest_wait_per_band(serve):
    start = free_port()
    proxy = serve(one_model(start))
    s = scrape(proxy)
    assert s.per_band("gpuproxy_queue_depth") == dict.fromkeys(BANDS, 0)
    assert s.per_band("gpuproxy_queue_oldest_wait_seconds") == dict.fromkeys(BANDS, 0)
    assert s.per_band("gpuproxy_dispatched_total") == dict.fromkeys(BANDS, 0)
    assert s.get("gpuproxy_model_state", model="solo", state="stopped") == 1
    assert s.get("gpuproxy_model_state", model="solo", state="ready") == 0

    first = Chat(proxy.base, "solo", None, gate="first", name="first")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    batch_sent = time.monotonic()
    batch = [Chat(proxy.base, "solo", "batch", name=f"batch{i}") for i in range(3)]
    wait_queue(proxy, lambda q: len(q["queued"]) == 3)
    batch_seen = time.monotonic()
    urgent = Chat(proxy.base, "solo", "interactive", name="urgent")
    wait_queue(proxy, lambda q: len(q["queued"]) == 4)

    before = time.monotonic()
    s = scrape(proxy)
    after = time.monotonic()
    assert s.per_band("gpuproxy_queue_depth") == {"interactive": 1, "normal": 0, "batch": 3}
    assert s.per_band("gpuproxy_dispatched_total") == {"interactive": 0, "normal": 1,
                                                       "batch": 0}
    oldest = s.per_band("gpuproxy_queue_oldest_wait_seconds")
    # the oldest batch request arrived after we sent it and before we saw all three queued
    assert before - batch_seen <= oldest["batch"] <= after - batch_sent
    assert 0 < oldest["interactive"] < oldest["batch"]
    assert oldest["normal"] == 0
    assert s.get("gpuproxy_in_flight_requests", model="solo") == 1
    assert s.get("gpuproxy_model_state", model="solo", state="ready") == 1
    assert s.get("gpuproxy_model_state", model="solo", state="stopped") == 0

    open_gate(start, "first")
    for c in [first, *batch, urgent]:
        c.join(60)
        assert c.status == 200
    assert first.served < urgent.served < min(c.served for c in batch)

    s = scrape_until(proxy, lambda s: s.get(
        "gpuproxy_requests_total", model="solo", band="batch", **CHAT_OK) == 3)
    assert s.per_band("gpuproxy_queue_depth") == dict.fromkeys(BANDS, 0)
    assert s.per_band("gpuproxy_queue_oldest_wait_seconds") == dict.fromkeys(BANDS, 0)
    assert s.per_band("gpuproxy_dispatched_total") == {"interactive": 1, "normal": 1,
                                                       "batch": 3}
    assert s.per_band("gpuproxy_queue_wait_seconds_count") == {"interactive": 1, "normal": 1,
                                                               "batch": 3}
    # the batch requests waited at least as long as we watched them queue
    assert s.get("gpuproxy_queue_wait_seconds_sum", band="batch") >= 3 * (before - batch_seen)
    assert s.get("gpuproxy_requests_total", model="solo", band="interactive", **CHAT_OK) == 1
    assert s.get("gpuproxy_requests_total", model="solo", band="normal", **CHAT_OK) == 1
    assert s.get("gpuproxy_request_duration_seconds_count", model="solo", endpoint="chat") == 5
    # not streamed: timed as responses, not first tokens (tests/test_metrics_endpoint.py)
    assert s.get("gpuproxy_time_to_response_seconds_count", model="solo", endpoint="chat") == 5
    assert s.get("gpuproxy_tokens_total", model="solo", kind="completion") == 5  # 1 each
    assert s.get("gpuproxy_tokens_total", model="solo", kind="prompt") > 0
    assert s.get("gpuproxy_swaps_total", model="solo") == 1
    assert s.get("gpuproxy_swap_duration_seconds_count", model="solo") == 1
    assert s.get("gpuproxy_in_flight_requests", model="solo") == 0
    assert s.get("gpuproxy_pick_changed_by_aging_total") == 0
    assert s.get("gpuproxy_activity_dropped_rows_total") == 0
    assert s.get("django_db_new_connections_total", alias="default",
                 vendor=connection.vendor) >= 1


def test_aging_that_changes_the_pick_is_counted(serve):
    """agingDivisor 1 µs: a batch request queued a few milliseconds before a normal one has
    aged by far more than the 100 points between them, so it wins; without aging it would
    not have."""
    start = free_port()
    proxy = serve(one_model(start, """
    routing:
      scheduler:
        use: serial
        settings:
          serial:
            agingDivisor: 0.000001
    """))
    first = Chat(proxy.base, "solo", None, gate="first", name="first")
    wait_queue(proxy, lambda q: q["in_flight"].get("solo") == 1)
    old = Chat(proxy.base, "solo", "batch", name="old-batch")
    wait_queue(proxy, lambda q: len(q["queued"]) == 1)
    fresh = Chat(proxy.base, "solo", None, name="fresh-normal")
    wait_queue(proxy, lambda q: len(q["queued"]) == 2)
    assert scrape(proxy).get("gpuproxy_pick_changed_by_aging_total") == 0
    open_gate(start, "first")
    for c in (first, old, fresh):
        c.join(60)
        assert c.status == 200
    assert first.served < old.served < fresh.served
    s = scrape(proxy)
    assert s.get("gpuproxy_pick_changed_by_aging_total") == 1
    assert s.get("gpuproxy_pick_changed_by_affinity_total") == 0


def test_affinity_that_changes_the_pick_is_counted(serve):
    """`a` is loaded and busy; `b` (priority 5) queued before `a` (priority 0). The loaded
    model's bonus of 20 puts the `a` request first; without it `b` would win."""
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      a:
        cmd: {FAKE}
      b:
        cmd: {FAKE}
    groups:
      pair:
        swap: true
        members: [a, b]
    routing:
      scheduler:
        use: serial
        settings:
          serial:
            swapAffinityBonus: 20
    """)
    first = Chat(proxy.base, "a", None, gate="first", name="first")
    wait_queue(proxy, lambda q: q["in_flight"].get("a") == 1)
    other = Chat(proxy.base, "b", "5", name="b-5")
    wait_queue(proxy, lambda q: len(q["queued"]) == 1)
    same = Chat(proxy.base, "a", "0", name="a-0")
    wait_queue(proxy, lambda q: len(q["queued"]) == 2)
    open_gate(start, "first")  # `a` sorts first: it has the start port
    for c in (first, other, same):
        c.join(60)
        assert c.status == 200
    dispatched = until_rows(3)
    assert [(r.model, r.priority) for r in dispatched] == [("a", 0), ("a", 0), ("b", 5)]
    s = scrape(proxy)
    assert s.get("gpuproxy_pick_changed_by_affinity_total") == 1
    assert s.get("gpuproxy_pick_changed_by_aging_total") == 0
    assert s.get("gpuproxy_affinity_budget_overrides_total") == 0  # the budget is off
    assert s.get("gpuproxy_swaps_total", model="a") == 1
    assert s.get("gpuproxy_swaps_total", model="b") == 1
    assert s.get("gpuproxy_model_state", model="b", state="ready") == 1
    assert s.get("gpuproxy_model_state", model="a", state="stopped") == 1


def test_outcomes_crashes_and_start_failures(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
      broken:
        cmd: {FAKE} --exit-on-start 3
    """)
    r = proxy.http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert r.status_code == 404
    r = proxy.http.post("/v1/chat/completions", json={"model": "broken", "messages": []})
    assert r.status_code == 502
    r = proxy.http.post("/v1/chat/completions",
                        headers={"X-LlamaSwap-Priority": "batch"},
                        json={"model": "solo", "max_tokens": 2, "messages": []})
    assert r.status_code == 200
    pid = proxy.http.get("/running").json()["running"][0]["pid"]
    os.kill(pid, signal.SIGKILL)  # a crash of a ready upstream

    s = scrape_until(proxy, lambda s: s.get("gpuproxy_upstream_exits_total", model="solo") == 1
                     and s.get("gpuproxy_requests_total", model="solo", band="batch",
                               **CHAT_OK) == 1)
    assert s.get("gpuproxy_upstream_exits_total", model="solo") == 1
    assert s.get("gpuproxy_model_state", model="solo", state="stopped") == 1
    assert s.get("gpuproxy_upstream_start_failures_total", model="broken") == 1
    assert s.get("gpuproxy_upstream_exits_total", model="broken") == 0
    assert s.get("gpuproxy_model_state", model="broken", state="failed") == 1
    assert s.get("gpuproxy_swaps_total", model="broken") == 0
    assert s.get("gpuproxy_requests_total", model="", band="normal", endpoint="chat",
                 outcome="unknown_model", status_class="4xx") == 1
    assert s.get("gpuproxy_requests_total", model="broken", band="normal", endpoint="chat",
                 outcome="start_failed", status_class="5xx") == 1
    assert s.get("gpuproxy_tokens_total", model="solo", kind="completion") == 2
    # label values stay bounded: the unknown name never becomes a label
    assert not any(("model", "nope") in labels for _, labels in s.samples)


def test_metrics_needs_a_key_when_keys_exist(serve):
    proxy = serve(one_model(free_port(), "apiKeys: [sekrit-1]"))
    r = proxy.http.get("/metrics")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    s = scrape(proxy, Authorization="Bearer sekrit-1")
    assert s.per_band("gpuproxy_queue_depth") == dict.fromkeys(BANDS, 0)


SYSTEM_SERIES = ("gpuproxy_cpu_util_percent", "gpuproxy_memory_total_bytes",
                 "gpuproxy_memory_used_bytes", "gpuproxy_load_average",
                 "gpuproxy_network_bytes_total")


def test_performance_monitoring_off_is_200_without_system_series_and_applies_live(serve):
    """Off in the config: 200 and no system series. Switched on in the database (as an admin
    save from another process would): the running proxy starts sampling, no restart."""
    from scheduling.models import ProxySettings

    proxy = serve(one_model(free_port(), "performance: {disabled: true, every: 1s}"),
                  extra_env={"GPUPROXY_RELOAD_SECONDS": "0.1"})
    s = scrape(proxy)
    assert not {n for n in s.names() if n.startswith(SYSTEM_SERIES)}
    assert not any(n.startswith("gpuproxy_gpu_") for n in s.names())
    assert s.per_band("gpuproxy_queue_depth") == dict.fromkeys(BANDS, 0)

    settings = ProxySettings.load()
    settings.performance_monitoring = True
    settings.save()
    s = scrape_until(proxy, lambda s: "gpuproxy_memory_total_bytes" in s.names())
    assert s.get("gpuproxy_memory_total_bytes") == memory_total_bytes()
    cores = {labels for name, labels in s.samples if name == "gpuproxy_cpu_util_percent"}
    assert len(cores) == os.cpu_count()
    assert {s.get("gpuproxy_load_average", interval=i) >= 0 for i in ("1m", "5m", "15m")} \
        == {True}
    assert s.get("gpuproxy_network_bytes_total", interface="lo", direction="recv") > 0
