"""The admin pages of llama-swap's routing: matrix sets (the expression checked by a JSON view
as it is typed, and on save), peers (a write-only API key), selectors, profiles, the settings'
routing fields and the trusted-peer flag of API keys. Django's test client, a staff user, the
test database; no proxy runs here (the pages only save rows; the signals carry them)."""

from __future__ import annotations

import html
import json

import pytest
from django import forms
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from scheduling.models import ApiKey, ModelDefinition, ProxySettings
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

pytestmark = pytest.mark.django_db

CHECK = "admin:scheduling_matrixset_check"
PEER_KEY = "sk-peer-Zq8mW2xK5vR9tY3u"
REMEDY = "; define the model under models:, or fix the set"  # scheduling/routing_checks.py


@pytest.fixture
def client() -> Client:
    c = Client()
    c.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return c


@pytest.fixture
def models() -> list[str]:
    """Four enabled models and a disabled one (the running proxy knows only enabled ones)."""
    for m in ("llama", "qwen", "embed", "gemma", "off"):
        ModelDefinition.objects.create(model_id=m, cmd="x", proxy="http://127.0.0.1:1",
                                       enabled=m != "off")
    return ["llama", "qwen", "embed", "gemma"]


def form_data(response, **changes: object) -> dict[str, str]:
    """The POST a browser would send for the form on this page, with `changes` typed in."""
    form = response.context["adminform"].form
    data: dict[str, str] = {}
    for name, field in form.fields.items():
        value = form[name].value()
        if isinstance(field, forms.BooleanField):
            if value:
                data[name] = "on"
        elif isinstance(value, list | dict):
            data[name] = json.dumps(value)
        else:
            data[name] = "" if value is None else str(value)
    for name, value in changes.items():  # None unticks a box (a browser sends nothing)
        if value is None:
            data.pop(name, None)
        else:
            data[name] = str(value)
    return data


def text(response) -> str:
    return html.unescape(response.content.decode())


def errors(response) -> dict[str, list[str]]:
    return {k: [str(e) for e in v] for k, v in response.context["adminform"].form.errors.items()}


def check(client: Client, dsl: str, name: str = "s", **more: object) -> dict:
    r = client.post(reverse(CHECK), {"name": name, "dsl": dsl, **more})
    assert r.status_code == 200, r.content
    return r.json()


# ---- matrix sets: the check view ---------------------------------------------------------------

def test_a_good_expression_answers_the_combinations_it_allows(client, models):
    assert check(client, "(llama | qwen) & embed") == {
        "ok": True, "error": "", "truncated": False,
        "combinations": [["embed", "llama"], ["embed", "qwen"]],
        "note": "The router in force is group: the matrix applies once the settings page's "
                "router is matrix."}


def test_vars_and_references_to_other_sets_are_expanded(client, models):
    settings = ProxySettings.load()
    settings.matrix_vars = {"g": "gemma", "e": "embed"}
    settings.router = "matrix"
    settings.save()
    MatrixSet.objects.create(name="chat", dsl="llama | qwen", position=0)
    answer = check(client, "+chat & e | g")
    assert answer["ok"] and answer["note"] == ""
    assert answer["combinations"] == [["embed", "llama"], ["embed", "qwen"], ["gemma"]]


def test_subsets_are_not_listed_beside_the_combination_that_holds_them(client, models):
    assert check(client, "llama | llama & qwen")["combinations"] == [["llama", "qwen"]]


@pytest.mark.parametrize(("dsl", "error"), [
    ("llama & (qwen", "set 's': missing closing parenthesis"),
    ("llama & nope", f"set 's': unknown var or model 'nope'{REMEDY}"),
    ("llama &", "set 's': unexpected end"),
    ("+missing", f"set 's' references undefined set 'missing'{REMEDY}"),
    ("llama ; qwen", "set 's': unexpected character ';' at position 6"),
    ("  ", "set 's': empty expression"),
])
def test_a_bad_expression_answers_what_is_wrong(client, models, dsl, error):
    assert check(client, dsl) == {"ok": False, "error": error, "combinations": [],
                                  "truncated": False, "note": ""}


def test_a_cycle_through_another_set_is_found(client, models):
    MatrixSet.objects.create(name="a", dsl="llama | +s", position=0)
    answer = check(client, "qwen & +a")
    assert not answer["ok"]
    assert "circular reference" in answer["error"]


def test_the_name_is_checked_too(client, models):
    MatrixSet.objects.create(name="taken", dsl="llama")
    assert check(client, "qwen", name="taken")["error"] == (
        "a matrix set named 'taken' already exists: pick another name")
    # the set being changed may keep its own name
    own = MatrixSet.objects.get(name="taken")
    assert check(client, "qwen", name="taken", pk=own.pk)["ok"]


def test_the_check_view_wants_a_post_from_staff(client, models):
    r = client.get(reverse(CHECK))
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"
    plain = Client()
    plain.force_login(User.objects.create_user("plain", password="pw"))
    r = plain.post(reverse(CHECK), {"name": "s", "dsl": "llama"})
    assert r.status_code == 302 and "/admin/login/" in r["Location"]
    viewer = Client()
    viewer.force_login(User.objects.create_user("viewer", password="pw", is_staff=True))
    r = viewer.post(reverse(CHECK), {"name": "s", "dsl": "llama"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = client.post(reverse(CHECK), {"name": "s", "dsl": "llama", "position": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"


# ---- matrix sets: the pages --------------------------------------------------------------------

def test_a_set_is_added_and_a_bad_one_refused_with_the_checks_words(client, models):
    add = reverse("admin:scheduling_matrixset_add")
    r = client.post(add, {"name": "bad", "dsl": "llama & nope", "position": "0"})
    assert r.status_code == 200
    assert errors(r) == {"dsl": [f"set 'bad': unknown var or model 'nope'{REMEDY}"]}
    assert not MatrixSet.objects.exists()
    r = client.post(add, {"name": "pair", "dsl": "llama & embed", "position": "0"})
    assert r.status_code == 302
    assert MatrixSet.objects.get().dsl == "llama & embed"


def test_the_change_page_shows_the_saved_sets_combinations_and_the_script(client, models):
    s = MatrixSet.objects.create(name="pair", dsl="(llama | qwen) & embed")
    page = text(client.get(reverse("admin:scheduling_matrixset_change", args=[s.pk])))
    assert "matrix_check.js" in page
    assert f'data-url="{reverse(CHECK)}"' in page
    assert "<code>embed & llama</code>" in page
    assert "<code>embed & qwen</code>" in page


def test_the_list_is_in_position_order_and_the_order_is_editable_there(client, models):
    b = MatrixSet.objects.create(name="b-first", dsl="llama", position=0)
    a = MatrixSet.objects.create(name="a-second", dsl="qwen", position=1)
    url = reverse("admin:scheduling_matrixset_changelist")
    page = text(client.get(url))
    assert page.index("b-first") < page.index("a-second")
    r = client.post(url, {
        "form-TOTAL_FORMS": "2", "form-INITIAL_FORMS": "2",
        "form-0-id": str(b.pk), "form-0-position": "5",
        "form-1-id": str(a.pk), "form-1-position": "1", "_save": "Save"})
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    page = text(client.get(url))
    assert page.index("a-second") < page.index("b-first")
    assert list(MatrixSet.objects.values_list("name", flat=True)) == ["a-second", "b-first"]


# ---- peers -------------------------------------------------------------------------------------

def add_peer(client: Client, **changes: str):
    page = client.get(reverse("admin:scheduling_peer_add"))
    data = form_data(page, peer_id="remote", proxy="https://peer.example.com:8443/",
                     models_list='["llama-3.1-8b", "qwen"]', priority_forward="header")
    data.update(changes)
    return client.post(reverse("admin:scheduling_peer_add"), data)


def every_page_of(client: Client, peer: Peer) -> str:
    change = reverse("admin:scheduling_peer_change", args=[peer.pk])
    return "".join(client.get(url).content.decode() for url in (
        reverse("admin:scheduling_peer_changelist"), change,
        reverse("admin:scheduling_peer_history", args=[peer.pk]),
        reverse("admin:scheduling_peer_delete", args=[peer.pk]), reverse("admin:index")))


def test_a_peers_key_is_saved_and_never_shown_again(client):
    r = add_peer(client, api_key=PEER_KEY)
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    peer = Peer.objects.get()
    assert peer.api_key == PEER_KEY
    pages = every_page_of(client, peer)
    assert PEER_KEY not in pages and PEER_KEY[:8] not in pages
    listing = text(client.get(reverse("admin:scheduling_peer_changelist")))
    assert "set (hidden)" in listing and "peer.example.com:8443" in listing


def test_a_blank_key_keeps_the_saved_one_a_new_one_replaces_it_and_clear_removes_it(client):
    add_peer(client, api_key=PEER_KEY)
    peer = Peer.objects.get()
    url = reverse("admin:scheduling_peer_change", args=[peer.pk])
    page = client.get(url)
    assert page.context["adminform"].form["api_key"].value() in ("", None)

    r = client.post(url, form_data(page, proxy="http://10.0.0.2:8080"))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    peer.refresh_from_db()
    assert (peer.proxy, peer.api_key) == ("http://10.0.0.2:8080", PEER_KEY)

    client.post(url, form_data(client.get(url), api_key="sk-new-key"))
    peer.refresh_from_db()
    assert peer.api_key == "sk-new-key"

    r = client.post(url, form_data(client.get(url), api_key="sk-other", clear_api_key="on"))
    assert errors(r) == {"clear_api_key": ["Type a new key or remove the saved one, not both."]}
    client.post(url, form_data(client.get(url), clear_api_key="on"))
    peer.refresh_from_db()
    assert peer.api_key == ""
    assert "none" in text(client.get(reverse("admin:scheduling_peer_changelist")))


def test_a_page_shown_again_with_errors_does_not_echo_the_typed_key(client):
    r = add_peer(client, api_key=PEER_KEY, models_list="[]")
    assert r.status_code == 200
    assert "models_list" in errors(r)
    assert PEER_KEY not in r.content.decode()
    assert not Peer.objects.exists()


def test_a_user_or_password_in_the_url_is_refused_the_key_goes_in_api_key(client):
    r = add_peer(client, proxy="https://user:hunter2@peer.example.com/v1")
    assert r.status_code == 200
    assert "apiKey" in " ".join(errors(r)["proxy"])
    assert not Peer.objects.exists()


def test_staff_who_may_only_view_see_whether_a_key_is_set_never_the_key(client):
    """Django shows a read-only field with the model's value: a view-only user must get the
    key's state in its place (the superuser's form has an empty password input)."""
    peer = Peer.objects.create(peer_id="remote", proxy="https://peer.example.com/",
                               api_key=PEER_KEY, models_list=["m"])
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_peer"))
    c = Client()
    c.force_login(viewer)
    page = text(c.get(reverse("admin:scheduling_peer_change", args=[peer.pk])))
    assert "peer.example.com" in page and "set (hidden)" in page
    assert PEER_KEY not in page


# ---- selectors, profiles -----------------------------------------------------------------------

def test_a_selector_is_added_listed_and_changed(client, models):
    add = reverse("admin:scheduling_selector_add")
    data = form_data(client.get(add), selector_id="coder", strategy="warm",
                     targets='["llama", "qwen"]', spillover="1")
    r = client.post(add, data)
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    sel = Selector.objects.get()
    assert (sel.strategy, sel.targets) == ("warm", ["llama", "qwen"])
    assert "llama → qwen" in text(client.get(reverse("admin:scheduling_selector_changelist")))
    url = reverse("admin:scheduling_selector_change", args=[sel.pk])
    r = client.post(url, form_data(client.get(url), strategy="pin"))
    assert r.status_code == 302
    sel.refresh_from_db()
    assert sel.strategy == "pin"


def test_a_profile_is_added_shown_active_and_a_rename_keeps_it_active(client, models):
    add = reverse("admin:scheduling_profile_add")
    r = client.post(add, form_data(client.get(add), name="night",
                                   pins='{"coder": "qwen", "chat": null}'))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    profile = Profile.objects.get()
    assert profile.pins == {"coder": "qwen", "chat": None}
    listing = text(client.get(reverse("admin:scheduling_profile_changelist")))
    assert "coder → qwen" in listing and "chat → (disabled)" in listing
    assert 'alt="False"' in listing

    settings = ProxySettings.load()
    settings.active_profile = "night"
    settings.save()
    assert 'alt="True"' in text(client.get(reverse("admin:scheduling_profile_changelist")))
    url = reverse("admin:scheduling_profile_change", args=[profile.pk])
    client.post(url, form_data(client.get(url), name="late-night"))
    assert ProxySettings.load().active_profile == "late-night"


# ---- the settings page, API keys ---------------------------------------------------------------

@pytest.fixture
def settings_url() -> str:
    return reverse("admin:scheduling_proxysettings_change", args=[ProxySettings.load().pk])


def test_the_active_profile_is_a_choice_of_the_defined_ones(client, models, settings_url):
    Profile.objects.create(name="day", description="the big models")
    Profile.objects.create(name="night")
    form = client.get(settings_url).context["adminform"].form
    assert form.fields["active_profile"].choices == [
        ("", "none"), ("day", "day: the big models"), ("night", "night")]
    r = client.post(settings_url, form_data(client.get(settings_url), active_profile="nope"))
    assert "active_profile" in errors(r)
    r = client.post(settings_url, form_data(client.get(settings_url), active_profile="night"))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    assert ProxySettings.load().active_profile == "night"


def test_a_deleted_active_profile_stays_selectable_and_says_it_is_not_defined(
        client, models, settings_url):
    settings = ProxySettings.load()
    settings.active_profile = "gone"
    settings.save()
    form = client.get(settings_url).context["adminform"].form
    assert ("gone", "gone (not defined: no pins apply)") in form.fields["active_profile"].choices
    r = client.post(settings_url, form_data(client.get(settings_url), aging_divisor="30"))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r


def test_the_matrix_router_needs_a_matrix_that_compiles(client, models, settings_url):
    r = client.post(settings_url, form_data(client.get(settings_url), router="matrix"))
    assert errors(r) == {"router": ["matrix must define at least one set (a set names models "
                                    "that may run together)"]}
    MatrixSet.objects.create(name="all", dsl="g & qwen")
    r = client.post(settings_url, form_data(client.get(settings_url), router="matrix",
                                            matrix_vars='{"g": "nope"}'))
    assert errors(r) == {"matrix_vars": [f"var key 'g' references unknown model 'nope'{REMEDY}"]}
    r = client.post(settings_url, form_data(client.get(settings_url), router="matrix",
                                            matrix_vars='{"g": "gemma"}',
                                            matrix_evict_costs='{"g": 0}'))
    assert errors(r) == {"matrix_evict_costs": ["evict_cost for 'g' must be a positive integer, "
                                                f"got 0{REMEDY}"]}
    r = client.post(settings_url, form_data(client.get(settings_url), router="matrix",
                                            matrix_vars='{"g": "gemma"}',
                                            matrix_evict_costs='{"g": 30}'))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    settings = ProxySettings.load()
    assert (settings.router, settings.matrix_vars, settings.matrix_evict_costs) == (
        "matrix", {"g": "gemma"}, {"g": 30})


def test_the_group_router_keeps_an_unused_matrix_as_it_is(client, models, settings_url):
    """An imported `use: group` config keeps its unvalidated matrix: saving other settings
    must not trip over it."""
    settings = ProxySettings.load()
    settings.matrix_vars = {"g": "not-a-model"}
    settings.save()
    r = client.post(settings_url, form_data(client.get(settings_url), aging_divisor="45"))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r


def test_an_api_key_can_be_marked_a_trusted_peer(client):
    key = ApiKey(name="upstream-box")
    key.set_key("sk-gp-upstream-box-0")
    key.save()
    url = reverse("admin:scheduling_apikey_change", args=[key.pk])
    r = client.post(url, form_data(client.get(url), trusted_peer="on"))
    assert r.status_code == 302, errors(r) if r.status_code == 200 else r
    key.refresh_from_db()
    assert key.trusted_peer
    assert "trusted peer" in text(client.get(reverse("admin:scheduling_apikey_changelist")))


def test_a_new_set_is_offered_the_position_after_the_last(client, models):
    add = reverse("admin:scheduling_matrixset_add")
    assert client.get(add).context["adminform"].form["position"].value() == 0
    MatrixSet.objects.create(name="a", dsl="llama", position=0)
    MatrixSet.objects.create(name="b", dsl="qwen", position=4)
    assert client.get(add).context["adminform"].form["position"].value() == 5


# ---- the rules across tables (scheduling/routing_checks.py), as the importer runs them ------

def add(client: Client, kind: str, **values: str):
    url = reverse(f"admin:scheduling_{kind}_add")
    return client.post(url, form_data(client.get(url), **values), follow=True)


def test_a_selector_is_refused_in_llama_swaps_words_and_a_dangling_target_warned(client, models):
    r = add(client, "selector", selector_id="llama", strategy="pin", targets='["qwen"]',
            spillover="1")
    assert errors(r) == {"__all__": ["selectors.llama: name conflicts with model ID 'llama'; "
                                     "rename the selector"]}
    Peer.objects.create(peer_id="cloud", proxy="http://127.0.0.1:9", models_list=["big"])
    r = add(client, "selector", selector_id="coder", strategy="warm",
            targets='["qwen", "cloud/big"]', spillover="1")
    assert errors(r) == {"targets": ["must resolve to a local model for strategy 'warm' "
                                     "('cloud/big' is a peer's model; use pin or spillover)"]}
    r = add(client, "selector", selector_id="coder", strategy="spillover",
            targets='["qwen", "llama"]', spillover="2")
    assert "targets" in errors(r)  # both in the default group, where one runs at a time
    assert not Selector.objects.exists()

    r = add(client, "selector", selector_id="coder", strategy="pin",
            targets='["qwen", "later"]', spillover="1")
    assert Selector.objects.filter(selector_id="coder").exists()
    said = [str(m) for m in r.context["messages"]]
    assert ("selectors.coder.targets[1]: 'later' is not a model, alias or peer model; the "
            "selector skips it until it is defined") in said


def test_a_matrix_set_edit_that_would_part_a_spillover_selectors_targets_is_refused(
        client, models):
    settings = ProxySettings.load()
    settings.router = "matrix"
    settings.save()
    both = MatrixSet.objects.create(name="both", dsl="llama & qwen")
    Selector.objects.create(selector_id="fill", strategy="spillover", targets=["llama", "qwen"])
    url = reverse("admin:scheduling_matrixset_change", args=[both.pk])
    r = client.post(url, form_data(client.get(url), dsl="llama | qwen"))
    assert errors(r) == {"dsl": ["must all appear together in one expanded matrix set "
                                 "(llama, qwen); add a set that holds them"]}
    assert check(client, "llama | qwen", name="both", pk=both.pk)["error"] == (
        "must all appear together in one expanded matrix set (llama, qwen); add a set that "
        "holds them")


def test_a_peer_model_name_taken_by_a_model_is_refused(client, models):
    ModelDefinition.objects.create(model_id="remote/qwen", cmd="x", proxy="http://127.0.0.1:1")
    r = add_peer(client, models_list='["qwen"]')
    assert errors(r) == {"models_list": [
        "model ID 'remote/qwen' conflicts with fully qualified peer model name (of "
        "peers.remote); rename the model or the peer"]}


def test_help_texts_that_write_llama_swaps_keys_keep_their_angle_brackets(client):
    page = client.get(reverse("admin:scheduling_peer_add")).content.decode()
    assert "`peers.&lt;id&gt;`" in page
    page = client.get(reverse("admin:scheduling_modeldefinition_add")).content.decode()
    assert "`models.&lt;id&gt;`" in page


def test_rows_the_imported_file_defines_carry_its_banner(client, tmp_path):
    from scheduling.importer import import_path

    config = tmp_path / "config.yaml"
    config.write_text("""
models:
  llama: {cmd: s}
  qwen: {cmd: s}
routing:
  router:
    use: matrix
    settings:
      matrix:
        sets:
          solo: "llama | qwen"
peers:
  cloud: {proxy: "http://127.0.0.1:9", models: [big]}
selectors:
  coder: {strategy: pin, targets: [qwen]}
profiles:
  night: {pins: {big: qwen}}
""", encoding="utf-8")
    import_path(config)
    banner = f"Managed by {config}: edits here are replaced when the file changes."
    filed = {"matrixset": MatrixSet.objects.get(name="solo"),
             "peer": Peer.objects.get(peer_id="cloud"),
             "selector": Selector.objects.get(selector_id="coder"),
             "profile": Profile.objects.get(name="night")}
    made_here = {"matrixset": MatrixSet.objects.create(name="here", dsl="llama", position=1),
                 "peer": Peer.objects.create(peer_id="here", proxy="http://127.0.0.1:8",
                                             models_list=["m"]),
                 "selector": Selector.objects.create(selector_id="here", strategy="pin",
                                                     targets=["llama"]),
                 "profile": Profile.objects.create(name="here", pins={"x": "llama"})}
    for kind, obj in filed.items():
        assert banner in text(client.get(reverse(f"admin:scheduling_{kind}_change",
                                                 args=[obj.pk]))), kind
    for kind, obj in made_here.items():
        assert "Managed by" not in text(client.get(reverse(f"admin:scheduling_{kind}_change",
                                                           args=[obj.pk]))), kind


# ---- deletes that would break the routing ---------------------------------------------------

def test_a_set_another_references_is_not_deleted_and_the_page_says_why(client, models):
    a = MatrixSet.objects.create(name="a", dsl="llama", position=0)
    MatrixSet.objects.create(name="b", dsl="+a | qwen", position=1)
    r = client.post(reverse("admin:scheduling_matrixset_delete", args=[a.pk]), {"post": "yes"},
                    follow=True)
    assert MatrixSet.objects.filter(name="a").exists()
    assert [str(m) for m in r.context["messages"]] == [
        f"a: llama was not deleted: without it, routing.router.settings.matrix: set 'b' "
        f"references undefined set 'a'{REMEDY}. Change that first."]
    # the bulk action's confirmation page refuses it too
    r = client.post(reverse("admin:scheduling_matrixset_changelist"),
                    {"action": "delete_selected", "_selected_action": [str(a.pk)],
                     "post": "yes"})
    assert MatrixSet.objects.filter(name="a").exists()
    assert "the routing: without them, routing.router.settings.matrix: set 'b' references" \
        in text(r)


def test_the_last_set_of_the_matrix_router_and_a_model_a_set_names_stay(client, models):
    settings = ProxySettings.load()
    settings.router = "matrix"
    settings.save()
    only = MatrixSet.objects.create(name="only", dsl="llama | qwen")
    client.post(reverse("admin:scheduling_matrixset_delete", args=[only.pk]), {"post": "yes"})
    assert MatrixSet.objects.filter(name="only").exists()
    llama = ModelDefinition.objects.get(model_id="llama")
    r = client.post(reverse("admin:scheduling_modeldefinition_delete", args=[llama.pk]),
                    {"post": "yes"}, follow=True)
    assert ModelDefinition.objects.filter(model_id="llama").exists()
    said = [str(m) for m in r.context["messages"]]
    assert "unknown var or model 'llama'" in said[-1], said
    embed = ModelDefinition.objects.get(model_id="embed")  # in no set: deleted
    client.post(reverse("admin:scheduling_modeldefinition_delete", args=[embed.pk]),
                {"post": "yes"})
    assert not ModelDefinition.objects.filter(model_id="embed").exists()


def test_a_model_a_set_names_is_not_renamed_but_may_be_disabled(client, models):
    settings = ProxySettings.load()
    settings.router = "matrix"
    settings.save()
    MatrixSet.objects.create(name="pair", dsl="llama & embed")
    llama = ModelDefinition.objects.get(model_id="llama")
    url = reverse("admin:scheduling_modeldefinition_change", args=[llama.pk])
    r = client.post(url, form_data(client.get(url), model_id="llama-2"))
    assert errors(r) == {"model_id": [
        "Without the id llama, routing.router.settings.matrix: set 'pair': unknown var or "
        f"model 'llama'{REMEDY}. Change that first."]}
    llama.refresh_from_db()
    assert llama.model_id == "llama"
    # the matrix compiles against disabled models too (Catalog.matrix_models)
    r = client.post(url, form_data(client.get(url), enabled=None))
    assert r.status_code == 302, errors(r)
    llama.refresh_from_db()
    assert not llama.enabled
    qwen = ModelDefinition.objects.get(model_id="qwen")  # in no set: may be renamed
    url = reverse("admin:scheduling_modeldefinition_change", args=[qwen.pk])
    r = client.post(url, form_data(client.get(url), model_id="qwen-2"))
    assert r.status_code == 302, errors(r)


def test_a_profile_is_made_active_and_deactivated_from_the_list(client, models):
    night = Profile.objects.create(name="night", pins={"big": "qwen"})
    day = Profile.objects.create(name="day", pins={"big": "llama"})
    url = reverse("admin:scheduling_profile_changelist")
    r = client.post(url, {"action": "activate", "_selected_action": [night.pk, day.pk]},
                    follow=True)
    assert [str(m) for m in r.context["messages"]] == [
        "Select one profile to make active, not 2: one profile is active at a time."]
    assert ProxySettings.load().active_profile == ""
    r = client.post(url, {"action": "activate", "_selected_action": [night.pk]}, follow=True)
    assert ProxySettings.load().active_profile == "night"
    assert "Profile night is active: its pins apply to the next request." in [
        str(m) for m in r.context["messages"]]
    client.post(url, {"action": "deactivate", "_selected_action": [day.pk]})
    assert ProxySettings.load().active_profile == ""
