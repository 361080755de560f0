"""Issue 20's metrics: the `endpoint` label (one classification for the metrics and the
activity log), time to first token for streaming requests only, queue-wait buckets to 6 h,
`gpuproxy_build_info`, and the unit tests of the new alert rules run by `promtool`."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from activity import endpoints
from activity.endpoints import endpoint
from gpuproxy.observe import exposition, metrics
from gpuproxy.proxy.inference import INFERENCE_PATHS, PROXY_PATTERN, VERSIONLESS
from tests.conftest import free_port
from tests.helpers import one_model, tool

ROOT = Path(__file__).resolve().parent.parent
ALERT_TESTS = ROOT / "docs" / "prometheus" / "gpuproxy-alerts.test.yml"


# ---- the classification ----------------------------------------------------------------------


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/chat/completions", "chat"),
    ("/v/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/completion", "completions"),
    ("/v1/responses", "responses"),
    ("/v1/messages", "messages"),
    ("/v/messages/count_tokens", "count_tokens"),
    ("/v1/embeddings", "embeddings"),
    ("/v/embeddings", "embeddings"),
    ("/rerank", "rerank"),
    ("/v1/reranking", "rerank"),
    ("/infill", "infill"),
    ("/v1/audio/speech", "speech"),
    ("/v1/audio/voices", "voices"),
    ("/v1/audio/transcriptions", "transcriptions"),
    ("/v/audio/transcriptions", "transcriptions"),
    ("/v1/images/generations", "image_generations"),
    ("/v1/images/edits", "image_edits"),
    ("/props", "props"),
    ("/upstream/coder/v1/chat/completions", "upstream"),
    ("/upstream/coder/", "upstream"),
    # never the raw path: anything else is one bounded value
    ("/v1/models", "other"),
    ("/v1/chat/completions/", "other"),
    ("/upstream", "other"),
    ("/v/", "other"),
    ("/v/models", "other"),
    ("/V1/CHAT/COMPLETIONS", "other"),
    ("/" + "x" * 5000, "other"),
])
def test_endpoint_of_a_path(path: str, expected: str) -> None:
    assert endpoint(path) == expected


def test_every_inference_path_the_proxy_answers_has_its_own_endpoint() -> None:
    """A path added to gpuproxy/proxy/inference.py without a classification would count as
    `other`: the two lists must name the same paths."""
    assert set(endpoints.BY_PATH) == set(INFERENCE_PATHS) - set(VERSIONLESS)
    assert all(endpoint(p) != endpoints.OTHER for p in INFERENCE_PATHS)
    assert "^upstream/" in PROXY_PATTERN  # the passthrough prefix `upstream` stands for
    assert len(endpoints.ALL) == len(set(endpoints.ALL)) == 16
    assert {endpoint(p) for p in INFERENCE_PATHS} | {"upstream", "other"} == set(endpoints.ALL)


@pytest.mark.parametrize(("status", "expected"), [
    (200, "2xx"), (206, "2xx"), (302, "3xx"), (400, "4xx"), (429, "4xx"), (499, "4xx"),
    (500, "5xx"), (502, "5xx"), (503, "5xx"), (599, "5xx"), (0, "none"), (600, "none"),
    (99, "none"), (-1, "none"),
])
def test_status_class(status: int, expected: str) -> None:
    assert metrics.status_class(status) == expected


# ---- what observe_request counts -------------------------------------------------------------


def _row(model: str, path: str, *, stream: bool, status: int = 200, outcome: str = "ok",
         ttft_ms: float | None = 250.0) -> dict:
    return {"model": model, "path": path, "stream": stream, "band": "normal",
            "status_code": status, "outcome": outcome, "duration_ms": 1500.0,
            "ttft_ms": ttft_ms, "prompt_tokens": None, "completion_tokens": None,
            "queue_wait_ms": 0.0, "swap_ms": None}


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_ttft_counts_streaming_requests_only_and_non_streaming_go_to_time_to_response():
    model = "unit-ttft-model"
    metrics.observe_request(_row(model, "/v1/chat/completions", stream=True))
    metrics.observe_request(_row(model, "/v/chat/completions", stream=True))
    metrics.observe_request(_row(model, "/v1/chat/completions", stream=False))
    metrics.observe_request(_row(model, "/v1/embeddings", stream=False))
    metrics.observe_request(_row(model, "/v1/embeddings", stream=False, status=503,
                                 outcome="start_failed", ttft_ms=None))

    chat = {"model": model, "endpoint": "chat"}
    embeddings = {"model": model, "endpoint": "embeddings"}
    assert _value("gpuproxy_time_to_first_token_seconds_count", **chat) == 2
    assert _value("gpuproxy_time_to_first_token_seconds_sum", **chat) == 0.5
    assert _value("gpuproxy_time_to_response_seconds_count", **chat) == 1
    assert _value("gpuproxy_time_to_first_token_seconds_count", **embeddings) == 0
    assert _value("gpuproxy_time_to_response_seconds_count", **embeddings) == 1
    assert _value("gpuproxy_request_duration_seconds_count", **embeddings) == 2
    assert _value("gpuproxy_requests_total", band="normal", outcome="ok",
                  status_class="2xx", **chat) == 3
    assert _value("gpuproxy_requests_total", band="normal", outcome="start_failed",
                  status_class="5xx", **embeddings) == 1


def test_queue_wait_buckets_reach_six_hours_and_the_starvation_bound():
    metrics.observe_dispatch("batch", 12000.0)  # past an hour, within the bound
    bounds = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        if family.name == "gpuproxy_queue_wait_seconds":
            bounds = {float(s.labels["le"]): s.value for s in family.samples
                      if s.name.endswith("_bucket") and s.labels["band"] == "batch"}
    assert {3600.0, 7200.0, 12600.0, 21600.0} <= set(bounds)
    # the wait is told apart from the hours around it, not lost above the last bound
    assert bounds[12600.0] - bounds[10800.0] >= 1


def test_build_info_is_one_and_stays_one_when_processes_are_merged():
    metrics.register()
    text = generate_latest(REGISTRY).decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "gpuproxy_build_info"]
    (sample,) = family.samples
    assert sample.value == 1
    assert set(sample.labels) == {"version", "commit", "build_date"}
    assert sample.labels["version"] not in ("", None)

    merged, _ = exposition.merge(text, [("101", text), ("102", text)], "text/plain")
    (family,) = [f for f in text_string_to_metric_families(merged.decode())
                 if f.name == "gpuproxy_build_info"]
    assert [s.value for s in family.samples] == [1]


# ---- the alert rules --------------------------------------------------------------------------


def test_promtool_unit_tests_of_the_alert_rules_pass():
    """docs/prometheus/gpuproxy-alerts.test.yml: the error rate, upstream_died (its first
    occurrence included) and start-failure alerts fire when they should and only then."""
    r = subprocess.run([tool("promtool", "prometheus"), "test", "rules", ALERT_TESTS.name],
                       cwd=ALERT_TESTS.parent, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


# ---- a real proxy ------------------------------------------------------------------------------


def _scrape(proxy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = proxy.http.get("/metrics")
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def _get(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.django_db(transaction=True)
def test_a_real_proxy_labels_requests_by_endpoint_and_times_streams_apart(serve):
    """Through `serve` (at --workers 1 and 2, GPUPROXY_TEST_WORKERS): each request is counted
    under the endpoint it called, its status class, and in one timing series by its stream
    flag; the build info is 1 and says what `/api/version` says."""
    proxy = serve(one_model(free_port()))
    chat = {"model": "solo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert proxy.http.post("/v1/chat/completions", json={**chat, "stream": True}
                           ).status_code == 200
    assert proxy.http.post("/v/chat/completions", json=chat).status_code == 200
    assert proxy.http.post("/v1/embeddings", json={"model": "solo", "input": "x"}
                           ).status_code == 200
    assert proxy.http.get("/upstream/solo/v1/models").status_code == 200
    assert proxy.http.post("/v1/embeddings", json={"model": "nope", "input": "x"}
                           ).status_code == 404

    def counted(s) -> float:
        return sum(v for (name, _), v in s.items() if name == "gpuproxy_requests_total")

    deadline = time.monotonic() + 20
    s = _scrape(proxy)
    while counted(s) < 5 and time.monotonic() < deadline:  # counted after the last byte
        time.sleep(0.05)
        s = _scrape(proxy)

    ok = {"band": "normal", "outcome": "ok", "status_class": "2xx"}
    assert _get(s, "gpuproxy_requests_total", model="solo", endpoint="chat", **ok) == 2
    assert _get(s, "gpuproxy_requests_total", model="solo", endpoint="embeddings", **ok) == 1
    assert _get(s, "gpuproxy_requests_total", model="solo", endpoint="upstream", **ok) == 1
    assert _get(s, "gpuproxy_requests_total", model="", endpoint="embeddings", band="normal",
                outcome="unknown_model", status_class="4xx") == 1
    assert counted(s) == 5
    # the stream went to time to first token; the non-streamed chat and embeddings did not
    assert _get(s, "gpuproxy_time_to_first_token_seconds_count", model="solo",
                endpoint="chat") == 1
    assert _get(s, "gpuproxy_time_to_response_seconds_count", model="solo",
                endpoint="chat") == 1
    assert _get(s, "gpuproxy_time_to_response_seconds_count", model="solo",
                endpoint="embeddings") == 1
    assert _get(s, "gpuproxy_time_to_first_token_seconds_count", model="solo",
                endpoint="embeddings") == 0
    assert _get(s, "gpuproxy_request_duration_seconds_count", model="solo",
                endpoint="chat") == 2

    version = proxy.http.get("/api/version").json()
    build = [(labels, v) for (name, labels), v in s.items() if name == "gpuproxy_build_info"]
    assert build == [((("build_date", version["build_date"]), ("commit", version["commit"]),
                       ("version", version["version"])), 1.0)]
