"""`GET /api/whatif` (issue 22, the settings page's what-if panel): who may ask, what it
refuses, the figures of a window worked out by hand, and that a repeated question is answered
from the cache instead of replayed again.

The window, by hand: A is loaded (its last event before the window is a ready); A (10 s)
arrives at 0, B (2 s) at 1, A (3 s) at 2, all priority 0 (band normal); B's load in the window
took 5 s. As the proxy served it under the defaults (serial, divisor 60, bonus 10): at 10 both
wait, A scores 10 + 8/60 against B's 9/60, so A runs 10-13, B's swap 13-18, B 18-20: waits 0,
17, 8, one swap, the last done at 20. With bonus 0, B (9/60 > 8/60) goes first: its swap
10-15, B 15-17, A's swap back 17-22, A 22-25: waits 0, 14, 20, two swaps, done at 25.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import AsyncClient

from activity import events
from activity import whatif as log_window
from activity.models import ModelEvent, RequestLog
from gpuproxy.api import whatif as whatif_api
from gpuproxy.shell import runtime
from scheduling.models import ApiKey, ModelDefinition, hash_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

URL = "/api/whatif"
ADMIN_KEY = "sk-whatif-admin-51c3"
USER_KEY = "sk-whatif-user-0e8a"
T0 = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=2)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def served(model: str, received: float, dispatched: float, finished: float) -> RequestLog:
    return RequestLog(request_id=uuid.uuid4(), received_at=at(received),
                      dispatched_at=at(dispatched), finished_at=at(finished), model=model,
                      model_requested=model, priority=0, band="normal", outcome="ok",
                      scheduler="serial", queue_wait_ms=(dispatched - received) * 1000)


BEFORE = T0 - dt.timedelta(hours=30)  # A's load: before any window asked for here


def seed_hand_window() -> None:
    for m in ("A", "B"):
        ModelDefinition.objects.create(model_id=m, cmd="x", proxy="http://127.0.0.1:1")
    RequestLog.objects.bulk_create([served("A", 0, 0, 10), served("B", 1, 18, 20),
                                    served("A", 2, 10, 13)])
    ModelEvent.objects.bulk_create([
        ModelEvent(model="A", kind=events.LOAD, reason=events.REQUEST, at=BEFORE),
        ModelEvent(model="A", kind=events.READY, reason=events.REQUEST,
                   at=BEFORE + dt.timedelta(seconds=5),
                   duration_ms=5000),
        ModelEvent(model="B", kind=events.LOAD, reason=events.REQUEST, at=at(13)),
        ModelEvent(model="B", kind=events.READY, reason=events.REQUEST, at=at(18),
                   duration_ms=5000),
    ])


def user(name: str, staff: bool = True, perm: str | None = None) -> User:
    u = User.objects.create_user(name, password="pw", is_staff=staff)
    if perm:
        u.user_permissions.add(Permission.objects.get(codename=perm))
    return u


@pytest.fixture
def people() -> dict[str, User]:
    return {"outsider": user("outsider", staff=False, perm="view_proxysettings"),
            "staff": user("staff"),
            "viewer": user("viewer", perm="view_proxysettings"),
            "editor": user("editor", perm="change_proxysettings")}


@pytest.fixture
async def client():
    """The session and user lookups leave a connection open on asgiref's thread: closed here
    so that the test database can be dropped."""
    whatif_api.forget()
    yield AsyncClient()
    whatif_api.forget()
    await runtime.shutdown()
    await sync_to_async(connections.close_all)()


async def as_user(u: User) -> AsyncClient:
    c = AsyncClient()
    await c.aforce_login(u)
    return c


async def test_only_staff_who_may_view_the_settings_may_ask(client, people):
    await runtime.run_db(seed_hand_window)
    r = await client.get(URL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "staff_required"
    r = await (await as_user(people["outsider"])).get(URL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "staff_required"
    r = await (await as_user(people["staff"])).get(URL)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "permission_required"
    assert "Can view proxy settings" in r.json()["error"]["message"]
    for who in ("viewer", "editor"):
        r = await (await as_user(people[who])).get(URL)
        assert r.status_code == 200, r.content
        assert r.json()["empty"] is False


async def test_an_admin_key_may_ask_and_another_key_may_not(client):
    def keys() -> None:
        seed_hand_window()
        ApiKey.objects.create(name="ops", key_hash=hash_key(ADMIN_KEY), admin=True)
        ApiKey.objects.create(name="app", key_hash=hash_key(USER_KEY), admin=False)

    await runtime.run_db(keys)
    r = await client.get(URL, headers={"Authorization": f"Bearer {USER_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = await client.get(URL, headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401
    r = await client.get(URL, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and r.json()["today"]["swaps"] == 1


async def test_the_hand_worked_window_today_and_with_bonus_0(client, people):
    await runtime.run_db(seed_hand_window)
    c = await as_user(people["viewer"])
    body = (await c.get(URL, {"swap_affinity_bonus": "0"})).json()
    today, other = body["today"], body["other"]
    assert today["settings"] == {"scheduler": "serial", "aging_divisor": 60.0,
                                 "swap_affinity_bonus": 10, "affinity_budget": ""}
    assert other["settings"]["swap_affinity_bonus"] == 0
    assert today["bands"]["normal"] == {"n": 3, "p50": 8.0, "p95": 17.0, "max": 17.0}
    assert other["bands"]["normal"] == {"n": 3, "p50": 14.0, "p95": 20.0, "max": 20.0}
    assert today["bands"]["all"] == today["bands"]["normal"]
    assert "interactive" not in today["bands"] and "batch" not in today["bands"]
    assert (today["swaps"], other["swaps"]) == (1, 2)
    # the makespan counts from the window's start, 24 h before the answer was computed
    offset = (T0 - (dt.datetime.fromisoformat(body["computed_at"])
                    - dt.timedelta(hours=24))).total_seconds()
    assert today["makespan"] == pytest.approx(offset + 20, abs=0.002)
    assert other["makespan"] == pytest.approx(offset + 25, abs=0.002)
    # today's replay is the log: every wait within tolerance, one swap each
    f = body["fidelity"]
    assert (f["n"], f["within"], f["share_within"]) == (3, 3, 1.0)
    assert (f["recorded_swaps"], f["replayed_swaps"]) == (1, 1)
    assert body["verdict"].startswith("the replay matches")
    assert body["window"]["preload"] == ["A"]
    assert body["window"]["load"] == {"A": 5.0, "B": 5.0}
    assert "before" in body["window"]["load_basis"]["A"]
    assert body["window_seconds"] == 86400


async def test_refused_values_are_400s_with_the_reason(client, people):
    await runtime.run_db(seed_hand_window)
    c = await as_user(people["viewer"])
    for query, words in (({"aging_divisor": "0"}, "agingDivisor ≤ 0"),
                         ({"aging_divisor": "-3"}, "agingDivisor ≤ 0"),
                         ({"aging_divisor": "soon"}, "agingDivisor is not a number"),
                         ({"aging_divisor": ""}, "agingDivisor is not a number"),
                         ({"swap_affinity_bonus": "-1"}, "bonus < 0"),
                         ({"swap_affinity_bonus": "2.5"}, "whole number"),
                         ({"swap_affinity_bonus": "inf"}, "swapAffinityBonus is not a number"),
                         ({"scheduler": "lifo"}, "use serial or fifo"),
                         ({"window": "yesterday"}, "give an age like 90m, 24h or 7d"),
                         ({"window": "30m"}, "1h to 7d"),
                         ({"window": "8d"}, "1h to 7d")):
        r = await c.get(URL, query)
        assert r.status_code == 400, query
        error = r.json()["error"]
        assert words in error["message"], (query, error)
        assert "refused on save" not in error["message"]
    # a bonus above 99 is not refused: it is replayed as 99, with a note saying so
    body = (await c.get(URL, {"swap_affinity_bonus": "150"})).json()
    assert body["other"]["settings"]["swap_affinity_bonus"] == 99
    assert "150 is above 99" in body["notes"][0]


async def test_a_window_with_nothing_to_replay_says_so(client, people):
    def never_ran() -> None:
        seed_hand_window()
        RequestLog.objects.update(received_at=at(-3 * 3600), dispatched_at=None)
        RequestLog.objects.filter(model="B").update(received_at=at(3600))

    await runtime.run_db(never_ran)
    c = await as_user(people["viewer"])
    r = await c.get(URL, {"window": "90m"})
    assert r.status_code == 200
    body = r.json()
    assert body["empty"] is True
    assert "no request to replay" in body["message"]
    assert "1 never dispatched" in body["message"]
    assert "today" not in body


async def test_the_same_question_within_the_cache_time_is_not_replayed_again(
        client, people, monkeypatch):
    await runtime.run_db(seed_hand_window)
    calls: list[dict] = []
    real = log_window.prepare

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(log_window, "prepare", spy)
    c = await as_user(people["viewer"])
    first = (await c.get(URL, {"swap_affinity_bonus": "0"})).json()
    again = (await c.get(URL, {"swap_affinity_bonus": "0.0"})).json()  # the same value
    assert len(calls) == 1 and again == first
    other = (await c.get(URL, {"swap_affinity_bonus": "5"})).json()
    assert len(calls) == 2 and other["other"]["settings"]["swap_affinity_bonus"] == 5
    await c.get(URL, {"swap_affinity_bonus": "0", "window": "2h"})  # another window
    assert len(calls) == 3
    # once its time is up, the question is replayed again
    monkeypatch.setattr(whatif_api, "CACHE_SECONDS", 0.0)
    whatif_api.forget()
    await c.get(URL, {"swap_affinity_bonus": "0"})
    await c.get(URL, {"swap_affinity_bonus": "0"})
    assert len(calls) == 5


async def test_other_methods_are_405(client, people):
    c = await as_user(people["viewer"])
    r = await c.post(URL)
    assert r.status_code == 405 and r.headers["Allow"] == "GET"


async def eventually(what: str, predicate, within: float = 20.0) -> None:
    """tests/helpers.py `until`, without blocking the event loop the views run on."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened within {within} s: {what}")
        await asyncio.sleep(0.02)


async def test_one_replay_per_question_in_flight_and_none_for_a_question_given_up(
        client, people, monkeypatch):
    """The panel aborts a stale question: if its replay has not started, it never does. The
    same question asked twice while it replays is replayed once."""
    await runtime.run_db(seed_hand_window)
    real = log_window.prepare
    ran: list[float] = []
    started, gate = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        ran.append(kwargs["swap_affinity_bonus"])
        if kwargs["swap_affinity_bonus"] == 1:
            started.set()
            gate.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(log_window, "prepare", held)
    c = await as_user(people["viewer"])
    first = asyncio.create_task(c.get(URL, {"swap_affinity_bonus": "1"}))
    twin = asyncio.create_task(c.get(URL, {"swap_affinity_bonus": "1"}))
    assert await asyncio.to_thread(started.wait, 20)
    stale = asyncio.create_task(c.get(URL, {"swap_affinity_bonus": "2"}))
    await eventually("the stale question waits for the replay thread",
                     lambda: len(whatif_api._running) == 2)
    stale.cancel()
    await eventually("the stale question is dropped", lambda: len(whatif_api._running) == 1)
    gate.set()
    a, b = await first, await twin
    assert a.status_code == b.status_code == 200 and a.json() == b.json()
    # the thread runs in order: had the stale replay not been dropped, it would run first
    assert (await c.get(URL, {"swap_affinity_bonus": "3"})).status_code == 200
    assert ran == [1, 3]


async def test_staff_without_the_permission_may_still_ask_with_an_admin_key(client, people):
    def keys() -> None:
        seed_hand_window()
        ApiKey.objects.create(name="ops", key_hash=hash_key(ADMIN_KEY), admin=True)

    await runtime.run_db(keys)
    c = await as_user(people["staff"])
    r = await c.get(URL, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.content


async def test_without_keys_the_refusal_does_not_offer_one(client):
    await runtime.run_db(seed_hand_window)
    message = (await client.get(URL)).json()["error"]["message"]
    assert "API key" not in message and "log in as staff" in message


async def test_the_panel_replays_each_models_ttl_as_the_command_does(client, people):
    """A's ttl (60 s) unloaded it between its two requests 10 min apart: the panel's replay
    loads it twice, as the log and the command do (it once dropped the catalog's ttls)."""
    def seed() -> None:
        ModelDefinition.objects.create(model_id="A", cmd="x", proxy="http://127.0.0.1:1",
                                       ttl=60)
        RequestLog.objects.bulk_create([served("A", 100, 110, 115), served("A", 700, 710, 715)])
        ModelEvent.objects.bulk_create(
            ModelEvent(model="A", kind=kind, reason=events.REQUEST, at=at(t), duration_ms=d)
            for kind, t, d in ((events.LOAD, 100, None), (events.READY, 110, 10_000),
                               (events.LOAD, 700, None), (events.READY, 710, 10_000)))

    await runtime.run_db(seed)
    body = (await (await as_user(people["viewer"])).get(URL)).json()
    f = body["fidelity"]
    assert (f["n"], f["within"], f["recorded_swaps"], f["replayed_swaps"]) == (2, 2, 2, 2)
    assert body["today"]["idle_unloads"] == 2 and body["verdict_level"] == "matches"


def test_the_replay_runs_in_a_process_of_its_own_and_is_stopped_past_its_limit():
    """The panel's replay: the same figures as in-process, from another process; one past its
    limit is stopped (no child left behind) and said so."""
    import multiprocessing

    from scheduling.core.config import ModelConfig, SchedulerConfig
    from scheduling.core.swapper import GroupSwapper
    from scheduling.whatif import Recorded, Settings, Window, compare

    window = Window("by hand", (Recorded(0.0, "A", 0, 10.0, 0.0),
                                Recorded(1.0, "B", 0, 2.0, 17.0),
                                Recorded(2.0, "A", 0, 3.0, 8.0)), swap_cost=5.0, preload=("A",))
    config = SchedulerConfig(models={m: ModelConfig() for m in "AB"},
                             swapper=GroupSwapper([], ["A", "B"]), scheduler="serial")
    args = (window, config, Settings("serial", 60.0, 0), (), None)
    assert whatif_api.replay_elsewhere(args) == compare(*args).as_dict()
    with pytest.raises(whatif_api.ReplayTooLong, match="took longer than 0 s"):
        whatif_api.replay_elsewhere(args, limit=0.0)
    assert multiprocessing.active_children() == []
    with pytest.raises(log_window.WhatIfError, match="no request to replay"):
        whatif_api.replay_elsewhere((Window("empty", ()), config, Settings(), (), None))


async def test_a_replay_past_its_limit_is_a_503_that_says_what_to_do(client, people,
                                                                      monkeypatch):
    await runtime.run_db(seed_hand_window)
    monkeypatch.setattr(whatif_api, "REPLAY_SECONDS", 0.0)
    r = await (await as_user(people["viewer"])).get(URL)
    assert r.status_code == 503 and r.json()["error"]["code"] == "replay_too_long"
    assert "gpuproxy whatif" in r.json()["error"]["message"]
