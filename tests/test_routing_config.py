"""The routing sections of a llama-swap config (matrix, peers, selectors, profiles) and the
trusted-peer flag of a key: parsed, checked, imported, exported, loaded into the catalog.

Expected values are read by eye from the YAML. llama-swap's own messages for the refusals in
`REFUSALS` were taken from its binary (`llama-swap -config X`); compat/
test_llamaswap_routing_config.py asks the binary again for each, so this table cannot drift
from what llama-swap says.
"""

from __future__ import annotations

import hashlib
import textwrap
from typing import Any

import pytest
import yaml
from django.core.exceptions import ValidationError

from scheduling.catalog_db import build_catalog, fingerprint
from scheduling.exporter import export_yaml
from scheduling.importer import import_config, import_path
from scheduling.llamaswap import ConfigError, ParsedConfig, parse_config
from scheduling.models import ApiKey, ModelDefinition, ProxySettings
from scheduling.routing_checks import check_candidate, check_parsed
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

MODELS = """\
models:
  a: {cmd: "s --port ${PORT}"}
  b: {cmd: "s --port ${PORT}", aliases: [bee]}
  c: {cmd: "s --port ${PORT}"}
"""
PEER = "peers:\n  p: {proxy: 'http://127.0.0.1:9', models: [x]}\n"
MATRIX = "routing:\n  router:\n    use: matrix\n    settings:\n      matrix: {sets: {%s}}\n"


def parse(text: str, env: dict[str, str] | None = None) -> ParsedConfig:
    return parse_config(textwrap.dedent(text), env or {})


def checked(text: str) -> tuple[ParsedConfig, list[str]]:
    """What an import checks before writing anything: the parse, then the routing rules."""
    parsed = parse(text)
    return parsed, check_parsed(parsed)


def refusal(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        checked(text)
    return info.value


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# (name, the config after MODELS, the key path we name, a phrase of llama-swap's message that
# ours holds too). compat/test_llamaswap_routing_config.py runs llama-swap on each.
REFUSALS: list[tuple[str, str, str, str]] = [
    ("unknown strategy", "selectors:\n  s: {strategy: fast, targets: [a]}\n",
     "selectors.s.strategy", "unknown strategy"),
    ("no strategy", "selectors:\n  s: {targets: [a]}\n", "selectors.s.strategy", "is required"),
    ("no targets", "selectors:\n  s: {strategy: pin, targets: []}\n", "selectors.s.targets",
     "must contain at least one entry"),
    ("chaining", "selectors:\n  s: {strategy: pin, targets: [t]}\n"
                 "  t: {strategy: pin, targets: [a]}\n",
     "selectors.s.targets[0]", "selector chaining is not supported"),
    ("selector is a model id", "selectors:\n  a: {strategy: pin, targets: [b]}\n",
     "selectors.a", "name conflicts with model ID"),
    ("selector is an alias", "selectors:\n  bee: {strategy: pin, targets: [a]}\n",
     "selectors.bee", "name conflicts with model alias"),
    ("warm to a peer", PEER + "selectors:\n  s: {strategy: warm, targets: [a, p/x]}\n",
     "selectors.s.targets[1]", "must resolve to a local model for strategy"),
    ("spillover 0", "selectors:\n  s: {strategy: spillover, targets: [a], "
                    "settings: {spillover: 0}}\n",
     "selectors.s.settings.spillover", "must be >= 1"),
    ("duplicate resolved", "groups:\n  g: {swap: false, members: [a, b]}\n"
                           "selectors:\n  s: {strategy: spillover, targets: [b, bee]}\n",
     "selectors.s.targets", "contains duplicate resolved model"),
    ("spillover in a swap group", "groups:\n  g: {swap: true, members: [a, b]}\n"
                                  "selectors:\n  s: {strategy: spillover, targets: [a, b]}\n",
     "selectors.s.targets", "must share a group with swap: false"),
    ("spillover in no group", "selectors:\n  s: {strategy: spillover, targets: [a, b]}\n",
     "selectors.s.targets", "must share a group with swap: false"),
    ("spillover across groups", "groups:\n  g: {swap: false, members: [a]}\n"
                                "  h: {swap: false, members: [b]}\n"
                                "selectors:\n  s: {strategy: spillover, targets: [a, b]}\n",
     "selectors.s.targets", "must share one routing group"),
    ("spillover outside the matrix", MATRIX % "s1: 'a | b'"
     + "selectors:\n  s: {strategy: spillover, targets: [a, b]}\n",
     "selectors.s.targets", "must all appear together in one expanded matrix set"),
    ("matrix without sets", MATRIX % "", "routing.router.settings.matrix.sets",
     "matrix must define at least one set"),
    ("matrix names no model", MATRIX % "s1: 'a & zz'", "routing.router.settings.matrix",
     "unknown var or model"),
    ("matrix var key", MATRIX.replace("{sets:", "{vars: {'x_y': a}, sets:") % "s1: a",
     "routing.router.settings.matrix.vars.x_y", "must contain only alphanumeric"),
    ("matrix var to no model", MATRIX.replace("{sets:", "{vars: {x: zz}, sets:") % "s1: a",
     "routing.router.settings.matrix", "references unknown model"),
    ("evict cost 0", MATRIX.replace("{sets:", "{evict_costs: {a: 0}, sets:") % "s1: a",
     "routing.router.settings.matrix.evict_costs.a", "must be a positive integer"),
    ("use matrix without one", "routing:\n  router:\n    use: matrix\n", "routing.router.use",
     "routing.router.settings.matrix is not set"),
    ("top-level groups and matrix", "matrix: {sets: {s1: a}}\ngroups:\n  g: {members: [a]}\n",
     "matrix", "config cannot use both 'groups' and 'matrix'"),
    ("a cycle of sets", MATRIX % "s1: '+s2', s2: '+s1'", "routing.router.settings.matrix",
     "circular reference detected"),
    ("a parenthesis", MATRIX % "s1: 'a & (b'", "routing.router.settings.matrix",
     "missing closing parenthesis"),
    ("unknown router", "routing:\n  router: {use: fancy}\n", "routing.router.use",
     "unknown router"),
    ("peer without proxy", "peers:\n  p: {models: [x]}\n", "peers.p.proxy", "proxy is required"),
    ("peer without models", "peers:\n  p: {proxy: 'http://127.0.0.1:9'}\n", "peers.p.models",
     "peer models can not be empty"),
    ("model id is a peer's name", '  p/x: {cmd: "s --port ${PORT}"}\n' + PEER, "models.p/x",
     "conflicts with fully qualified peer model name"),
    ("selector is a peer's name", PEER + "selectors:\n  p/x: {strategy: pin, targets: [a]}\n",
     "selectors.p/x", "conflicts with fully qualified peer model name"),
    ("ambiguous peer names", "peers:\n  p: {proxy: 'http://127.0.0.1:9', models: [q/x]}\n"
                             "  p/q: {proxy: 'http://127.0.0.1:9', models: [x]}\n",
     "peers.p/q.models", "is ambiguous between peers.p model"),
    ("pin takes a peer's name", PEER + "profiles:\n  night: {pins: {p/x: a}}\n",
     "profiles.night.pins.p/x", "conflicts with fully qualified peer model name"),
    ("profile without pins", "profiles:\n  night: {description: x}\n", "profiles.night.pins",
     "must contain at least one entry"),
    ("profile as a list", "profiles:\n  night: [a, b]\n", "profiles.night",
     "the legacy list syntax is no longer supported"),
]


@pytest.mark.parametrize(("snippet", "path", "phrase"), [c[1:] for c in REFUSALS],
                         ids=[c[0] for c in REFUSALS])
def test_what_llama_swap_refuses_is_refused_naming_the_key(snippet, path, phrase):
    error = refusal(MODELS + snippet)
    assert error.path == path, str(error)
    assert phrase in str(error)


def test_a_user_or_password_in_a_peer_url_is_refused_beyond_llama_swap():
    """llama-swap takes it (Go sends it as Basic unless the apiKey's header wins); here it
    would show in the admin and the logs wherever the URL does: the key goes in apiKey."""
    error = refusal(MODELS + "peers:\n  p: {proxy: 'https://u:hunter2@h.example', "
                             "models: [x]}\n")
    assert error.path == "peers.p.proxy" and "apiKey" in str(error)
    assert "hunter2" not in str(error)


def test_a_target_or_pin_naming_nothing_is_a_warning_and_kept():
    """llama-swap refuses these (`references unknown model`); gpuproxy warns, as it does for
    group members and priorities naming no model, so its own example imports."""
    parsed, warnings = checked(MODELS + "selectors:\n  s: {strategy: pin, targets: [zz, a]}\n"
                               "profiles:\n  night: {pins: {x: zz, y: s}}\n")
    assert parsed.selectors[0].targets == ("zz", "a")
    assert parsed.profiles[0].pins == {"x": "zz", "y": "s"}
    assert [w.split(": ", 1)[0] for w in warnings] == ["selectors.s.targets[0]",
                                                      "profiles.night.pins.x"]
    assert "'zz'" in warnings[0] and "404" in warnings[1]


def test_each_section_reads_as_written_with_llama_swaps_defaults():
    parsed, warnings = checked(MODELS + """\
peers:
  remote:
    proxy: https://example.org/api
    apiKey: sk-remote-1
    models: [m1, org/m2]
    filters: {stripParams: "top_k, model", setParams: {top_p: 0.5, model: nope}}
    timeouts: {connect: 5, responseHeader: 0}
    priorityForward: vllm
  plain: {proxy: 'http://10.0.0.2:8080', models: [m3]}
selectors:
  fast: {strategy: warm, targets: [a, bee], name: Fast, metadata: {tier: 1}}
  pool:
    strategy: spillover
    targets: [a, b, remote/m1]
    settings: {spillover: 3}
    unlisted: true
profiles:
  night:
    description: Nights
    pins: {fast: c, gone: ~, empty: "", pool: fast}
groups:
  together: {swap: false, members: [a, b]}
""")
    remote, plain = parsed.peers
    assert (remote.peer_id, remote.proxy, remote.models, remote.api_key) == (
        "remote", "https://example.org/api", ("m1", "org/m2"), "sk-remote-1")
    assert (remote.strip_params, remote.set_params) == ("top_k, model", {"top_p": 0.5})
    assert (remote.timeouts, remote.priority_forward) == ({"connect": 5, "responseHeader": 0},
                                                          "vllm")
    assert (plain.api_key, plain.timeouts, plain.priority_forward) == ("", {}, "header")
    fast, pool = parsed.selectors
    assert (fast.strategy, fast.targets, fast.spillover, fast.name, fast.metadata) == (
        "warm", ("a", "bee"), 1, "Fast", {"tier": 1})
    assert (pool.spillover, pool.unlisted) == (3, True)
    assert parsed.profiles[0].pins == {"fast": "c", "gone": None, "empty": None, "pool": "fast"}
    assert parsed.profiles[0].description == "Nights"
    # `model` in a peer's setParams is protected: dropped, with a warning
    assert [w.split(": ", 1)[0] for w in parsed.warnings] == [
        "peers.remote.filters.setParams.model"]
    assert warnings == []


def test_matrix_sets_keep_their_order_and_the_legacy_key_means_use_matrix():
    parsed = parse(MODELS + MATRIX.replace("{sets:", "{vars: {A: a}, evict_costs: {A: 5}, sets:")
                   % "zeta: 'A & b', alpha: 'c', mid: '+zeta | c'")
    s = parsed.settings
    assert (s.router, s.matrix_vars, s.matrix_evict_costs) == ("matrix", {"A": "a"}, {"A": 5})
    assert parsed.matrix_sets == (("zeta", "A & b"), ("alpha", "c"), ("mid", "+zeta | c"))
    legacy = parse(MODELS + "matrix:\n  sets: {one: 'a & b'}\n")
    assert (legacy.settings.router, legacy.matrix_sets) == ("matrix", (("one", "a & b"),))


def test_under_the_group_router_a_matrix_is_kept_unchecked():
    """llama-swap's example: `use: group` and a matrix naming models it does not define."""
    parsed, warnings = checked(MODELS + "routing:\n  router:\n    use: group\n    settings:\n"
                               "      matrix: {vars: {'x_y': zz}, sets: {s: 'ghost & zz'}}\n")
    assert parsed.settings.router == "group"
    assert parsed.settings.matrix_vars == {"x_y": "zz"}
    assert parsed.matrix_sets == (("s", "ghost & zz"),)
    assert warnings == []


@pytest.mark.parametrize(("snippet", "path"), [
    ("peers:\n  p: {proxy: 'ftp://h', models: [x]}\n", "peers.p.proxy"),
    ("peers:\n  p: {proxy: 'http://', models: [x]}\n", "peers.p.proxy"),
    ("peers:\n  p: {proxy: 'http://h', models: [x], timeouts: {connect: -1}}\n",
     "peers.p.timeouts.connect"),
    ("peers:\n  p: {proxy: 'http://h', models: [x], timeouts: {connect: 1s}}\n",
     "peers.p.timeouts.connect"),
    ("peers:\n  p: {proxy: 'http://h', models: [x], priorityForward: loud}\n",
     "peers.p.priorityForward"),
    ("peers:\n  p: {proxy: 'http://h', models: [x, ' ']}\n", "peers.p.models[1]"),
    ("selectors:\n  s: {strategy: pin, targets: a}\n", "selectors.s.targets"),
    ("selectors:\n  s: {strategy: pin, targets: [a], settings: {spillover: two}}\n",
     "selectors.s.settings.spillover"),
    ("profiles:\n  night: {pins: {x: [a]}}\n", "profiles.night.pins.x"),
    ("routing:\n  router:\n    settings:\n      matrix: {sets: [a]}\n",
     "routing.router.settings.matrix.sets"),
])
def test_a_bad_value_names_its_key(snippet, path):
    assert refusal(MODELS + snippet).path == path


def test_a_peer_key_never_shows_in_a_message():
    error = refusal(MODELS + "peers:\n  p: {proxy: 'http://h', apiKey: 'sk-se cret', "
                             "models: [x]}\n")
    assert error.path == "peers.p.apiKey" and "sk-se" not in str(error)


# ---- the database ---------------------------------------------------------------------------

ROUTED = MODELS + """\
apiKeyHashes:
  - {name: upstream-proxy, sha256: "PEER_SHA", peer: true}
  - {name: ops, sha256: "OPS_SHA", admin: true}
peers:
  remote:
    proxy: https://example.org/api
    apiKey: sk-remote-1
    models: [m1, org/m2]
    filters: {stripParams: "top_k, model , top_k", setParams: {top_p: 0.5}}
    timeouts: {responseHeader: 0}
selectors:
  fast: {strategy: warm, targets: [zz, bee, a], description: Quick}
  pool: {strategy: spillover, targets: [a, c, m1], settings: {spillover: 2}}
  ghost: {strategy: pin, targets: [zz]}
profiles:
  night: {description: Nights, pins: {fast: c, off: ~}}
  day: {pins: {fast: a}}
routing:
  router:
    use: matrix
    settings:
      matrix:
        vars: {A: a}
        evict_costs: {A: 7}
        sets: {big: "A & c", small: "b", all: "+big | b"}
""".replace("PEER_SHA", sha("sk-peer")).replace("OPS_SHA", sha("sk-ops"))


def apply(text: str, **kwargs: Any):
    return import_config(parse_config(text, {}), **kwargs)


def tables() -> dict[str, list[dict[str, Any]]]:
    drop = {"id", "updated_at", "created_at", "version", "group_id"}

    def rows(model: Any, order: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in drop}
                for r in model.objects.order_by(order).values()]

    return {"models": rows(ModelDefinition, "model_id"), "keys": rows(ApiKey, "name"),
            "settings": rows(ProxySettings, "pk"), "sets": rows(MatrixSet, "position"),
            "peers": rows(Peer, "peer_id"), "selectors": rows(Selector, "selector_id"),
            "profiles": rows(Profile, "name")}


@pytest.mark.django_db
def test_import_writes_the_routing_tables_and_the_catalog_carries_them():
    report = apply(ROUTED)
    assert [w.split(": ", 1)[0] for w in report.warnings] == [
        "selectors.fast.targets[0]", "selectors.ghost.targets[0]"]
    assert list(MatrixSet.objects.values_list("name", "dsl", "position")) == [
        ("big", "A & c", 0), ("small", "b", 1), ("all", "+big | b", 2)]
    assert ApiKey.objects.get(name="upstream-proxy").trusted_peer is True
    assert ApiKey.objects.get(name="ops").trusted_peer is False
    s = ProxySettings.load()
    assert (s.router, s.matrix_vars, s.matrix_evict_costs) == ("matrix", {"A": "a"}, {"A": 7})

    c = build_catalog()
    assert (c.router, c.matrix_vars, c.matrix_evict_costs) == ("matrix", {"A": "a"}, {"A": 7})
    assert c.matrix_sets == (("big", "A & c"), ("small", "b"), ("all", "+big | b"))
    # with a running, c loads beside it (set `big`); b evicts a (cost 7)
    assert c.swapper().eviction_for("c", ["a"]) == []
    assert c.swapper().eviction_for("b", ["a"]) == ["a"]
    remote = c.peers["remote"]
    assert (remote.proxy, remote.api_key, remote.models) == (
        "https://example.org/api", "sk-remote-1", ("m1", "org/m2"))
    assert remote.strip_params == ("top_k",)  # llama-swap's: trimmed, once, never `model`
    assert remote.set_params == {"top_p": 0.5}
    assert remote.timeouts == {"connect": 30, "keepalive": 30, "responseHeader": 0,
                               "tlsHandshake": 10, "expectContinue": 1, "idleConn": 90}
    assert remote.priority_forward == "header"
    # resolved: aliases to model ids, a bare peer model to <peer>/<model>, nothing for zz;
    # a selector left with no target is not offered
    assert c.selectors["fast"].resolved == ("b", "a")
    assert c.selectors["fast"].targets == ("zz", "bee", "a")
    assert c.selectors["fast"].description == "Quick"
    assert (c.selectors["pool"].resolved, c.selectors["pool"].spillover) == (
        ("a", "c", "remote/m1"), 2)
    assert "ghost" not in c.selectors
    assert c.profiles["night"].pins == {"fast": "c", "off": None}
    assert c.profiles["night"].description == "Nights"
    assert c.active_profile == ""
    assert c.trusted_peer_keys == frozenset({sha("sk-peer")})
    assert c.route("fast").kind == "selector"


@pytest.mark.django_db
def test_the_summary_counts_the_routing_rows_the_file_has():
    first = apply(ROUTED).summary("x.yaml").splitlines()[0]
    assert first == ("imported 3 models, 0 groups, 2 api keys, 3 matrix sets, 1 peer, "
                     "3 selectors, 2 profiles from x.yaml")
    first = apply(MODELS).summary("x.yaml").splitlines()[0]
    assert first == "imported 3 models, 0 groups, 0 api keys from x.yaml"


@pytest.mark.django_db
def test_import_export_import_changes_nothing_for_a_matrix_config():
    apply(ROUTED)
    before = tables()
    text = export_yaml()
    data = yaml.safe_load(text)
    assert data["routing"]["router"] == {"use": "matrix", "settings": {"matrix": {
        "vars": {"A": "a"}, "evict_costs": {"A": 7},
        "sets": {"big": "A & c", "small": "b", "all": "+big | b"}}}}
    assert list(data["routing"]["router"]["settings"]["matrix"]["sets"]) == ["big", "small",
                                                                            "all"]
    assert data["selectors"]["pool"] == {"strategy": "spillover", "targets": ["a", "c", "m1"],
                                         "settings": {"spillover": 2}}
    assert data["profiles"]["night"] == {"description": "Nights",
                                         "pins": {"fast": "c", "off": None}}
    assert data["peers"]["remote"]["timeouts"] == {"responseHeader": 0}
    assert {k["name"]: k.get("peer") for k in data["apiKeyHashes"]} == {
        "upstream-proxy": True, "ops": None}
    report = apply(text)
    assert (report.written, report.deleted, report.changes) == (0, 0, [])
    assert tables() == before


@pytest.mark.django_db
def test_a_dry_run_names_a_changed_peer_key_without_its_value():
    apply(ROUTED)
    report = apply(ROUTED.replace("sk-remote-1", "sk-remote-2"), dry_run=True)
    assert report.changes == ["peer 'remote': apiKey changed"]
    assert Peer.objects.get().api_key == "sk-remote-1"


@pytest.mark.django_db
def test_the_active_profile_survives_an_import_while_it_exists():
    apply(ROUTED)
    ProxySettings.objects.filter(pk=1).update(active_profile="night")
    apply(ROUTED.replace("description: Nights", "description: Late"))
    assert ProxySettings.load().active_profile == "night"
    report = apply(ROUTED.replace("  night: {description: Nights, pins: {fast: c, off: ~}}\n",
                                  ""))
    assert ProxySettings.load().active_profile == ""
    assert report.changes[-1] == ("settings: active profile 'night' cleared (the file no "
                                  "longer defines it)")
    assert "profile 'night' removed" in report.changes


@pytest.mark.django_db
def test_sections_left_out_of_the_file_are_deleted_and_sets_reordered():
    apply(ROUTED)
    apply(MODELS + "matrix:\n  sets: {small: b, big: 'a & c'}\n")
    assert list(MatrixSet.objects.values_list("name", "position")) == [("small", 0),
                                                                       ("big", 1)]
    assert not Peer.objects.exists() and not Selector.objects.exists()
    assert not Profile.objects.exists()
    assert ProxySettings.load().router == "matrix"


@pytest.mark.django_db
def test_a_refused_import_changes_nothing():
    apply(ROUTED)
    before = tables()
    with pytest.raises(ConfigError) as info:
        apply(ROUTED.replace("pool: {strategy: spillover, targets: [a, c, m1]",
                             "pool: {strategy: spillover, targets: [a, b, m1]"))
    assert info.value.path == "selectors.pool.targets"
    assert "one expanded matrix set" in str(info.value)
    assert tables() == before


@pytest.mark.django_db
def test_a_plain_key_exported_as_a_reference_keeps_its_peer_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("PEER_KEY", "sk-peer")
    source = tmp_path / "config.yaml"
    source.write_text(MODELS + "apiKeys: ['${env.PEER_KEY}']\napiKeyHashes:\n"
                      f"  - {{name: config-{sha('sk-peer')[:8]}, sha256: '{sha('sk-peer')}', "
                      "peer: true}\n", encoding="utf-8")
    import_path(source)
    assert ApiKey.objects.get().trusted_peer is True
    data = yaml.safe_load(export_yaml())
    assert data["apiKeys"] == ["${env.PEER_KEY}"]
    assert data["apiKeyHashes"] == [{"name": f"config-{sha('sk-peer')[:8]}",
                                     "sha256": sha("sk-peer"), "peer": True}]


@pytest.mark.django_db
@pytest.mark.parametrize("edit", ["set", "peer", "selector", "profile", "key"])
def test_an_admin_save_changes_the_fingerprint(edit):
    apply(ROUTED)
    before = fingerprint()
    if edit == "set":
        row: Any = MatrixSet.objects.get(name="small")
        row.dsl = "b | c"
    elif edit == "peer":
        row = Peer.objects.get()
        row.timeouts = {"connect": 3}
    elif edit == "selector":
        row = Selector.objects.get(selector_id="fast")
        row.strategy = "pin"
    elif edit == "profile":
        row = Profile.objects.get(name="day")
        row.pins = {"fast": "b"}
    else:
        row = ApiKey.objects.get(name="ops")
        row.trusted_peer = True
    row.save()
    assert fingerprint() != before


@pytest.mark.django_db
def test_the_admins_check_sees_the_edited_row_among_the_others():
    apply(ROUTED)
    chained = Selector(selector_id="fast", strategy="pin", targets=["pool"])
    with pytest.raises(ConfigError, match="selector chaining"):
        check_candidate(chained)
    with pytest.raises(ConfigError, match="unknown var or model 'zz'"):
        check_candidate(MatrixSet(name="small", dsl="b & zz"))
    # a good edit: only the warnings the database already had (zz names nothing)
    assert [w.split(": ", 1)[0] for w in check_candidate(MatrixSet(name="small",
                                                                  dsl="b & c"))] == [
        "selectors.fast.targets[0]", "selectors.ghost.targets[0]"]
    # renaming `big` away breaks `all`, which references it
    with pytest.raises(ConfigError, match="undefined set 'big'"):
        check_candidate(MatrixSet(name="huge", dsl="a"), original_key="big")
    switched = ProxySettings.load()
    switched.router = "group"  # pool's a and c are then in no swap: false group
    with pytest.raises(ConfigError, match="must share a group with swap: false"):
        check_candidate(switched)


@pytest.mark.django_db
@pytest.mark.parametrize(("row", "field"), [
    (Peer(peer_id="p", proxy="localhost:8080", models_list=["x"]), "proxy"),
    (Peer(peer_id="p", proxy="http://h", models_list=[]), "models_list"),
    (Peer(peer_id="p", proxy="http://h", models_list=["x"], set_params={"model": "y"}),
     "set_params"),
    (Peer(peer_id="p", proxy="http://h", models_list=["x"], timeouts={"dial": 3}), "timeouts"),
    (Selector(selector_id="s", strategy="best", targets=["a"]), "strategy"),
    (Selector(selector_id="s", strategy="spillover", targets=["a"], spillover=0), "spillover"),
    (Selector(selector_id="s", strategy="pin", targets=[]), "targets"),
    (Profile(name="p", pins={}), "pins"),
    (MatrixSet(name="s", dsl="a &"), "dsl"),
])
def test_a_rows_own_check_names_the_field(row, field):
    with pytest.raises(ValidationError) as info:
        row.full_clean()
    assert field in info.value.message_dict, info.value.message_dict


@pytest.mark.django_db
@pytest.mark.parametrize("make", [
    lambda: MatrixSet(name="s", dsl="a"),
    lambda: Peer(peer_id="p", proxy="http://h", models_list=["x"]),
    lambda: Selector(selector_id="s", strategy="pin", targets=["a"]),
    lambda: Profile(name="p", pins={"x": "a"}),
], ids=["set", "peer", "selector", "profile"])
def test_a_committed_save_or_delete_tells_the_running_proxy(make, monkeypatch,
                                                            django_capture_on_commit_callbacks):
    """The save signals (scheduling/signals.py) cover the routing tables as the others: an
    admin edit reaches a running proxy at once, not at its next fingerprint poll."""
    reloads: list[int] = []
    monkeypatch.setattr("scheduling.live.reload", lambda: reloads.append(1))
    with django_capture_on_commit_callbacks(execute=True):
        row = make()
        row.save()
    assert reloads == [1]
    with django_capture_on_commit_callbacks(execute=True):
        row.delete()
    assert reloads == [1, 1]


@pytest.mark.django_db
def test_a_disabled_model_in_a_set_leaves_the_matrix_in_force():
    """Disabling b (named by the sets `small` and `all`) must not make the matrix fail to
    compile and every model run alone: a and c still share the set `big`."""
    apply(ROUTED)
    ModelDefinition.objects.filter(model_id="b").update(enabled=False)
    c = build_catalog()
    assert "b" not in c.models
    assert c.swapper().eviction_for("c", ["a"]) == []
