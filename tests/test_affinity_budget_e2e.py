"""The affinity budget (issue 23) against the real proxy: the starvation trap, through
`gpuproxy serve`, the fake upstream and the front door.

Two fake models share one GPU (a swap group, one at a time, one request at a time). A steady
stream to A arrives faster than A serves it, and one request for B arrives early in it. With
swapAffinityBonus 10 and agingDivisor 60, affinity may hold B back up to 600 s, so without a
budget B waits until A's queue is empty, i.e. until the stream is over. With
`affinityBudget: 2` docs/scheduling.md promises that "no request is kept back by affinity
longer than the budget plus the service running when the budget runs out"; then B's swap.

Kept back by affinity, read from the rows: B is the oldest waiting request (the winner
without affinity) from the moment the last A that arrived before it finishes; every pick
from then on that goes to an A is one B lost only because of affinity. So B's dispatch (its
grant, after its swap) comes at least the budget after that moment, and at most the budget
plus the longest A service plus B's own swap plus `SLACK`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)

LOAD_S = 0.3  # the fake's own "Loading model" time, on top of its process start
TPS = 20
TOKENS = 5  # 5 tokens at 20/s: 0.25 s of service per request
BUDGET_S = 2.0
EVERY = 0.2  # s between A's requests: faster than the 0.25 s (and more) A takes to serve one
STREAM_S = 10.0  # A's stream lasts this long: 50 requests, about 14 s of service
B_AT = 2.0  # s into the stream: A's cold load (process start + LOAD_S) is over by then
# The test's own allowance on top of the documented bound: the gaps between one service's end
# and the next pick, and the rows' timestamps (taken in the request processes, not where the
# scheduler decides). Measured on a 2-core box in 6 runs (1 and 2 workers): B held back
# 2.44-2.47 s against a documented bound (budget + service + swap) of 2.68-2.71 s; B's wait
# 3.55-3.61 s. With the budget off: held back 10.29-10.35 s (waiting 11.40-11.49 s), served
# after every A, and the same run's bound was 3.18-3.20 s.
SLACK = 0.5
METRIC = "gpuproxy_affinity_budget_overrides_total"


def config(start: int, budget: str) -> str:
    cmd = f"{FAKE} --tps {TPS} --load-seconds {LOAD_S}"
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      a:
        cmd: {cmd}
        parallel: 1
      b:
        cmd: {cmd}
        parallel: 1
    groups:
      gpu:
        swap: true
        members: [a, b]
    routing:
      scheduler:
        use: serial
        settings:
          serial:
            agingDivisor: 60
            swapAffinityBonus: 10
            affinityBudget: {budget}
    """


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the trace starts
    model: str


def trace() -> list[Planned]:
    stream = [Planned(round(EVERY * i, 3), "a") for i in range(round(STREAM_S / EVERY))]
    return [*stream, Planned(B_AT + EVERY / 2, "b")]  # between two A's, not tied with one


async def fire(base: str, plan: list[Planned]) -> tuple[list[int], float]:
    """Each request at its planned instant; their statuses, and how late the latest one left
    (the test's own lag, not the proxy's)."""
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=0)
    t0 = time.monotonic()
    late = 0.0
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=120,
                                 limits=limits) as client:

        async def one(p: Planned) -> int:
            nonlocal late
            await asyncio.sleep(max(0.0, t0 + p.at - time.monotonic()))
            late = max(late, time.monotonic() - (t0 + p.at))
            r = await client.post("/v1/chat/completions", json={
                "model": p.model, "max_tokens": TOKENS,
                "messages": [{"role": "user", "content": "x"}]})
            return r.status_code

        statuses = await asyncio.gather(*(one(p) for p in plan))
    return list(statuses), late


def overrides(proxy) -> float:
    r = proxy.http.get("/metrics")
    assert r.status_code == 200, r.text
    return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if s.name == METRIC)


def seconds(a: dt.datetime, b: dt.datetime) -> float:
    return (b - a).total_seconds()


@pytest.mark.parametrize("budget", ["2", "off"], ids=["budget2s", "budget_off"])
def test_the_budget_frees_the_request_trapped_behind_a_stream(serve, budget):
    proxy = serve(config(free_port(), budget))
    plan = trace()
    start = dt.datetime.now(dt.UTC)
    statuses, late = asyncio.run(fire(proxy.base, plan))
    assert statuses == [200] * len(plan), statuses
    assert late < 0.2, f"the test fired a request {late:.2f} s after its planned instant"
    rows = until("every request's row is in the activity table", lambda: (
        r if len(r := list(RequestLog.objects.filter(received_at__gte=start))) == len(plan)
        else None), within=30)
    counted = overrides(proxy)
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()

    (b,) = [r for r in rows if r.model == "b"]
    a_rows = sorted((r for r in rows if r.model == "a"), key=lambda r: r.dispatched_at)
    ahead = [r for r in a_rows if r.received_at < b.received_at]
    assert a_rows[0].dispatched_at < b.received_at, "A was not loaded when B arrived"
    oldest_from = ahead[-1].finished_at  # the first pick B would win without affinity
    held = seconds(oldest_from, b.dispatched_at)
    service = max(seconds(r.dispatched_at, r.finished_at) for r in a_rows)
    swap = (b.swap_ms or 0) / 1000
    bound = BUDGET_S + service + swap + SLACK
    overtaken = [r for r in a_rows if r.received_at < b.dispatched_at < r.dispatched_at]
    figures = (f"B held back {held:.2f} s by affinity (waited {b.queue_wait_ms / 1000:.2f} s),"
               f" bound {bound:.2f} s = budget {BUDGET_S} + longest A service {service:.2f}"
               f" + B's swap {swap:.2f} + slack {SLACK}; {len(overtaken)} A's that arrived"
               f" before B's dispatch went after it; {METRIC} {counted}; A first served"
               f" {seconds(start, a_rows[0].dispatched_at):.2f} s in")
    print(figures)

    if budget == "off":
        # Affinity (bonus 10 x divisor 60 s) outweighs B's age for 600 s: B goes last.
        assert a_rows[-1].dispatched_at < b.dispatched_at, figures
        assert held > 2 * bound, figures
        assert "budget_override" not in b.score_parts, b.score_parts
        assert counted == 0, figures
        return
    assert BUDGET_S <= held <= bound, figures
    # Not aging: B went ahead of a queue of A's that were still arriving.
    assert b.dispatched_at < max(r.received_at for r in a_rows), figures
    assert len(overtaken) >= 5, figures
    assert b.score_parts.get("budget_override") is True, b.score_parts
    assert all("budget_override" not in r.score_parts for r in a_rows), "only B was lifted"
    assert counted >= 1, figures
