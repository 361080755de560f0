"""The admin that drives the proxy: the settings page and its guarantees panel, model
definitions (validation, live state, load/unload/restart actions), API keys shown once.

The first part runs the admin in this process with Django's test client (no proxy runs here, so
the live state is "—" and actions say why they cannot act). The second part logs in over HTTP
to a real `gpuproxy serve` on the test database and drives its upstreams from the admin.
"""

# ruff: noqa: RUF001  (the pages write the multiplication sign, as docs/scheduling.md does)
from __future__ import annotations

import hashlib
import html
import re
import time

import httpx
import pytest
from django import forms
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from gpuproxy.proxy import auth
from scheduling import live as control
from scheduling.catalog_db import build_catalog
from scheduling.models import ApiKey, ModelDefinition, ProxySettings
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, one_model, open_gate, process_gone, running, until

SETTINGS_CHANGE = "admin:scheduling_proxysettings_change"
MODEL_ADD = "admin:scheduling_modeldefinition_add"
MODEL_LIST = "admin:scheduling_modeldefinition_changelist"
KEY_ADD = "admin:scheduling_apikey_add"
NOT_RUNNING = "the proxy is not running in this process"
DEFAULT_NUMBERS = ("3 h 30 min", "3 h 20 min", "3 h 10 min", "110 min", "100 min", "90 min",
                   "10 min")


@pytest.fixture
def client() -> Client:
    c = Client()
    c.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return c


def form_data(response, **changes) -> dict[str, str]:
    """The POST a browser would send for the form on this page, with `changes` typed in."""
    form = response.context["adminform"].form
    data: dict[str, str] = {}
    for name, bound in form.fields.items():
        value = form[name].value()
        if isinstance(bound.widget, forms.NullBooleanSelect):
            data[name] = {True: "true", False: "false"}.get(value, "unknown")
        elif isinstance(bound, forms.BooleanField):
            if value:
                data[name] = "on"
        else:
            data[name] = "" if value is None else str(value)
    data.update({k: str(v) for k, v in changes.items()})
    return {k: v for k, v in data.items() if v is not None}


def page_text(response) -> str:
    return html.unescape(response.content.decode())


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# ---- proxy settings --------------------------------------------------------------------------

@pytest.fixture
def settings_url() -> str:
    return reverse(SETTINGS_CHANGE, args=[ProxySettings.load().pk])


@pytest.mark.django_db
def test_settings_page_shows_the_guarantees_of_the_defaults(client, settings_url):
    r = client.get(settings_url)
    assert r.status_code == 200
    text = page_text(r)
    assert 'id="guarantees-list"' in text
    for number in DEFAULT_NUMBERS:
        assert number in text, number
    assert "(200 × 60 s)" in text
    assert "holds: the bonus (10) is below the 100 points between bands" in text
    assert "scheduling/guarantees.js" in text
    for element in ("id_aging_divisor", "id_swap_affinity_bonus", "id_scheduler",
                    "guarantees-fifo"):  # what the script looks up
        assert f'id="{element}"' in text, element
    # the panel sits between the Scheduler fieldset and the rest
    assert text.index(">Scheduler<") < text.index("What these values guarantee") \
        < text.index(">Models<")
    for heading in ("Listing", "Performance monitoring"):
        assert f">{heading}<" in text
    assert "Saved changes apply to the running proxy at once" in text
    assert "routing.scheduler.settings.serial.agingDivisor" in text  # help texts name the key
    assert r.context["adminform"].form.fields.keys() >= {"aging_divisor", "swap_affinity_bonus"}
    assert "version" not in r.context["adminform"].form.fields  # shown, read-only


@pytest.mark.django_db
def test_settings_changelist_goes_to_the_one_row(client, settings_url):
    r = client.get(reverse("admin:scheduling_proxysettings_changelist"))
    assert r.status_code == 302 and r.url == settings_url


@pytest.mark.django_db
def test_a_bonus_of_120_is_refused_on_the_field_and_changes_nothing(client, settings_url):
    before = ProxySettings.load()
    r = client.post(settings_url, form_data(client.get(settings_url), swap_affinity_bonus=120))
    assert r.status_code == 200  # the form again, not a redirect
    errors = r.context["adminform"].form.errors
    assert list(errors) == ["swap_affinity_bonus"]
    assert "0..99" in errors["swap_affinity_bonus"][0]
    text = page_text(r)
    assert "100 or more would lift a request into the next priority band" in text
    # the panel speaks about the typed value, not the saved one
    assert "bonus ≥ 100: band isolation is broken" in text
    assert "refused on save" in text
    after = ProxySettings.objects.get(pk=before.pk)
    assert (after.swap_affinity_bonus, after.version) == (before.swap_affinity_bonus,
                                                           before.version)


@pytest.mark.django_db
@pytest.mark.parametrize("divisor", ["0", "-1"])
def test_an_aging_divisor_of_zero_or_below_is_refused(client, settings_url, divisor):
    before = ProxySettings.load()
    r = client.post(settings_url, form_data(client.get(settings_url), aging_divisor=divisor))
    assert r.status_code == 200
    errors = r.context["adminform"].form.errors
    assert list(errors) == ["aging_divisor"]
    assert "could starve" in errors["aging_divisor"][0]
    assert "agingDivisor ≤ 0" in page_text(r)
    assert ProxySettings.objects.get(pk=before.pk).version == before.version


@pytest.mark.django_db
def test_a_valid_bonus_is_saved_and_bumps_the_version(client, settings_url):
    before = ProxySettings.load()
    r = client.post(settings_url, form_data(client.get(settings_url), swap_affinity_bonus=20))
    assert r.status_code == 302
    after = ProxySettings.objects.get(pk=before.pk)
    assert after.swap_affinity_bonus == 20
    assert after.version == before.version + 1
    # and the page now computes with 20: T = (200 + 20) * 60 s = 3 h 40 min
    assert "3 h 40 min ((200 + 20) × 60 s)" in page_text(client.get(settings_url))


@pytest.mark.django_db
def test_settings_cannot_be_added_or_deleted(client, settings_url):
    assert client.get(reverse("admin:scheduling_proxysettings_add")).status_code == 403
    pk = ProxySettings.load().pk
    assert client.get(reverse("admin:scheduling_proxysettings_delete", args=[pk])).status_code \
        == 403
    text = page_text(client.get(settings_url))
    assert "deletelink" not in text
    assert 'name="_addanother"' not in text


@pytest.mark.django_db
def test_fifo_shows_the_panel_with_its_caveat(client, settings_url):
    settings = ProxySettings.load()
    settings.scheduler = "fifo"
    settings.save()
    text = client.get(settings_url).content.decode()
    assert re.search(r'<p class="help" id="guarantees-fifo">', text)  # not hidden
    settings.scheduler = "serial"
    settings.save()
    text = client.get(settings_url).content.decode()
    assert re.search(r'<p class="help" id="guarantees-fifo" hidden>', text)


# ---- model definitions -----------------------------------------------------------------------

def add_model(client: Client, **typed):
    fields = {"model_id": "m", "cmd": "llama-server --port 5800",
              "proxy": "http://127.0.0.1:5800", **typed}
    return client.post(reverse(MODEL_ADD), form_data(client.get(reverse(MODEL_ADD)), **fields))


@pytest.mark.django_db
def test_a_valid_model_is_added(client):
    r = add_model(client, model_id="good", aliases='["g"]')
    assert r.status_code == 302, r.context["adminform"].form.errors
    assert ModelDefinition.objects.get(model_id="good").aliases == ["g"]


@pytest.mark.django_db
def test_a_model_added_without_parallel_gets_its_slots_from_cmd_and_shows_where(client):
    r = add_model(client, model_id="coder", cmd="llama-server --port 5800 -np 3")
    assert r.status_code == 302, r.context["adminform"].form.errors
    coder = ModelDefinition.objects.get(model_id="coder")
    assert coder.parallel is None  # not set: the command decides, now and after an edit
    assert build_catalog().models["coder"].parallel == 3
    page = page_text(client.get(reverse("admin:scheduling_modeldefinition_change",
                                        args=[coder.pk])))
    slots = re.search(r'<div class="readonly">(3 · `-np 3` in cmd)</div>', page)
    assert slots, "the change page does not show the derived slots and their source"
    listing = page_text(client.get(reverse(MODEL_LIST)))
    # the list: the number, its source on hover (the sentence made the list too wide)
    assert re.search(r'<td class="field-slots_short"><span title="`-np 3` in cmd">3</span></td>',
                     listing)


@pytest.mark.django_db
def test_a_model_added_with_parallel_keeps_it_and_says_so(client):
    r = add_model(client, model_id="pinned", cmd="llama-server --port 5800", parallel="2")
    assert r.status_code == 302, r.context["adminform"].form.errors
    pinned = ModelDefinition.objects.get(model_id="pinned")
    assert pinned.parallel == 2 and build_catalog().models["pinned"].parallel == 2
    listing = page_text(client.get(reverse(MODEL_LIST)))
    assert re.search(r'<td class="field-slots_short"><span title="`parallel` set explicitly">'
                     r"2</span></td>", listing)


@pytest.mark.django_db
def test_the_settings_page_says_what_bounds_a_models_queue(client, settings_url):
    """No per-model cap under serial unless concurrencyLimit is set: the 20,000 the page
    promises is the cap, and it says so (llama-swap's 10 only under fifo)."""
    text = " ".join(page_text(client.get(settings_url)).split())
    assert ("Under serial, a model without a concurrencyLimit of its own has no cap beyond "
            "these") in text
    assert "fifo keeps llama-swap's 10 per model" in text
    # the panel's times are about when requests start; several slots start several at once
    assert ("A model with several slots (its parallel, or what its cmd gives: llama-server's "
            "-np, 4 when absent; the model page shows it) starts up to that many requests at "
            "once") in text


@pytest.mark.django_db
def test_an_unbalanced_quote_in_cmd_is_refused_with_the_clean_message(client):
    r = add_model(client, cmd='llama-server --model "/models/a b.gguf')
    assert r.status_code == 200
    errors = r.context["adminform"].form.errors
    assert "cmd" in errors
    assert "The command cannot be used" in errors["cmd"][0]
    assert "The command cannot be used" in page_text(r)
    assert not ModelDefinition.objects.filter(model_id="m").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("aliases", "says"), [
    ('["a"]', "Alias 'a' is already used by model 'alpha'."),
    ('["alpha"]', "Alias 'alpha' is already a model id."),
])
def test_an_alias_clash_is_refused(client, aliases, says):
    ModelDefinition.objects.create(model_id="alpha", cmd="x", proxy="http://127.0.0.1:1",
                                   aliases=["a"])
    r = add_model(client, model_id="beta", aliases=aliases)
    assert r.status_code == 200
    assert r.context["adminform"].form.errors["aliases"] == [says]
    assert not ModelDefinition.objects.filter(model_id="beta").exists()


@pytest.fixture
def two_models() -> list[ModelDefinition]:
    return [ModelDefinition.objects.create(model_id=m, cmd="x", proxy="http://127.0.0.1:1",
                                           enabled=m != "off")
            for m in ("alpha", "off")]


@pytest.mark.django_db
def test_the_list_has_a_live_state_column_that_says_no_proxy_runs_here(client, two_models):
    assert not control.running()
    r = client.get(reverse(MODEL_LIST))
    assert r.status_code == 200
    text = r.content.decode()
    assert "Live state" in text
    cells = re.findall(r'<td class="field-live_state">(.*?)</td>', text)
    # a disabled model says so whether or not a proxy runs (the list has no enabled column)
    assert cells == [f'<span title="{NOT_RUNNING}">—</span>', "disabled"]


@pytest.mark.django_db
def test_the_live_state_is_read_once_per_page(client, two_models, monkeypatch):
    calls = []
    monkeypatch.setattr(control, "running", lambda: True)
    monkeypatch.setattr(control, "live_models", lambda: calls.append(1) or {
        "alpha": control.ModelLive("ready", True, 2)})
    text = client.get(reverse(MODEL_LIST)).content.decode()
    assert calls == [1]
    cells = re.findall(r'<td class="field-live_state">(.*?)</td>', text)
    assert cells == ["ready · 2 in flight · restart needed", "disabled"]


@pytest.mark.django_db
def test_the_change_page_shows_the_live_state_and_what_saving_does(client, two_models):
    r = client.get(reverse("admin:scheduling_modeldefinition_change", args=[two_models[0].pk]))
    text = page_text(r)
    assert "Live state" in text and NOT_RUNNING in text
    assert "Saved changes apply to the running proxy at once" in text
    assert "Editing cmd is running a program on this box" in text
    for heading in ("Identity", "Process", "Requests and scheduling", "Filters", "Listing"):
        assert f">{heading}<" in text
    # the add page has no live state to show
    assert "field-live_state" not in client.get(reverse(MODEL_ADD)).content.decode()


def run_action(client: Client, action: str, *models: ModelDefinition) -> list[str]:
    r = client.post(reverse(MODEL_LIST), {
        "action": action, "index": "0", "_selected_action": [str(m.pk) for m in models]},
        follow=True)
    assert r.status_code == 200
    return messages_of(r)


@pytest.mark.django_db
@pytest.mark.parametrize("action", ["load_models", "unload_models", "restart_models"])
def test_an_action_without_a_proxy_says_so(client, two_models, action):
    said = run_action(client, action, two_models[0])
    assert len(said) == 1
    assert said[0].startswith(NOT_RUNNING)
    assert "gpuproxy serve" in said[0]


@pytest.mark.django_db
def test_loading_a_disabled_model_is_refused(client, two_models):
    said = run_action(client, "load_models", two_models[1])
    assert said == ["Model off is disabled, so it cannot be loaded: enable it and save first."]


@pytest.mark.django_db
def test_staff_who_may_only_view_get_no_actions(two_models):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_modeldefinition"))
    c = Client()
    c.force_login(viewer)
    r = c.get(reverse(MODEL_LIST))
    assert r.status_code == 200
    assert "load_models" not in r.content.decode()
    r = c.post(reverse(MODEL_LIST), {"action": "load_models", "index": "0",
                                     "_selected_action": [str(two_models[0].pk)]}, follow=True)
    assert not any("proxy" in m for m in messages_of(r))  # nothing was attempted


# ---- API keys --------------------------------------------------------------------------------

KEY = re.compile(r"sk-gp-[A-Za-z0-9_-]+")


@pytest.mark.django_db
def test_a_new_key_is_shown_once_and_stored_hashed(client):
    r = client.post(reverse(KEY_ADD), {"name": "ci"}, follow=True)
    assert r.status_code == 200
    said = [m for m in messages_of(r) if KEY.search(m)]
    assert len(said) == 1
    key = KEY.search(said[0]).group(0)
    assert len(key) > 20

    row = ApiKey.objects.get(name="ci")
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest() != key
    assert row.prefix == key[:10] and row.prefix.startswith("sk-gp-")
    stored = [str(v) for v in ApiKey.objects.filter(pk=row.pk).values().get().values()]
    assert not any(key in v for v in stored)

    # never again: not on the list, not on the change page, not after a save
    listing = client.get(reverse("admin:scheduling_apikey_changelist")).content.decode()
    assert key not in listing
    assert "ci" in listing and row.prefix in listing
    change = reverse("admin:scheduling_apikey_change", args=[row.pk])
    assert key not in client.get(change).content.decode()
    r = client.post(change, {"name": "ci-renamed"}, follow=True)
    assert key not in r.content.decode()
    assert not KEY.search(" ".join(messages_of(r)).replace(row.prefix, ""))

    # and the key works: the proxy's catalog knows it by its hash
    assert auth.key_name(key, build_catalog().api_keys) == "ci-renamed"
    assert auth.key_name(key + "x", build_catalog().api_keys) is None


@pytest.mark.django_db
def test_a_key_needs_a_name(client):
    r = client.post(reverse(KEY_ADD), {"name": ""})
    assert r.status_code == 200
    assert r.context["adminform"].form.errors["name"] == ["This field is required."]
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_the_key_list_shows_name_prefix_and_creation(client):
    ApiKey.objects.create(name="k1", key_hash="0" * 64, prefix="sk-abc")
    text = client.get(reverse("admin:scheduling_apikey_changelist")).content.decode()
    for column in ("column-name", "column-prefix", "column-created_at"):
        assert column in text
    assert "k1" in text and "sk-abc" in text


# ---- against a running proxy -----------------------------------------------------------------

LIST_PATH = "/admin/scheduling/modeldefinition/"
CSRF = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


def admin_session(proxy) -> httpx.Client:
    """Log in over HTTP as a browser does: the login form, its CSRF token and cookie."""
    User.objects.create_superuser("root", "root@example.com", "pw")
    h = httpx.Client(base_url=proxy.base, trust_env=False, timeout=30)
    r = h.get("/admin/login/")
    assert r.status_code == 200
    r = h.post("/admin/login/?next=/admin/", data={
        "username": "root", "password": "pw", "next": "/admin/",
        "csrfmiddlewaretoken": CSRF.search(r.text).group(1)})
    assert r.status_code == 302, r.text
    assert r.headers["location"] == "/admin/"
    return h


def post_action(h: httpx.Client, action: str, model: ModelDefinition) -> str:
    """Run an action as the changelist's form does; the messages the next page shows."""
    page = h.get(LIST_PATH)
    r = h.post(LIST_PATH, data={"action": action, "index": "0",
                                "_selected_action": str(model.pk),
                                "csrfmiddlewaretoken": CSRF.search(page.text).group(1)})
    assert r.status_code == 302, r.text
    shown = re.findall(r'<ul class="messagelist">(.*?)</ul>', h.get(LIST_PATH).text, re.S)
    assert shown, "no message"
    return " | ".join(html.unescape(li) for li in re.findall(r"<li[^>]*>(.*?)</li>", shown[0]))


def live_cell(h: httpx.Client, model: ModelDefinition) -> str:
    text = html.unescape(h.get(LIST_PATH).text)
    row = re.search(rf'<tr>.*?>{re.escape(model.model_id)}</a></th>(.*?)</tr>', text, re.S)
    assert row, text
    return re.search(r'<td class="field-live_state">(.*?)</td>', row.group(1)).group(1)


@pytest.mark.django_db(transaction=True)
def test_static_files_are_served_by_gpuproxy_serve(serve):
    proxy = serve(one_model(free_port()))
    css = proxy.http.get("/static/admin/css/base.css")
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")
    js = proxy.http.get("/static/scheduling/guarantees.js")
    assert js.status_code == 200
    assert "formatDuration" in js.text
    assert proxy.http.get("/static/nope.css").status_code == 404
    assert proxy.http.get("/health").status_code == 200  # everything else still routes


@pytest.mark.django_db(transaction=True)
def test_load_and_unload_from_the_admin(serve):
    proxy = serve(one_model(free_port()))
    h = admin_session(proxy)
    solo = ModelDefinition.objects.get(model_id="solo")
    assert live_cell(h, solo) == "stopped"

    page = post_action(h, "load_models", solo)
    assert "Loading solo started" in page or "Model solo is ready." in page
    until("solo ready in /running", lambda: running(proxy).get("solo", {}).get("state")
          == "ready")
    assert until("the list says ready", lambda: live_cell(h, solo) == "ready")

    page = post_action(h, "unload_models", solo)
    assert "Stopped solo." in page or "Stopping solo" in page
    until("solo gone from /running", lambda: "solo" not in running(proxy))
    assert until("the list says stopped", lambda: live_cell(h, solo) == "stopped")


NO_SUCH_SERVER = "/nonexistent/gpuproxy-test-no-such-server"


@pytest.mark.django_db(transaction=True)
def test_load_reports_an_immediate_refusal_and_does_not_wait_for_a_slow_load(serve):
    """The action waits a moment for the proxy's answer: a refusal given at once is shown as
    such, and a load that takes long is reported as started without holding the page. The
    refusal is a missing executable, not an unknown model: a definition saved after the proxy
    started reaches it (its reload when LISTEN connects) at a moment no test controls."""
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 60
    models:
      broken:
        cmd: {NO_SUCH_SERVER} --port ${{PORT}}
      slow:
        cmd: {FAKE} --load-seconds 30
    """)
    h = admin_session(proxy)
    broken = ModelDefinition.objects.get(model_id="broken")
    slow = ModelDefinition.objects.get(model_id="slow")

    said = post_action(h, "load_models", broken)
    api = proxy.http.post("/api/models/load/broken")
    assert api.status_code == 502
    refusal = api.json()["error"]["message"]
    # the public text: what happened and the port, never the command line (the log has it)
    assert "its executable was not found" in refusal and NO_SUCH_SERVER not in refusal
    assert said == "Model broken could not be loaded: " + refusal
    # Staff see the details the client did not: the list on hover, the change page in full.
    cell = live_cell(h, broken)
    assert re.fullmatch(r'<span title=".+">failed</span>', cell, re.S), cell
    assert f"executable '{NO_SUCH_SERVER}' not found" in cell
    change = html.unescape(h.get(f"/admin/scheduling/modeldefinition/{broken.pk}/change/").text)
    assert f"failed: model \"broken\" could not start: executable '{NO_SUCH_SERVER}'" in change

    started = time.monotonic()
    said = post_action(h, "load_models", slow)
    assert time.monotonic() - started < 5  # the load itself takes 30 s
    assert said == ("Loading slow started: it can take minutes; the live state column shows "
                    "when it is ready.")
    assert live_cell(h, slow) == "starting"


@pytest.mark.django_db(transaction=True)
def test_the_live_state_cells_of_a_running_proxy(serve):
    """The cell texts the spy test above checks, from a real proxy: requests in flight, a
    restart pending on them, and a disabled model."""
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
        parallel: 2
      off:
        cmd: {FAKE}
        enabled: false
    """)
    h = admin_session(proxy)
    solo = ModelDefinition.objects.get(model_id="solo")
    off = ModelDefinition.objects.get(model_id="off")
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    callers = [Chat(proxy.base, "solo", gate="held") for _ in range(2)]
    until("two requests in flight", lambda: proxy.http.get("/api/queue").json()["in_flight"]
          .get("solo") == 2)
    assert "Restart requested for solo" in post_action(h, "restart_models", solo)
    assert until("the list shows both and the pending restart",
                 lambda: live_cell(h, solo) == "ready · 2 in flight · restart needed")
    assert live_cell(h, off) == "disabled"
    open_gate(start + 1, "held")  # off sorts before solo: solo has the second port
    for c in callers:
        assert c.answered().status_code == 200


@pytest.mark.django_db(transaction=True)
def test_the_settings_page_over_http_shows_the_panel_and_saves(serve):
    proxy = serve(one_model(free_port()))
    h = admin_session(proxy)
    path = f"/admin/scheduling/proxysettings/{ProxySettings.load().pk}/change/"
    text = html.unescape(h.get(path).text)
    assert all(n in text for n in DEFAULT_NUMBERS)
    assert '<script src="/static/scheduling/guarantees.js" defer>' in text


@pytest.mark.django_db(transaction=True)
def test_restart_when_idle_waits_for_the_request_in_flight(serve):
    start = free_port()
    proxy = serve(one_model(start))
    h = admin_session(proxy)
    solo = ModelDefinition.objects.get(model_id="solo")
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    old_pid = running(proxy)["solo"]["pid"]

    caller = Chat(proxy.base, "solo", gate="held")
    until("the request in flight", lambda: proxy.http.get("/api/queue").json()["in_flight"]
          .get("solo") == 1)
    page = post_action(h, "restart_models", solo)
    assert "Restart requested for solo" in page
    assert until("the list shows the pending restart",
                 lambda: live_cell(h, solo) == "ready · 1 in flight · restart needed")
    assert running(proxy)["solo"]["pid"] == old_pid  # the request in flight is not cut off

    open_gate(start, "held")
    assert caller.answered().status_code == 200
    until("the old process exits", lambda: process_gone(old_pid))
    until("solo is ready again in a new process",
          lambda: (running(proxy).get("solo", {}).get("state") == "ready"
                   and running(proxy)["solo"]["pid"] != old_pid))
    assert until("the mark clears", lambda: live_cell(h, solo) == "ready")


@pytest.mark.django_db(transaction=True)
def test_restart_of_an_idle_model_replaces_its_process(serve):
    proxy = serve(one_model(free_port()))
    h = admin_session(proxy)
    solo = ModelDefinition.objects.get(model_id="solo")
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    old_pid = running(proxy)["solo"]["pid"]
    assert "Restart requested for solo" in post_action(h, "restart_models", solo)
    until("a new process is ready",
          lambda: (running(proxy).get("solo", {}).get("state") == "ready"
                   and running(proxy)["solo"]["pid"] != old_pid))
    assert process_gone(old_pid)
    assert until("the list says ready", lambda: live_cell(h, solo) == "ready")


# ---- rows the config file manages --------------------------------------------------------------

BANNER = "edits here are replaced when the file changes"


@pytest.mark.django_db
def test_pages_of_what_the_file_defines_say_it_manages_them(client, tmp_path, settings_url):
    from scheduling.importer import import_path
    from scheduling.models import ModelGroup

    config = tmp_path / "config.yaml"
    config.write_text("apiKeys: [sk-file-key-123]\nmodels:\n  filed: {cmd: s}\n"
                      "groups:\n  g: {members: [filed]}\n", encoding="utf-8")
    import_path(config)
    made_here = ModelDefinition.objects.create(model_id="made-here", cmd="x",
                                               proxy="http://127.0.0.1:1")
    key = ApiKey(name="made-here")
    key.set_key("sk-gp-made-here-0")
    key.save()
    banner = f"Managed by {config}: {BANNER}."

    def page(name: str, obj) -> str:
        return page_text(client.get(reverse(f"admin:scheduling_{name}_change", args=[obj.pk])))

    assert banner in page("modeldefinition", ModelDefinition.objects.get(model_id="filed"))
    assert banner in page("modelgroup", ModelGroup.objects.get(group_id="g"))
    assert banner in page("apikey", ApiKey.objects.get(prefix="sk-fi"))
    assert banner in page_text(client.get(settings_url))
    assert BANNER not in page("modeldefinition", made_here)
    assert BANNER not in page("apikey", key)
    assert BANNER not in page_text(client.get(reverse(MODEL_ADD)))


@pytest.mark.django_db
def test_without_an_import_no_page_says_it_is_managed(client, two_models, settings_url):
    assert BANNER not in page_text(client.get(settings_url))
    assert BANNER not in page_text(client.get(
        reverse("admin:scheduling_modeldefinition_change", args=[two_models[0].pk])))


@pytest.mark.django_db
def test_the_last_import_is_shown_and_cannot_be_edited_here(client, tmp_path):
    from scheduling.importer import import_path
    from scheduling.models import ConfigImport

    config = tmp_path / "config.yaml"
    config.write_text("models:\n  filed: {cmd: s}\n", encoding="utf-8")
    import_path(config)
    text = page_text(client.get(reverse("admin:scheduling_configimport_changelist")))
    assert str(config) in text
    page = client.get(reverse("admin:scheduling_configimport_change",
                              args=[ConfigImport.last().pk]))
    assert page.status_code == 200 and '"filed"' in page_text(page)
    assert client.get(reverse("admin:scheduling_configimport_add")).status_code == 403
    assert 'name="source_path"' not in page.content.decode()
