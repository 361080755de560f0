"""The proxy's own Prometheus series (`docs/metrics.md` is the contract), next to
django-prometheus's `django_*` ones on `/metrics`.

Three ways figures get here, chosen by who owns them:
- The scheduler's state belongs to the run loop's task alone, so the loop *publishes* an
  immutable `SchedulerSnapshot` after every event and `SchedulerCollector` renders the latest
  one at scrape time; the scrape thread never touches the scheduler. The oldest wait is
  computed at scrape time from the published arrival, so it stays exact between events.
- Facts that happen once (a request finished, a swap, a dispatch's wait) are counted where they
  happen, with ordinary prometheus_client counters and histograms (thread-safe).
- The activity writer's counters and the performance monitor's sample (gpuproxy/observe/perf/,
  taken in the background, never at scrape time) are read as they are: plain integers and an
  immutable sample swapped in whole.

Label values are bounded: model ids from the configuration ("" for a request that named no
defined model), the three bands, the outcome set, the endpoint set (activity/endpoints.py, never
the raw path), the status class and the process states. Never request ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from activity.endpoints import endpoint as endpoint_of
from gpuproxy import version
from gpuproxy.observe import published
from gpuproxy.observe.history import HISTORY
from gpuproxy.observe.perf import PerfCollector
from gpuproxy.upstream.states import State
from scheduling.core.priority import BANDS

# The `state` label's values: the process states, as gpuproxy.upstream spells them.
MODEL_STATES = tuple(state.value for state in State)

# Seconds. Waits span a few milliseconds (a free slot) to hours: a batch request is designed
# to wait up to the starvation bound, (200 + swapAffinityBonus) x agingDivisor = 12,600 s with
# the defaults (docs/scheduling.md), so the buckets go to 6 h with one at that bound; a wait
# past 6 h lands in +Inf, where a quantile can only say "over 6 h".
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                600, 1800, 3600, 7200, 10800, 12600, 14400, 21600)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
SWAP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class _PerfCollector:
    """The current runtime's monitor's series; nothing when there is none or it is off."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        monitor = published.perf_monitor()
        if monitor is not None:
            yield from PerfCollector(monitor).collect()


class SchedulerCollector:
    """Renders the latest published snapshot; the three bands are always present."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = published.scheduler_snapshot()
        now = time.monotonic()
        depth = GaugeMetricFamily(
            "gpuproxy_queue_depth",
            "Requests admitted and not yet dispatched (queued or waiting on a model load).",
            labels=["band"])
        oldest = GaugeMetricFamily(
            "gpuproxy_queue_oldest_wait_seconds",
            "How long the oldest waiting request of the band has waited; 0 when empty.",
            labels=["band"])
        dispatched = CounterMetricFamily(
            "gpuproxy_dispatched", "Requests granted an upstream slot.", labels=["band"])
        for b in BANDS:
            n, arrived = snap.waiting.get(b, (0, None))
            depth.add_metric([b], n)
            wait = 0.0 if arrived is None else max(0.0, now - (arrived + snap.clock_offset))
            oldest.add_metric([b], wait)
            dispatched.add_metric([b], snap.stats.dispatched.get(b, 0))
        yield depth
        yield oldest
        yield dispatched
        yield CounterMetricFamily(
            "gpuproxy_pick_changed_by_aging",
            "Picks whose winner would have been another request without the aging term.",
            value=snap.stats.pick_changed_by_aging)
        yield CounterMetricFamily(
            "gpuproxy_pick_changed_by_affinity",
            "Picks whose winner would have been another request without the swap-affinity "
            "bonus.", value=snap.stats.pick_changed_by_affinity)
        yield CounterMetricFamily(
            "gpuproxy_affinity_budget_overrides",
            "Times a request's affinity budget ran out, so its model ranked as loaded until it "
            "was served.", value=snap.stats.affinity_budget_overrides)
        in_flight = GaugeMetricFamily(
            "gpuproxy_in_flight_requests", "Granted requests not yet finished.",
            labels=["model"])
        for model in published.configured_models():
            in_flight.add_metric([model], snap.in_flight.get(model, 0))
        yield in_flight
        state = GaugeMetricFamily(
            "gpuproxy_model_state", "1 for the model's current process state, 0 for the others.",
            labels=["model", "state"])
        states = published.model_states()
        for model in published.configured_models():
            current = states.get(model, State.STOPPED)
            for s in MODEL_STATES:
                state.add_metric([model, s], 1 if s == current else 0)
        yield state
        pending = GaugeMetricFamily(
            "gpuproxy_model_restart_pending",
            "1 while the model waits to restart (its definition changed, or an admin asked) "
            "until its requests in flight finish.", labels=["model"])
        for model in published.configured_models():
            pending.add_metric([model], 1 if model in snap.restart_pending else 0)
        yield pending


class BuildInfoCollector:
    """`gpuproxy_build_info{version,commit,build_date} 1`: which build answers, joinable onto
    any series by instance (`* on (instance) group_left (version) gpuproxy_build_info`)."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = version.version_info()
        family = GaugeMetricFamily(
            "gpuproxy_build_info", "Always 1; the labels say which gpuproxy build this is.",
            labels=["version", "commit", "build_date"])
        family.add_metric([info["version"], info["commit"], info["build_date"]], 1)
        yield family


class ActivityCollector:
    """The activity writer's counters, read at scrape time (plain integers)."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from activity.writer import writer

        w = writer()
        yield GaugeMetricFamily(
            "gpuproxy_activity_buffered_rows",
            "Activity rows accepted and not yet written (grows during a database outage).",
            value=w.buffered)
        yield CounterMetricFamily(
            "gpuproxy_activity_dropped_rows",
            "Activity rows lost because the buffer was full.", value=w.dropped)
        yield CounterMetricFamily(
            "gpuproxy_activity_written_rows", "Activity rows written to the database.",
            value=w.written)
        yield GaugeMetricFamily(
            "gpuproxy_event_loop_tasks",
            "asyncio tasks on the server's event loop, counted every few seconds.",
            value=published.loop_tasks())
        yield CounterMetricFamily(
            "gpuproxy_activity_write_errors",
            "Failed batch writes (each retried with backoff).", value=w.write_errors)


# ---- facts counted where they happen ---------------------------------------------------------

QUEUE_WAIT = Histogram(
    "gpuproxy_queue_wait_seconds", "Arrival to dispatch, observed at dispatch.", ["band"],
    buckets=WAIT_BUCKETS)
REQUESTS = Counter(
    "gpuproxy_requests", "Finished requests by model, band, endpoint, activity-log outcome and "
    "HTTP status class.", ["model", "band", "endpoint", "outcome", "status_class"])
REQUEST_DURATION = Histogram(
    "gpuproxy_request_duration_seconds", "Arrival to the last byte of the response.",
    ["model", "endpoint"], buckets=DURATION_BUCKETS)
# Streaming requests only: for a non-streamed answer the first byte comes once the whole
# answer is computed, and mixing the two made the quantiles mean neither.
TTFT = Histogram(
    "gpuproxy_time_to_first_token_seconds",
    "Streaming requests: dispatch to the first byte of the upstream's response.",
    ["model", "endpoint"], buckets=TTFT_BUCKETS)
RESPONSE_TIME = Histogram(
    "gpuproxy_time_to_response_seconds",
    "Non-streaming requests: dispatch to the first byte of the upstream's response (the "
    "answer computed whole).", ["model", "endpoint"], buckets=DURATION_BUCKETS)
TOKENS = Counter(
    "gpuproxy_tokens", "Tokens reported by the upstream (usage or timings).",
    ["model", "kind"])
SWAPS = Counter(
    "gpuproxy_swaps", "Successful model loads by the scheduler (evict, start, healthy).",
    ["model"])
SWAP_DURATION = Histogram(
    "gpuproxy_swap_duration_seconds", "Duration of successful swaps: eviction, start and "
    "health check.", ["model"], buckets=SWAP_BUCKETS)
START_FAILURES = Counter(
    "gpuproxy_upstream_start_failures", "Upstream starts that failed or never became ready.",
    ["model"])
EXITS = Counter(
    "gpuproxy_upstream_exits", "Unexpected exits of a ready upstream (crashes).", ["model"])
RETRIES = Counter(
    "gpuproxy_upstream_retries", "Requests sent once more on a fresh connection because their "
    "reused one was closed before the upstream read them.", ["model"])

for _b in BANDS:
    QUEUE_WAIT.labels(_b)


# Each labelled series once looked up: `labels()` takes a lock and builds its key on every
# call, four to five times per request. No series here is ever removed.
_series: dict[tuple[Any, tuple[str, ...]], Any] = {}


def _labelled(metric: Any, *labels: str) -> Any:
    key = (metric, labels)
    series = _series.get(key)
    if series is None:
        series = _series[key] = metric.labels(*labels)
    return series


def observe_dispatch(band: str, queue_wait: float) -> None:
    _labelled(QUEUE_WAIT, band).observe(queue_wait)
    HISTORY.dispatch(band, queue_wait)


def observe_swap(model: str, seconds: float) -> None:
    SWAPS.labels(model).inc()
    SWAP_DURATION.labels(model).observe(seconds)
    HISTORY.swap()


def status_class(status: int) -> str:
    """`2xx`, `4xx`, `5xx`...: the label the error-rate alert divides by, bounded whatever a
    misbehaving upstream answers; `none` for a request that got no status (never 0xx)."""
    return f"{status // 100}xx" if 100 <= status <= 599 else "none"


def observe_request(row: Mapping[str, Any]) -> None:
    """One finished activity row (activity/record.py's `row()`)."""
    model = row["model"]
    endpoint = endpoint_of(row["path"])
    HISTORY.request(row)
    _labelled(REQUESTS, model, row["band"], endpoint, row["outcome"],
              status_class(row["status_code"])).inc()
    if row["duration_ms"] is not None:
        _labelled(REQUEST_DURATION, model, endpoint).observe(row["duration_ms"] / 1000)
    if row["ttft_ms"] is not None:
        _labelled(TTFT if row["stream"] else RESPONSE_TIME, model, endpoint).observe(
            row["ttft_ms"] / 1000)
    n = row["prompt_tokens"]
    if n:
        _labelled(TOKENS, model, "prompt").inc(n)
    n = row["completion_tokens"]
    if n:
        _labelled(TOKENS, model, "completion").inc(n)
    published.changed()  # the dashboard's Recent activity


def upstream_retried(model: str) -> None:
    RETRIES.labels(model).inc()


def model_state_changed(model: str, state: str) -> None:
    """A process changed state (processes.py's on_state hook). Two transitions are facts of
    their own: anything → failed is a failed start, and ready → stopped without passing
    through stopping is an exit nobody asked for (every requested stop goes through
    stopping)."""
    previous = published.set_model_state(model, state)
    if state == State.FAILED and previous != State.FAILED:
        START_FAILURES.labels(model).inc()
    elif state == State.STOPPED and previous == State.READY:
        EXITS.labels(model).inc()
    published.changed()


def models_configured(models: Iterable[str]) -> None:
    """The catalog changed: series exist for every configured model from the start (so a
    first increment is visible to `rate()`), and a removed model's state series go."""
    ids = tuple(sorted(models))
    for m in ids:
        SWAPS.labels(m)
        SWAP_DURATION.labels(m)
        START_FAILURES.labels(m)
        EXITS.labels(m)
        RETRIES.labels(m)
        for kind in ("prompt", "completion"):
            TOKENS.labels(m, kind)
    published.set_models(ids)


_registered = False


def register(registry: CollectorRegistry = REGISTRY) -> None:
    """Add the snapshot-reading collectors to the registry `/metrics` renders (once)."""
    global _registered
    if not _registered:
        # `*_created` timestamps double the series count and no dashboard here reads them.
        disable_created_metrics()
        registry.register(SchedulerCollector())
        registry.register(ActivityCollector())
        registry.register(BuildInfoCollector())
        registry.register(_PerfCollector())
        _registered = True
