"""What if (issue 22) against the real proxy: does a replay of the activity log match what
`gpuproxy serve` actually did, with real processes, real loads and real timing?

tests/test_whatif.py checks the replay on rows written by hand. Here the rows are the proxy's
own: three fake models that share one GPU (a swap group, one at a time, one request at a time),
a fixed load (`--load-seconds`) and a fixed service time (`--tps` with a fixed `max_tokens`),
and a planned trace of bursts fired through the front door at their planned instants. The
replay under today's settings must land within the stated tolerance of the recorded waits and
swaps; with swapAffinityBonus 0 the same traffic must swap more, since the bursts interleave
models at equal priority while the box is busy, which is what affinity saves.

The window holds the whole trace, and then starts 0.07 s into the second burst: the requests
received before it that still wait or run are replayed too (uncounted), since they hold the
box. Before the reader did that, such a cut replayed an idle box where the real one was busy:
4 of 41 waits came out 1.2-1.4 s short, and 24 loads were recorded against 23 replayed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import math
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from django.core.management import call_command

from activity import events, outcomes
from activity import whatif as window_reader
from activity.models import ModelEvent, RequestLog
from scheduling.catalog_db import build_catalog
from scheduling.whatif import TOLERANCE_S, TOLERANCE_SHARE, render, run, settings_of
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)

LOAD_S = 0.5  # the fake's own "Loading model" time, on top of its process start
TPS = 20
TOKENS = 6  # 6 tokens at 20/s: 0.3 s of service per request

# The share of requests whose replayed wait must fall within the tolerance of the recorded one
# (max(1 s, 10 %)): 0.9, the share at which `gpuproxy whatif` itself tells the operator to
# trust its figures. Measured on this trace in 6 runs (1 and 2 workers): 46 of 46, the median
# error 0.01-0.03 s, the p95 0.03-0.16 s, 25 swaps recorded and replayed, 42-46 with bonus 0.
# What is left is each load's own time against the median the replay charges; not 1.0, since
# a load on two busy cores can take twice its median, which shifts the waits behind it.
MIN_SHARE_WITHIN = 0.9
# Swaps: the replay's and the log's loads may differ by one where such a delay tipped a pick.
SWAP_SLACK = 1


def config(start: int) -> str:
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
      c:
        cmd: {cmd}
        parallel: 1
    groups:
      gpu:
        swap: true
        members: [a, b, c]
    """


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the trace starts
    model: str
    priority: int


BURSTS = 5
EVERY = 8.0  # s between bursts: a burst drains in about 5.2 s (see `trace`)
LONE = 6.5  # s after a burst: its lone request
FIRST_BURST = 2.0  # the first request's cold load and service are over by 1 s
LEAVER_AT = FIRST_BURST + EVERY + 0.15  # inside the second burst


def trace() -> list[Planned]:
    """Bursts that interleave the three models at priority 0 (what affinity reorders) with one
    interactive and one batch request, each followed by a lone request on an idle box.

    Each burst arrives within 0.14 s, before anything it queues behind can finish (a service
    is 0.3 s), and drains (8 services and up to 4 swaps of about 0.62 s: 5.2 s measured)
    before its lone request at +6.5 s, which ends (a swap and a service at most) before the
    next burst at +8 s. So every decision is taken with the whole burst queued, never on a
    request that arrives within milliseconds of a release. There the real proxy and the
    replay, whose swaps take the median load rather than each load's own time, may pick
    differently, and every request that waits behind a different pick diverges for as long
    as it waits: a busier trace of the same shape (bursts 5 s apart that never drain, batch
    requests waiting up to 21 s) replayed with only 73 % and 89 % of its waits within the
    tolerance in two runs, every miss downstream of one such near-tie.
    """
    out = [Planned(0.0, "a", 0)]
    burst = (("a", 0), ("b", 0), ("a", 0), ("c", 100), ("b", 0), ("a", 0), ("c", -100),
             ("b", 0))
    for k in range(BURSTS):
        t0 = FIRST_BURST + EVERY * k
        rotate = "abc"[k % 3:] + "abc"[:k % 3]  # each burst starts on another model
        names = {"a": rotate[0], "b": rotate[1], "c": rotate[2]}
        out += [Planned(round(t0 + 0.02 * i, 3), names[m], p) for i, (m, p) in enumerate(burst)]
        out.append(Planned(t0 + LONE, names["c"], 0))
    return out


async def fire(base: str, plan: list[Planned]) -> tuple[list[int], float]:
    """Each request at its planned instant after the first; their statuses, and how late the
    latest one left (the test's own lag, not the proxy's)."""
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=0)
    t0 = time.monotonic()
    late = 0.0
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=120,
                                 limits=limits) as client:

        async def one(p: Planned) -> int:
            nonlocal late
            await asyncio.sleep(max(0.0, t0 + p.at - time.monotonic()))
            late = max(late, time.monotonic() - (t0 + p.at))
            r = await client.post("/v1/chat/completions",
                                  headers={"X-LlamaSwap-Priority": str(p.priority)},
                                  json={"model": p.model, "max_tokens": TOKENS,
                                        "messages": [{"role": "user", "content": "x"}]})
            return r.status_code

        async def unknown() -> int:  # refused: never dispatched
            await asyncio.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
            r = await client.post("/v1/chat/completions", json={
                "model": "nope", "messages": [{"role": "user", "content": "x"}]})
            return r.status_code

        async def leaves() -> int:
            """A batch request behind a burst's interactive and normal ones (band isolation
            keeps it behind them), whose client gives up after 0.3 s: left before dispatch."""
            await asyncio.sleep(max(0.0, t0 + LEAVER_AT - time.monotonic()))
            try:
                await client.post("/v1/chat/completions", timeout=0.3,
                                  headers={"X-LlamaSwap-Priority": "-100"},
                                  json={"model": "a", "max_tokens": TOKENS,
                                        "messages": [{"role": "user", "content": "x"}]})
            except httpx.TimeoutException:
                return 0
            return -1

        statuses = await asyncio.gather(*(one(p) for p in plan), unknown(), leaves())
    return list(statuses), late


def misses(start: dt.datetime, end: dt.datetime) -> str:
    """Each request whose replayed wait missed the recorded one, for a failure's message:
    where the replay and the proxy parted, and from which request on."""
    config = build_catalog().scheduler_config()
    window = window_reader.read_window(start, end, config)
    done = run(window, config, settings_of(config))
    lines = ["", "misses (arrival, model, priority, recorded wait, replayed wait):"]
    for rec, job in zip(window.rows, done.jobs, strict=True):
        got = (job.granted or math.nan) - rec.arrival
        if not abs(got - rec.wait) <= max(TOLERANCE_S, TOLERANCE_SHARE * rec.wait):
            lines.append(f"  {rec.arrival:7.3f} {rec.model} {rec.priority:>4} "
                         f"{rec.wait:7.3f} {got:7.3f}")
    lines.append("replayed swaps: " + ", ".join(f"{t:.2f} {m}" for t, m, _ in done.swap_log))
    return "\n".join(lines)


def stop(proxy) -> None:
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0, proxy.output()


def test_the_replay_matches_what_the_real_proxy_did(serve):
    proxy = serve(config(free_port()))
    plan = trace()
    start = dt.datetime.now(dt.UTC)
    statuses, late = asyncio.run(fire(proxy.base, plan))
    end = dt.datetime.now(dt.UTC)
    assert statuses[:len(plan)] == [200] * len(plan), statuses
    assert statuses[len(plan):] == [404, 0], "the unknown model's 404, the leaver's timeout"
    assert late < 0.2, f"the test fired a request {late:.2f} s after its planned instant"

    until("every request's row is in the activity table",
          lambda: RequestLog.objects.filter(received_at__gte=start).count() == len(plan) + 2,
          within=30)
    stop(proxy)  # flushes the model events too; its own unloads come after `end`

    never_ran = RequestLog.objects.filter(received_at__gte=start, dispatched_at__isnull=True)
    assert sorted(never_ran.values_list("outcome", flat=True)) == [
        outcomes.CANCELLED_QUEUED, outcomes.UNKNOWN_MODEL]

    report = window_reader.report(start, end)
    print(render(report))
    f = report.fidelity
    assert report.window.left_out == {window_reader.NEVER_RAN: 2}
    assert len(report.window.rows) == len(plan)
    assert report.window.preload == ()
    loads = ModelEvent.objects.filter(at__gte=start, at__lt=end, kind=events.LOAD).count()
    assert f.recorded_swaps == loads
    assert f.n == len(plan)
    assert f.share_within >= MIN_SHARE_WITHIN, render(report) + misses(start, end)
    assert abs(f.replayed_swaps - loads) <= SWAP_SLACK, render(report) + misses(start, end)
    assert "the replay matches" in render(report)

    no_affinity = window_reader.report(start, end, swap_affinity_bonus=0)
    print(render(no_affinity))
    assert no_affinity.other.settings.swap_affinity_bonus == 0
    assert no_affinity.other.swaps > no_affinity.today.swaps, render(no_affinity)

    cut = start + dt.timedelta(seconds=FIRST_BURST + EVERY + 0.07)  # inside the 2nd burst
    late_start = window_reader.report(cut, end)
    print(render(late_start))
    g = late_start.fidelity
    assert 0 < sum(not r.reported for r in late_start.window.rows) < 8  # the burst's first
    assert g.share_within >= MIN_SHARE_WITHIN, render(late_start) + misses(cut, end)
    assert abs(g.replayed_swaps - (g.recorded_swaps or 0)) <= SWAP_SLACK, render(late_start)

    out = io.StringIO()
    call_command("whatif", "--from", start.isoformat(), "--to", end.isoformat(),
                 "--swap-affinity-bonus", "0", "--json", stdout=out)
    got = json.loads(out.getvalue())
    assert got["window"]["requests"] == len(plan)
    assert got["window"]["left_out"] == {window_reader.NEVER_RAN: 2}
    assert got["other"]["swaps"] == no_affinity.other.swaps
    assert got["fidelity"]["share_within"] == pytest.approx(f.share_within, abs=1e-3)

