"""The dashboard's routing panel: the router in force and the matrix's sets, the peers (never
their API key, nor a password in their URL), the selectors with the target the scheduler would
pick now, and the active profile with its pins; a saved change shows up in the next state.

First the pure view of a hand-built Catalog, then `/ws/dashboard` in-process through the real
ASGI application on a config imported into the test database, with real fake-server upstreams.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client

from dashboard.consumer import routing
from gpuproxy.asgi import application
from gpuproxy.shell import runtime
from scheduling.catalog import Catalog, CatalogPeer, CatalogProfile, CatalogSelector, url_host
from scheduling.models import ProxySettings
from tests.conftest import FAKE, free_port
from tests.helpers import runtime_on

PEER_KEY = "sk-peer-Hq4nT8wZ2cV6"
URL_PASSWORD = "hunter2-pw"


def test_the_view_of_a_catalog_says_what_routes_and_keeps_the_secrets():
    catalog = Catalog(
        models={}, aliases={}, router="matrix",
        matrix_sets=(("chat", "(a | b) & e"), ("big", "c")),
        peers={"cloud": CatalogPeer("cloud", f"https://me:{URL_PASSWORD}@api.example.com/v1",
                                    api_key=PEER_KEY, models=("m1", "m2"),
                                    priority_forward="service_tier"),
               "box": CatalogPeer("box", "http://10.0.0.7:8080", models=("m3",))},
        selectors={"coder": CatalogSelector("coder", "spillover", ("a", "cloud/m1"),
                                            ("a", "cloud/m1"), spillover=3, unlisted=True)},
        profiles={"night": CatalogProfile("night", "small models", {"big": "a", "img": None})},
        active_profile="night")
    view = routing(catalog, {"coder": "cloud/m1"})
    assert view == {
        "router": "matrix",
        "matrix_sets": [{"name": "chat", "dsl": "(a | b) & e"}, {"name": "big", "dsl": "c"}],
        "peers": [{"id": "box", "host": "10.0.0.7:8080", "models": ["m3"],
                   "priority_forward": "header"},
                  {"id": "cloud", "host": "api.example.com", "models": ["m1", "m2"],
                   "priority_forward": "service_tier"}],
        "selectors": [{"id": "coder", "strategy": "spillover", "targets": ["a", "cloud/m1"],
                       "spillover": 3, "name": "", "unlisted": True, "pick": "cloud/m1"}],
        "active_profile": {"name": "night", "defined": True, "description": "small models",
                           "pins": {"big": "a", "img": None}},
        "profiles": ["night"],
    }
    dumped = json.dumps(view)
    assert PEER_KEY not in dumped and URL_PASSWORD not in dumped


def test_an_active_profile_that_is_not_defined_says_so_and_none_is_null():
    catalog = Catalog(models={}, aliases={}, active_profile="gone")
    assert routing(catalog, {})["active_profile"] == {
        "name": "gone", "defined": False, "description": "", "pins": {}}
    assert routing(Catalog(models={}, aliases={}), {})["active_profile"] is None


@pytest.mark.parametrize(("url", "host"), [
    ("http://127.0.0.1:9000", "127.0.0.1:9000"),
    ("https://u:p@h.example.com/api", "h.example.com"),
    ("http://[::1]:80/", "::1:80"),
    ("http://h:notaport/", "(not a URL)"),
])
def test_a_peers_host(url, host):
    assert url_host(url) == host


# ---- over the WebSocket ----------------------------------------------------------------------

def _staff_cookie() -> bytes:
    client = Client()
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True))
    return f"sessionid={client.cookies['sessionid'].value}".encode()


async def next_state(ws: WebsocketCommunicator, until=lambda s: True, within: float = 15):
    async with asyncio.timeout(within):
        while True:
            m = await ws.receive_json_from(within)
            if m["type"] == "state" and until(m["state"]):
                return m["state"]


@pytest.fixture
async def rt():
    start = free_port()
    r = await runtime_on(f"""
startPort: {start}
healthCheckTimeout: 15
models:
  alpha:
    cmd: {FAKE}
  beta:
    cmd: {FAKE}
peers:
  cloud:
    proxy: https://api.example.com
    apiKey: {PEER_KEY}
    models: [m1]
selectors:
  coder:
    strategy: warm
    targets: [alpha, beta]
profiles:
  night:
    description: small models
    pins:
      big: beta
      img: ~
""")
    r.start_watcher(every=3600)  # a save applies by its signal, as under serve, not a poll
    yield r
    await runtime.shutdown()


@pytest.mark.django_db(transaction=True)
async def test_the_state_shows_the_routing_and_follows_a_load_and_a_profile_switch(rt):
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost"),
               (b"cookie", await sync_to_async(_staff_cookie)())]
    ws = WebsocketCommunicator(application, "/ws/dashboard", headers=headers)
    connected, _ = await ws.connect()
    assert connected
    try:
        first = await next_state(ws)
        r = first["routing"]
        assert r["router"] == "group" and r["active_profile"] is None
        assert r["profiles"] == ["night"]
        assert r["peers"] == [{"id": "cloud", "host": "api.example.com", "models": ["m1"],
                               "priority_forward": "header"}]
        # warm, nothing loaded: the first target would cold-start
        assert [(s["id"], s["strategy"], s["targets"], s["pick"]) for s in r["selectors"]] == [
            ("coder", "warm", ["alpha", "beta"], "alpha")]
        assert PEER_KEY not in json.dumps(first) and URL_PASSWORD not in json.dumps(first)

        await rt.load("beta")  # now the first READY target
        state = await next_state(ws, lambda s: s["routing"]["selectors"][0]["pick"] == "beta")
        assert state["routing"]["selectors"][0]["targets"] == ["alpha", "beta"]

        def activate() -> None:
            settings = ProxySettings.load()
            settings.active_profile = "night"
            settings.save()

        await sync_to_async(activate)()
        state = await next_state(ws, lambda s: s["routing"]["active_profile"] is not None)
        assert state["routing"]["active_profile"] == {
            "name": "night", "defined": True, "description": "small models",
            "pins": {"big": "beta", "img": None}}
    finally:
        await ws.disconnect()
