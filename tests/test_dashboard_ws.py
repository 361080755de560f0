"""`/ws/dashboard` in-process through the real ASGI application: who may connect, what the
state says, the cancel button, and the throttle. The upstream is a real fake-server process,
the database real PostgreSQL; the browser tests (tests/test_browser.py) drive the page."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest
from asgiref.sync import sync_to_async
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client

from gpuproxy.asgi import application
from gpuproxy.shell import runtime
from tests.conftest import FAKE, free_port
from tests.helpers import chat_communicator, runtime_on

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


def documented_max_rate() -> int:
    """The rate README.md and docs/dashboard.md promise: the bound the throttle test holds
    the code to, so raising the code's rate without the docs fails."""
    said = {name: re.findall(r"at most (\d+) (?:updates|times) a second",
                             " ".join((ROOT / name).read_text().split()))
            for name in ("README.md", "docs/dashboard.md")}
    assert all(len(found) == 1 for found in said.values()), said
    rates = {int(found[0]) for found in said.values()}
    assert len(rates) == 1, f"the docs promise different rates: {said}"
    return rates.pop()


@pytest.fixture
async def rt():
    start = free_port()
    r = await runtime_on(f"""
startPort: {start}
healthCheckTimeout: 15
models:
  alpha:
    cmd: {FAKE}
""")
    r.port = start  # the upstream's port, for its gates
    yield r
    await runtime.shutdown()


def _session_cookie(staff: bool) -> bytes:
    user = User.objects.create_user("u-staff" if staff else "u-plain", password="pw",
                                    is_staff=staff)
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def socket(staff: bool | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if staff is not None:
        headers.append((b"cookie", await sync_to_async(_session_cookie)(staff)))
    return WebsocketCommunicator(application, "/ws/dashboard", headers=headers)


async def next_state(ws: WebsocketCommunicator, within: float = 10) -> dict:
    async with asyncio.timeout(within):
        while True:
            m = await ws.receive_json_from(within)
            if m["type"] == "state":
                return m["state"]


async def state_where(ws: WebsocketCommunicator, predicate, within: float = 20) -> dict:
    async with asyncio.timeout(within):
        while True:
            s = await next_state(ws, within)
            if predicate(s):
                return s


def chat_request(gate: str) -> ApplicationCommunicator:
    return chat_communicator([(b"x-fake-gate", gate.encode())], client="10.1.2.3")


@pytest.mark.parametrize("staff", [None, False])
async def test_only_staff_may_connect(rt, staff):
    ws = await socket(staff)
    connected, code = await ws.connect()
    assert not connected and code == 4403


async def test_a_foreign_origin_is_refused(rt):
    cookie = await sync_to_async(_session_cookie)(True)
    ws = WebsocketCommunicator(application, "/ws/dashboard", headers=[
        (b"origin", b"http://evil.example"), (b"host", b"localhost"), (b"cookie", cookie)])
    connected, _ = await ws.connect()
    assert not connected


async def test_state_in_flight_and_the_cancel_button(rt):
    ws = await socket(True)
    connected, _ = await ws.connect()
    assert connected
    first = await next_state(ws)
    assert [m["id"] for m in first["models"]] == ["alpha"]
    assert first["models"][0]["state"] == "stopped"
    assert [b["band"] for b in first["bands"]] == ["interactive", "normal", "batch"]
    assert first["scheduler"]["kind"] == "serial"

    http = chat_request("held")
    await http.send_input({"type": "http.request", "more_body": False, "body": json.dumps(
        {"model": "alpha", "max_tokens": 1, "messages": []}).encode()})
    s = await state_where(ws, lambda s: s["in_flight"])
    (entry,) = s["in_flight"]
    assert (entry["model"], entry["client"], entry["band"]) == ("alpha", "10.1.2.3", "normal")
    assert s["models"][0]["state"] == "ready" and s["models"][0]["in_flight"] == 1

    await ws.send_json_to({"action": "cancel", "request_id": entry["id"]})
    answer = await http.receive_output(10)
    assert answer["status"] == 503
    body = await http.receive_output(10)
    assert json.loads(body["body"])["error"]["code"] == "cancelled_by_admin"
    s = await state_where(ws, lambda s: not s["in_flight"] and s["recent"])
    assert s["recent"][0]["outcome"] == "cancelled_by_admin"
    assert s["models"][0]["in_flight"] == 0
    # the upstream was told: its held request went away
    r = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{rt.port}/slots")
    assert not any(slot["is_processing"] for slot in r.json())
    await ws.disconnect()


async def test_load_action_and_its_result(rt):
    ws = await socket(True)
    await ws.connect()
    await next_state(ws)
    await ws.send_json_to({"action": "load", "model": "alpha"})
    async with asyncio.timeout(30):
        while (m := await ws.receive_json_from(30))["type"] != "result":
            pass
    assert m == {"type": "result", "action": "load", "target": "alpha", "ok": True,
                 "message": "alpha is ready"}
    await ws.send_json_to({"action": "unload", "model": "nope"})
    async with asyncio.timeout(10):
        while (m := await ws.receive_json_from(10))["type"] != "result":
            pass
    assert m["ok"] is False and m["message"] == "no such model"
    await ws.disconnect()


async def test_a_burst_of_events_is_throttled(rt):
    """Thousands of scheduler events, kept coming for the whole second measured: at most the
    documented rate of states a second reach the page (plus the one in progress), not one
    per event. (One burst at the start would be over before a faster throttle sent more.)"""
    rate = documented_max_rate()
    ws = await socket(True)
    await ws.connect()
    await next_state(ws)

    async def burst() -> None:
        while True:
            for _ in range(20):
                rt.run_loop.restart(())  # an event that changes nothing but is published
            await asyncio.sleep(0.01)  # the pace events are made at, not a wait for state

    started = time.monotonic()
    events = asyncio.create_task(burst())
    states = 0
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                while True:
                    if (await ws.receive_json_from(5))["type"] == "state":
                        states += 1
    finally:
        events.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await events
    elapsed = time.monotonic() - started
    assert 1 <= states <= 1 + math.ceil(elapsed * rate)
    await ws.disconnect()


# ---- the profile switch ----------------------------------------------------------------------

@pytest.fixture
async def rt_profiles():
    r = await runtime_on(f"""
startPort: {free_port()}
models:
  small:
    cmd: {FAKE}
  big:
    cmd: {FAKE}
profiles:
  night:
    description: small models only
    pins:
      big: small
      img: ~
  day:
    pins:
      fast: big
""")
    r.start_watcher(every=3600)  # a save applies by its signal, not a poll
    yield r
    await runtime.shutdown()


async def next_result(ws: WebsocketCommunicator, within: float = 15) -> dict:
    async with asyncio.timeout(within):
        while (m := await ws.receive_json_from(within))["type"] != "result":
            pass
    return m


def active_profile_saved() -> str:
    from scheduling.models import ProxySettings

    return ProxySettings.load().active_profile


async def test_the_profile_action_switches_through_the_one_writer(rt_profiles):
    ws = await socket(True)
    await ws.connect()
    first = await next_state(ws)
    assert first["routing"]["profiles"] == ["day", "night"]
    assert first["routing"]["active_profile"] is None

    await ws.send_json_to({"action": "profile", "name": "night"})
    assert await next_result(ws) == {"type": "result", "action": "profile", "target": "night",
                                     "ok": True, "message": "profile night is active"}
    # answered once in force: the catalog this process routes by has it already
    assert rt_profiles.catalog.active_profile == "night"
    assert await sync_to_async(active_profile_saved)() == "night"
    s = await state_where(ws, lambda s: s["routing"]["active_profile"] is not None)
    assert s["routing"]["active_profile"] == {
        "name": "night", "defined": True, "description": "small models only",
        "pins": {"big": "small", "img": None}}

    # a name no profile has: refused, nothing written
    await ws.send_json_to({"action": "profile", "name": "nope"})
    m = await next_result(ws)
    assert (m["target"], m["ok"]) == ("nope", False)
    assert m["message"] == "no profile 'nope' (the admin's Profiles page lists them)"
    await ws.send_json_to({"action": "profile", "name": 7})
    m = await next_result(ws)
    assert (m["target"], m["ok"]) == (None, False)
    await ws.send_json_to({"action": "profile", "name": "night\x00"})
    assert (await next_result(ws))["ok"] is False
    assert await sync_to_async(active_profile_saved)() == "night"

    # null selects none
    await ws.send_json_to({"action": "profile", "name": None})
    assert await next_result(ws) == {"type": "result", "action": "profile", "target": None,
                                     "ok": True, "message": "no profile is active"}
    assert await sync_to_async(active_profile_saved)() == ""
    await state_where(ws, lambda s: s["routing"]["active_profile"] is None)
    await ws.disconnect()


async def test_a_switch_the_proxy_did_not_reload_says_it_is_saved(rt_profiles, monkeypatch):
    """A proxy that cannot reload must not claim the switch is in force."""
    from dashboard import consumer

    monkeypatch.setattr(consumer, "PROFILE_APPLY_WITHIN", 0.0)
    rt_profiles._watcher.cancel()  # nothing reloads now
    ws = await socket(True)
    await ws.connect()
    await next_state(ws)
    await ws.send_json_to({"action": "profile", "name": "day"})
    m = await next_result(ws)
    assert (m["target"], m["ok"]) == ("day", False)
    assert m["message"].startswith("saved, but the running proxy did not reload")
    assert m["message"].endswith("profile day is active at the next reload")
    assert await sync_to_async(active_profile_saved)() == "day"
    await ws.disconnect()


# ---- in flight: user agent and session id ----------------------------------------------------

def test_the_session_id_comes_from_llama_swaps_headers_in_order_and_bounded():
    from gpuproxy.observe.inflight import SESSION_ID_MAX, session_id

    assert session_id(()) == ""
    assert session_id(((b"x-litellm-session-id", b"lite"),)) == "lite"
    # X-Session-ID first, wherever it sits among the headers
    assert session_id(((b"x-litellm-session-id", b"lite"), (b"x-session-id", b"own"))) == "own"
    assert session_id(((b"x-session-id", b"  "), (b"x-litellm-session-id", b"lite"))) == "lite"
    assert SESSION_ID_MAX == 128
    assert session_id(((b"x-session-id", b"s" * 500),)) == "s" * 128


async def test_in_flight_shows_the_user_agent_and_session_id(rt):
    ws = await socket(True)
    await ws.connect()
    await next_state(ws)
    http = chat_communicator([(b"x-fake-gate", b"held"), (b"user-agent", b"curl/8.5.0"),
                              (b"x-session-id", b"<b>chat-42</b>")], client="10.1.2.3")
    await http.send_input({"type": "http.request", "more_body": False, "body": json.dumps(
        {"model": "alpha", "max_tokens": 1, "messages": []}).encode()})
    s = await state_where(ws, lambda s: s["in_flight"])
    (entry,) = s["in_flight"]
    assert (entry["user_agent"], entry["session_id"]) == ("curl/8.5.0", "<b>chat-42</b>")
    await ws.send_json_to({"action": "cancel", "request_id": entry["id"]})
    assert (await http.receive_output(10))["status"] == 503
    await state_where(ws, lambda s: not s["in_flight"])
    await ws.disconnect()
