"""Model events (`activity_modelevent`, issue 20 item 3): every kind is reported by real
processes (the fake server, `badprocess`) through the run loop with the reason the shell
knows, and the events writer puts them in PostgreSQL, an outage losing none and blocking
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from activity import events
from gpuproxy.shell.run_loop import RunLoop
from gpuproxy.upstream.states import State
from scheduling.catalog import Catalog, CatalogModel
from scheduling.core.errors import SwapFailed
from scheduling.core.swapper import Group
from scheduling.spec import UpstreamSpec
from tests.conftest import free_port
from tests.test_processes import DEADLINE, fake_spec, wait_for_state
from tests.test_run_loop_exits import running

SECRET = "hunter2-model-events"


class Sink:
    """The rows the upstreams report, awaited as they come (no sleeps)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

    def __call__(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._changed.set()

    async def wait(self, model: str, kind: str, n: int = 1) -> dict[str, Any]:
        """The `n`th row of this model and kind, once it has come."""
        async with asyncio.timeout(DEADLINE):
            while True:
                found = [r for r in self.rows if (r["model"], r["kind"]) == (model, kind)]
                if len(found) >= n:
                    return found[n - 1]
                self._changed.clear()
                await self._changed.wait()

    def kinds(self, model: str) -> list[tuple[str, str]]:
        return [(r["kind"], r["reason"]) for r in self.rows if r["model"] == model]


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
async def one(port: int, sink: Sink) -> AsyncIterator[RunLoop]:
    async with running(Catalog(models={"fake": CatalogModel("fake", fake_spec(port))})) as loop:
        loop.upstreams.on_event = sink
        yield loop


async def test_a_load_is_reported_with_its_pid_and_time_to_ready_then_an_admin_unload(
        one: RunLoop, sink: Sink) -> None:
    (await asyncio.wait_for(one.acquire("fake"), DEADLINE)).release()
    pid = one.upstreams.process("fake").pid
    await asyncio.wait_for(one.unload(["fake"]), DEADLINE)

    load, ready = await sink.wait("fake", events.LOAD), await sink.wait("fake", events.READY)
    unload = await sink.wait("fake", events.UNLOAD)
    assert sink.kinds("fake") == [("load", "request"), ("ready", "request"),
                                  ("unload", "admin")]
    assert load["pid"] == ready["pid"] == unload["pid"] == pid
    assert load["duration_ms"] is None
    assert ready["duration_ms"] > 0 and unload["duration_ms"] >= 0
    assert ready["at"] <= unload["at"]
    assert unload["detail"].startswith("code ") or unload["detail"].startswith("signal ")


async def test_a_swap_names_the_model_it_made_room_for(port: int, sink: Sink) -> None:
    a, b = fake_spec(port, model_id="a"), fake_spec(free_port(), model_id="b")
    catalog = Catalog(models={"a": CatalogModel("a", a), "b": CatalogModel("b", b)},
                      groups=(Group("g", frozenset({"a", "b"})),))
    async with running(catalog) as loop:
        loop.upstreams.on_event = sink
        (await asyncio.wait_for(loop.acquire("a"), DEADLINE)).release()
        rid = uuid.uuid4()
        (await asyncio.wait_for(loop.acquire("b", request_id=str(rid)), DEADLINE)).release()
        evicted = await sink.wait("a", events.UNLOAD)
        ready = await sink.wait("b", events.READY)
    assert (evicted["reason"], evicted["detail"].split("; ")[-1]) == ("swap", "for b")
    assert sink.kinds("b")[:2] == [("load", "request"), ("ready", "request")]
    # the load names the request it was for; a's first load was for a request without an id
    assert (await sink.wait("b", events.LOAD))["request_id"] == ready["request_id"] == rid
    assert (await sink.wait("a", events.LOAD))["request_id"] is None
    # the proxy's exit stops b: its unload says so
    assert (await sink.wait("b", events.UNLOAD))["reason"] == "shutdown"


async def test_a_ttl_unload_is_an_idle_unload(port: int, sink: Sink) -> None:
    spec = fake_spec(port, ttl=0.3)
    async with running(Catalog(models={"fake": CatalogModel("fake", spec)})) as loop:
        loop.upstreams.on_event = sink
        (await asyncio.wait_for(loop.acquire("fake"), DEADLINE)).release()
        idle = await sink.wait("fake", events.IDLE_UNLOAD)
    assert (idle["reason"], idle["pid"] is not None) == ("ttl", True)
    assert events.UNLOAD not in [k for k, _ in sink.kinds("fake")]


async def test_a_crash_is_reported_with_its_exit_and_uptime(one: RunLoop, sink: Sink) -> None:
    (await asyncio.wait_for(one.acquire("fake"), DEADLINE)).release()
    pid = one.upstreams.process("fake").pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    crash = await sink.wait("fake", events.CRASH)
    assert (crash["pid"], crash["reason"], crash["detail"]) == (pid, "crash", "signal SIGKILL")
    assert crash["duration_ms"] > 0
    assert events.UNLOAD not in [k for k, _ in sink.kinds("fake")]


async def test_a_start_failure_says_how_and_never_the_command_or_its_environment(
        port: int, sink: Sink) -> None:
    """`badprocess printenv --exit 3` prints its environment (a secret in it) and exits while
    starting: the event has the exit status, not the command line or the environment."""
    cmd = shlex.join([sys.executable, "-m", "gpuproxy.testing.badprocess", "printenv",
                      "--exit", "3", "--", f"--api-key={SECRET}"])
    spec = UpstreamSpec(model_id="bad", cmd=cmd, proxy=f"http://127.0.0.1:{port}",
                        env={"TOKEN": SECRET}, health_check_timeout=30)
    async with running(Catalog(models={"bad": CatalogModel("bad", spec)})) as loop:
        loop.upstreams.on_event = sink
        with pytest.raises(SwapFailed):
            await asyncio.wait_for(loop.acquire("bad"), DEADLINE)
        failed = await sink.wait("bad", events.START_FAILED)
    assert sink.kinds("bad") == [("load", "request"), ("start_failed", "request")]
    assert (failed["detail"], failed["pid"] is not None) == ("exited, code 3", True)
    assert failed["duration_ms"] > 0
    assert not any(SECRET in str(v) for r in sink.rows for v in r.values())


async def test_a_spawn_failure_is_a_start_failure_without_a_pid(port: int, sink: Sink) -> None:
    spec = UpstreamSpec(model_id="gone", cmd="/nonexistent/llama-server --port 1",
                        proxy=f"http://127.0.0.1:{port}")
    async with running(Catalog(models={"gone": CatalogModel("gone", spec)})) as loop:
        loop.upstreams.on_event = sink
        with pytest.raises(SwapFailed):
            await asyncio.wait_for(loop.acquire("gone"), DEADLINE)
        failed = await sink.wait("gone", events.START_FAILED)
    assert (failed["pid"], failed["detail"], failed["reason"]) == (None, "spawn", "request")


async def test_an_asked_restart_is_reported_then_its_unload_and_load(
        one: RunLoop, sink: Sink) -> None:
    (await asyncio.wait_for(one.acquire("fake"), DEADLINE)).release()
    first = one.upstreams.process("fake").pid
    one.restart(["fake"])
    second = await sink.wait("fake", events.READY, n=2)
    assert sink.kinds("fake") == [
        ("load", "request"), ("ready", "request"), ("restart", "admin"), ("unload", "admin"),
        ("load", "admin"), ("ready", "admin")]
    unload = await sink.wait("fake", events.UNLOAD)
    assert unload["pid"] == first and second["pid"] != first
    assert unload["detail"].endswith("; restart")


async def test_a_failing_sink_does_not_break_the_lifecycle(one: RunLoop) -> None:
    def broken(row: dict[str, Any]) -> None:
        raise RuntimeError("sink down")

    one.upstreams.on_event = broken
    (await asyncio.wait_for(one.acquire("fake"), DEADLINE)).release()
    await asyncio.wait_for(one.unload(["fake"]), DEADLINE)
    await wait_for_state(one.upstreams.process("fake"), State.STOPPED)


def test_row_refuses_a_kind_or_reason_not_in_the_set() -> None:
    with pytest.raises(ValueError, match="unknown model event kind 'exploded'"):
        events.row("m", "exploded")
    with pytest.raises(ValueError, match="unknown model event reason 'whim'"):
        events.row("m", events.UNLOAD, reason="whim")
    assert len(events.row("m", events.CRASH, detail="x" * 900)["detail"]) == events.DETAIL_MAX
    assert events.row("m", events.READY, seconds=1.5)["duration_ms"] == 1500.0


# ---- into PostgreSQL, through the events writer ----------------------------------------------


@pytest.fixture
def reconnect_after() -> Iterator[None]:
    """The outage terminated the test's own connection too: a fresh one for the teardown."""
    yield
    from tests.test_activity_outage import _replace_test_connections

    with contextlib.suppress(Exception):
        _replace_test_connections()


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgres
async def test_events_reach_the_table_and_an_outage_loses_none(
        port: int, sink: Sink, monkeypatch: pytest.MonkeyPatch, reconnect_after: None) -> None:
    """A real load and unload while PostgreSQL is gone: the lifecycle does not wait for the
    database (submit is O(1)), and once it is back every event is in the table, once."""
    from django.db import connections

    from activity.models import ModelEvent
    from activity.writer import ActivityWriter
    from tests.test_activity_writer import _outage_end, _outage_start, db, wait_for

    pool = await db(lambda: connections["default"].pool)
    monkeypatch.setattr(pool, "timeout", 2.0)
    w = ActivityWriter(model="ModelEvent", batch_size=50, interval=0.05, min_backoff=0.05,
                       max_backoff=0.5)
    w.start()
    try:
        async with running(Catalog(models={"fake": CatalogModel("fake",
                                                                fake_spec(port))})) as loop:
            def both(row: dict[str, Any]) -> None:
                sink(row)
                w.submit(row)

            loop.upstreams.on_event = both
            (await asyncio.wait_for(loop.acquire("fake"), DEADLINE)).release()
            await wait_for(lambda: w.written == 2)  # load, ready
            aloop = asyncio.get_running_loop()
            await aloop.run_in_executor(None, _outage_start)
            try:
                t = time.monotonic()
                await asyncio.wait_for(loop.unload(["fake"]), DEADLINE)
                (await asyncio.wait_for(loop.acquire("fake"), DEADLINE)).release()
                assert time.monotonic() - t < 10, "the lifecycle waited for the database"
                await wait_for(lambda: w.write_errors > 0, deadline=15)
                assert w.buffered == 3 and w.dropped == 0  # unload, load, ready
            finally:
                await aloop.run_in_executor(None, _outage_end)
            await wait_for(lambda: w.written == 5 and w.buffered == 0, deadline=20)
    finally:
        await w.close(timeout=15)
    rows = await db(lambda: list(ModelEvent.objects.order_by("id").values(
        "model", "kind", "reason", "pid", "duration_ms", "detail")))
    # the last, the proxy's exit stopping the model, came after the outage: written on close
    assert [(r["kind"], r["reason"]) for r in rows] == [
        ("load", "request"), ("ready", "request"), ("unload", "admin"), ("load", "request"),
        ("ready", "request"), ("unload", "shutdown")]
    assert [r["pid"] for r in rows] == [r["pid"] for r in sink.rows]


# ---- the admin list ---------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.postgres
def test_the_admin_lists_events_read_only_filtered_by_model_and_kind(admin_client) -> None:
    import datetime as dt

    from django.urls import reverse

    from activity.models import ModelEvent

    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    ModelEvent.objects.bulk_create(
        ModelEvent(model=m, kind=k, reason=events.REQUEST, at=t0 + dt.timedelta(seconds=i))
        for i, (m, k) in enumerate([("a", "load"), ("a", "ready"), ("b", "load"),
                                    ("b", "crash")]))
    url = reverse("admin:activity_modelevent_changelist")
    page = admin_client.get(url)
    assert page.status_code == 200
    filters = {spec.title: [c["display"] for c in spec.choices(page.context["cl"])]
               for spec in page.context["cl"].filter_specs}
    assert filters["model"] == ["All", "a", "b"]  # from the index, not a DISTINCT scan
    picked = admin_client.get(url, {"model": "b", "kind__exact": "load"}).context["cl"]
    assert [(e.model, e.kind) for e in picked.result_list] == [("b", "load")]
    newest = admin_client.get(url).context["cl"].result_list
    assert [e.kind for e in newest] == ["crash", "load", "ready", "load"]
    first = ModelEvent.objects.order_by("id").first()
    assert first is not None
    detail = admin_client.get(reverse("admin:activity_modelevent_change", args=[first.pk]))
    assert detail.status_code == 200 and b'name="_save"' not in detail.content
    assert admin_client.get(reverse("admin:activity_modelevent_add")).status_code == 403


# ---- under serve: written by the process that runs the upstreams ---------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgres
def test_serve_writes_the_events_of_a_load_an_api_unload_and_the_exit(serve) -> None:
    """With `--workers N` the request processes run no upstream: the scheduler process
    writes the events (and its exit writes the last ones)."""
    from activity.models import ModelEvent
    from tests.conftest import FAKE
    from tests.helpers import until

    proxy = serve(f"""
    startPort: {free_port()}
    models:
      solo:
        cmd: {FAKE}
    """)
    body = {"model": "solo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    assert proxy.http.post("/v1/chat/completions", json=body).status_code == 200
    assert proxy.http.post("/api/models/unload/solo").status_code == 200
    assert proxy.http.post("/v1/chat/completions", json=body).status_code == 200
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0

    def seen() -> list[tuple[str, str]]:
        return [(e.kind, e.reason) for e in ModelEvent.objects.filter(model="solo")
                .order_by("id")]

    until("the events are written", lambda: len(seen()) == 6, within=10)
    assert seen() == [("load", "request"), ("ready", "request"), ("unload", "admin"),
                      ("load", "request"), ("ready", "request"), ("unload", "shutdown")]
    pids = list(ModelEvent.objects.filter(model="solo").order_by("id")
                .values_list("pid", flat=True))
    assert pids[0] == pids[1] == pids[2] != pids[3] == pids[4] == pids[5]
    # each load names the request that caused it: its activity row's id (across processes)
    from activity.models import RequestLog

    asked = until("the request rows", lambda: list(
        RequestLog.objects.filter(model="solo").order_by("received_at")
        .values_list("request_id", flat=True)) or None, within=10)
    loads = list(ModelEvent.objects.filter(model="solo", kind="load").order_by("id")
                 .values_list("request_id", flat=True))
    assert loads == asked and len(loads) == 2
