"""Profiles (issue 19, item 4): `GET /api/profiles`, `PUT /api/profiles/active`, and the pins
applied to requests, switched at runtime.

The expected answers are llama-swap's (the real binary on the same profiles,
internal/server/apigroup.go `handleAPIProfiles`/`handleAPIActiveProfile`): the list's shape,
`{"active": name|null}`, 404 for an unknown profile, `null` or `""` for none, and its three
400s. The profiles are rows written here, as the import or the admin writes them.
"""

from __future__ import annotations

import httpx
import pytest
from django.test import AsyncClient

from activity.models import RequestLog
from gpuproxy.api import profiles as profiles_api
from gpuproxy.shell import runtime
from scheduling.catalog import Route
from scheduling.models import ApiKey, ProxySettings, hash_key
from scheduling.routing_models import Profile
from tests.conftest import FAKE, Proxy, free_port
from tests.helpers import until
from tests.test_llamaswap_api_live import Events

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_KEY = "sk-profiles-admin-7d1e"
USER_KEY = "sk-profiles-user-2b9c"

CODING_PINS = {"public": "variant", "disabled": None, "empty": "", "real": "other",
               "alias": "realias"}


def make_profiles() -> None:
    Profile.objects.create(name="coding", description="Coding profile", pins=CODING_PINS)
    Profile.objects.create(name="chat", pins={"public": "other"})


def make_keys() -> None:
    for name, key, admin in (("ops", ADMIN_KEY, True), ("app", USER_KEY, False)):
        ApiKey.objects.create(name=name, key_hash=hash_key(key), admin=admin)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------- in one process

@pytest.fixture
async def client():
    await runtime.run_db(make_profiles)
    (await runtime.get()).start_watcher(every=3600)  # saves apply by their signal, not a poll
    yield AsyncClient()
    await runtime.shutdown()


async def put(client: AsyncClient, body: str, key: str | None = None):
    return await client.put("/api/profiles/active", data=body, content_type="application/json",
                            headers=bearer(key) if key else {})


async def test_the_list_in_llamaswaps_shape(client):
    r = await client.get("/api/profiles")
    assert r.status_code == 200
    assert r.json() == {"active": None, "profiles": [
        {"id": "chat", "description": "", "pins": {"public": "other"}},
        {"id": "coding", "description": "Coding profile",
         "pins": {"alias": "realias", "disabled": "", "empty": "", "public": "variant",
                  "real": "other"}},
    ]}


async def test_switching_answers_the_active_profile_and_stores_it(client):
    r = await put(client, '{"name": "coding"}')
    assert (r.status_code, r.json()) == (200, {"active": "coding"})
    assert (await client.get("/api/profiles")).json()["active"] == "coding"
    settings = await runtime.run_db(ProxySettings.load)
    assert settings.active_profile == "coding"

    r = await put(client, '{"name": "missing"}')
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "not_found" and '"missing"' in error["message"]
    assert "GET /api/profiles" in error["message"]
    assert (await client.get("/api/profiles")).json()["active"] == "coding"  # unchanged

    for none in ('{"name": null}', '{"name": ""}'):
        await put(client, '{"name": "chat"}')
        r = await put(client, none)
        assert (r.status_code, r.json()) == (200, {"active": None}), none
        assert (await client.get("/api/profiles")).json()["active"] is None
        assert (await runtime.run_db(ProxySettings.load)).active_profile == ""


async def test_the_switch_is_in_force_when_it_answers(client):
    """The catalog requests are routed by shows the new profile as soon as the PUT has
    answered: the reload the save triggers runs on another task, so without the wait the
    answer came first."""
    rt = await runtime.port()
    assert rt.catalog.route("public").kind == "unknown"
    assert (await put(client, '{"name": "coding"}')).status_code == 200
    assert rt.catalog.active_profile == "coding"
    assert rt.catalog.route("public") == Route("unknown", "variant", "variant",
                                               pinned_by="coding")  # no model `variant` here
    assert (await put(client, '{"name": "chat"}')).status_code == 200
    assert rt.catalog.active_profile == "chat"
    assert rt.catalog.profiles["chat"].pins == {"public": "other"}


@pytest.mark.parametrize(("body", "message"), [
    ("", "invalid profile request"),
    ("{not json", "invalid profile request"),
    ("[]", "invalid profile request"),
    ('"coding"', "invalid profile request"),
    ("null", "profile name is required"),
    ("{}", "profile name is required"),
    ('{"profile": "coding"}', "profile name is required"),
    ('{"name": 5}', "profile name must be a string or null"),
    ('{"name": ["coding"]}', "profile name must be a string or null"),
])
async def test_a_bad_request_is_llamaswaps_400(client, body, message):
    r = await put(client, body)
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["message"].startswith(message) and error["code"] == "bad_request"
    assert '{"name": null}' in error["message"]  # says what to send instead


async def test_a_timed_out_reload_is_a_503_that_says_the_switch_is_saved(client, monkeypatch):
    """A proxy that cannot reload (its database thread failing) must not claim the switch is
    in force: the answer says it is saved and applies at the next reload."""
    monkeypatch.setattr(profiles_api, "APPLY_WITHIN", 0.0)
    rt = await runtime.get()
    rt._watcher.cancel()  # nothing reloads now
    r = await put(client, '{"name": "coding"}')
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "profile_not_applied" and "'coding'" in error["message"]
    assert (await runtime.run_db(ProxySettings.load)).active_profile == "coding"


async def test_a_name_with_a_control_character_is_no_profile_not_a_500(client):
    r = await put(client, '{"name": "cod\\u0000ing"}')
    assert r.status_code == 404, r.content
    assert r.json()["error"]["code"] == "not_found"


async def test_a_switch_overtaken_by_a_later_one_still_answers_at_once(client):
    """Two switches at once: the reload may land on the later one only. The earlier PUT is
    in force as soon as the catalog shows its settings version or a later one (it was
    applied, then replaced), not after a 10 s wait ending in a wrong 503."""
    rt = await runtime.get()
    rt._watcher.cancel()  # no reload between the two saves
    found, _, version = await runtime.run_db(lambda: ProxySettings.set_active_profile("coding"))
    assert found
    await runtime.run_db(lambda: ProxySettings.set_active_profile("chat"))
    await rt.reload()  # one reload, straight to the later switch
    assert rt.catalog.active_profile == "chat"
    assert await profiles_api._in_force("coding", version)


async def test_any_key_reads_only_admin_keys_switch(client):
    await runtime.run_db(make_keys)
    rt = await runtime.get()
    await rt.reload()  # the keys were written after the catalog was read
    assert (await client.get("/api/profiles")).status_code == 401
    assert (await client.get("/api/profiles", headers=bearer(USER_KEY))).status_code == 200
    assert (await put(client, '{"name": "coding"}')).status_code == 401
    r = await put(client, '{"name": "coding"}', USER_KEY)
    assert r.status_code == 403
    assert (await runtime.run_db(ProxySettings.load)).active_profile == ""
    r = await put(client, '{"name": "coding"}', ADMIN_KEY)
    assert (r.status_code, r.json()) == (200, {"active": "coding"})


async def test_other_methods_are_405(client):
    r = await client.post("/api/profiles")
    assert r.status_code == 405 and r.headers["Allow"] == "GET"
    r = await client.get("/api/profiles/active")
    assert r.status_code == 405 and r.headers["Allow"] == "PUT"


# ---------------------------------------------------------------------------- a real serve

def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      real:
        cmd: {FAKE}
        aliases: [realias]
        filters:
          setParamsByID:
            variant: {{temperature: 0.1}}
      other:
        cmd: {FAKE}
    groups:
      both:
        swap: false
        members: [real, other]
    """


def chat(proxy: Proxy, model: str) -> httpx.Response:
    """A chat on a connection of its own: with `--workers 2` each connection may land on
    either request process, and every one of them must route by the profile in force."""
    with httpx.Client(base_url=proxy.base, timeout=60, trust_env=False) as fresh:
        return fresh.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})


def served_by(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-fake-served-by"].split(":")[0]


@pytest.mark.postgres
def test_pins_route_requests_and_a_switch_applies_to_the_next_request(serve):
    proxy = serve(config(free_port()), extra_env={"GPUPROXY_RELOAD_SECONDS": "3600"})
    make_profiles()  # as the admin would
    events = Events(proxy.base)
    events.wait("the first profileChanged", "profileChanged", lambda d: d == {"active": None})

    r = proxy.http.put("/api/profiles/active", json={"name": "coding"})
    assert (r.status_code, r.json()) == (200, {"active": "coding"})
    events.wait("profileChanged after the switch", "profileChanged",
                lambda d: d == {"active": "coding"})
    events.close()
    assert proxy.http.get("/api/profiles").json()["active"] == "coding"
    for _ in range(4):  # on fresh connections, so both request processes of --workers 2
        assert served_by(chat(proxy, "public")) == "real"  # public → variant, real's
        assert served_by(chat(proxy, "real")) == "other"  # a local id pinned elsewhere
    assert served_by(chat(proxy, "realias")) == "real"  # an alias not pinned still works

    r = chat(proxy, "disabled")
    assert r.status_code == 404
    assert "'coding'" in r.json()["error"]["message"]  # the profile that disables it
    assert served_by(proxy.http.get("/upstream/public/v1/models")) == "real"  # pinned too
    r = proxy.http.get("/upstream/disabled/health")
    assert r.status_code == 404 and "'coding'" in r.json()["error"]["message"]
    row = until("the pinned request's activity row", lambda: RequestLog.objects.filter(
        model_requested="public").first())
    assert row.model == "real"

    r = proxy.http.put("/api/profiles/active", json={"name": "chat"})
    assert (r.status_code, r.json()) == (200, {"active": "chat"})
    for _ in range(4):
        assert served_by(chat(proxy, "public")) == "other"
        assert served_by(chat(proxy, "real")) == "real"  # no longer pinned

    r = proxy.http.put("/api/profiles/active", json={"name": None})
    assert (r.status_code, r.json()) == (200, {"active": None})
    for _ in range(4):
        r = chat(proxy, "public")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
