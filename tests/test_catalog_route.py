"""`Catalog.route` and `Catalog.peer_model`: what a requested model name means, in
llama-swap's order (internal/server/profiles.go, then selectors, local ids and aliases, then
peers: internal/config/peer.go `ResolvePeerModel`).

The catalog is written by hand, as scheduling/catalog_db.py would build it from a config like
llama-swap's own profile test (internal/server/profiles_test.go `profileTestConfig`), and the
expected routes are llama-swap's answers for the same names (checked against the real binary
where a request can show them: `public` is served by `real` with `variant`'s parameters, a
name pinned to `~` or `""` is 404, `real` pinned to `other` is served by `other`).
"""

from __future__ import annotations

from scheduling.catalog import (
    Catalog,
    CatalogModel,
    CatalogPeer,
    CatalogProfile,
    CatalogSelector,
    Route,
)
from scheduling.spec import UpstreamSpec


def model(model_id: str) -> CatalogModel:
    return CatalogModel(model_id, UpstreamSpec(model_id, "true", "http://127.0.0.1:1"))


PROFILES = {
    "coding": CatalogProfile("coding", "Coding profile", {
        "public": "variant",       # a setParamsByID id of `real`
        "disabled": None,          # YAML `~`
        "empty": "",               # YAML ""
        "real": "other",           # a local id pinned elsewhere: the id itself is shadowed
        "alias": "realias",        # an alias
        "chooser": "any-chat",     # a selector
        "far": "remote/remote-model",  # a peer model, qualified
        "near": "remote-model",    # a peer model, bare
        "hop": "public",           # pins do not chain: `public` here is not re-pinned
    }),
    "chat": CatalogProfile("chat", "", {"public": "other"}),
}


def catalog(active: str = "", **changes) -> Catalog:
    fields = dict(
        models={m: model(m) for m in ("real", "other", "hidden")},
        aliases={"realias": "real", "variant": "real"},  # aliases and setParamsByID ids
        peers={"remote": CatalogPeer("remote", "http://peer.invalid", models=("remote-model",))},
        selectors={"any-chat": CatalogSelector("any-chat", "warm", ("real", "other"),
                                               ("real", "other"))},
        profiles=PROFILES,
        active_profile=active,
    )
    fields.update(changes)
    return Catalog(**fields)


# ---------------------------------------------------------------------------- without a profile

def test_without_a_profile_names_route_as_defined() -> None:
    c = catalog()
    assert c.route("real") == Route("model", "real", "real")
    assert c.route("realias") == Route("model", "real", "realias")
    assert c.route("variant") == Route("model", "real", "variant")
    assert c.route("any-chat") == Route("selector", "any-chat", "any-chat")
    assert c.route("remote/remote-model") == Route(
        "peer", "remote/remote-model", "remote/remote-model",
        peer_id="remote", peer_model="remote-model")
    assert c.route("public") == Route("unknown", "public", "public")
    # a profile's pins are not names of their own while it is not active
    assert c.route("disabled").kind == "unknown"


def test_an_active_profile_naming_no_profile_pins_nothing() -> None:
    """A setting left naming a deleted profile: no pins, as if none were active."""
    c = catalog("gone")
    assert c.route("public").kind == "unknown"
    assert c.route("real") == Route("model", "real", "real")


# ---------------------------------------------------------------------------- the pins

def test_a_pin_rewrites_the_name_before_aliases_and_filters() -> None:
    """`public` → `variant`, a setParamsByID id: the request is `real`'s, and `requested` is
    `variant`, the name whose parameters the filters apply (llama-swap sends `thinking`)."""
    assert catalog("coding").route("public") == Route("model", "real", "variant",
                                                      pinned_by="coding")


def test_a_pin_to_nothing_disables_the_name() -> None:
    c = catalog("coding")
    assert c.route("disabled") == Route("disabled", "disabled", "disabled", pinned_by="coding")
    assert c.route("empty") == Route("disabled", "empty", "empty", pinned_by="coding")


def test_a_pinned_local_id_is_shadowed_and_others_are_untouched() -> None:
    c = catalog("coding")
    assert c.route("real") == Route("model", "other", "other", pinned_by="coding")
    assert c.route("other") == Route("model", "other", "other")  # not pinned: no pinned_by
    assert c.route("realias") == Route("model", "real", "realias")  # the alias still works


def test_a_pin_may_target_an_alias_a_selector_or_a_peer_model() -> None:
    c = catalog("coding")
    assert c.route("alias") == Route("model", "real", "realias", pinned_by="coding")
    assert c.route("chooser") == Route("selector", "any-chat", "any-chat", pinned_by="coding")
    peer = Route("peer", "remote/remote-model", "remote/remote-model", pinned_by="coding",
                 peer_id="remote", peer_model="remote-model")
    assert c.route("far") == peer
    assert c.route("near") == Route("peer", "remote/remote-model", "remote-model",
                                    pinned_by="coding", peer_id="remote",
                                    peer_model="remote-model")


def test_pins_apply_once() -> None:
    """`hop` → `public`, itself pinned in the same profile: llama-swap rewrites the name once,
    and `public` is nothing outside the pins."""
    assert catalog("coding").route("hop") == Route("unknown", "public", "public",
                                                   pinned_by="coding")


def test_switching_the_profile_switches_the_target() -> None:
    assert catalog("coding").route("public").target == "real"
    assert catalog("chat").route("public") == Route("model", "other", "other", pinned_by="chat")
    assert catalog("").route("public").kind == "unknown"


def test_profiles_false_ignores_the_pins() -> None:
    """For the management paths (unload, logs), which llama-swap resolves without the pins."""
    assert catalog("coding").route("real", profiles=False) == Route("model", "real", "real")
    assert catalog("coding").route("disabled", profiles=False).kind == "unknown"


# ---------------------------------------------------------------------------- peers

PEERS = {
    "a": CatalogPeer("a", "http://a.invalid", models=("b", "shared", "dup", "dup")),
    "p1": CatalogPeer("p1", "http://p1.invalid", models=("a/b", "shared")),
    "solo": CatalogPeer("solo", "http://solo.invalid", models=("only", "real")),
}


def test_a_qualified_name_is_the_peer_and_the_model() -> None:
    c = catalog(peers=PEERS)
    assert c.peer_model("solo/only") == ("solo", "only")
    assert c.peer_model("p1/shared") == ("p1", "shared")


def test_a_bare_name_is_the_one_peer_that_has_it() -> None:
    c = catalog(peers=PEERS)
    assert c.peer_model("only") == ("solo", "only")
    assert c.peer_model("dup") == ("a", "dup")  # listed twice by one peer: still one peer
    assert c.peer_model("shared") is None  # two peers have it: ambiguous
    assert c.route("shared") == Route("unknown", "shared", "shared")
    assert c.peer_model("nothing") is None


def test_a_qualified_name_wins_over_a_bare_name_with_the_same_text() -> None:
    """`a/b` is peer `a`'s model `b` (qualified), not peer `p1`'s model named `a/b`."""
    assert catalog(peers=PEERS).peer_model("a/b") == ("a", "b")


def test_two_peers_with_the_same_qualified_name_are_ambiguous() -> None:
    """llama-swap's config check refuses this; resolving it must not pick one at random."""
    peers = {"x": CatalogPeer("x", "http://x.invalid", models=("y/z",)),
             "x/y": CatalogPeer("x/y", "http://xy.invalid", models=("z",))}
    assert catalog(peers=peers).peer_model("x/y/z") is None


def test_a_local_model_shadows_a_bare_peer_name() -> None:
    c = catalog(peers=PEERS)
    assert c.route("real") == Route("model", "real", "real")
    assert c.route("solo/real") == Route("peer", "solo/real", "solo/real",
                                         peer_id="solo", peer_model="real")


# ---------------------------------------------------------------------------- /upstream/<pin>/…

def pinned(pins: dict[str, str | None], rest: str) -> tuple[str, str, str] | None:
    return catalog("p", profiles={"p": CatalogProfile("p", "", pins)}).upstream_pin(rest)


def test_an_upstream_path_takes_the_longest_pin_that_leads_it() -> None:
    """llama-swap's own cases (profiles_test.go `RewriteUpstreamPath`)."""
    assert pinned({"public": "real"}, "public/v1/chat/completions") == (
        "public", "real/v1/chat/completions", "p")
    assert pinned({"author": "short", "author/public": "real"},
                  "author/public/v1/chat/completions") == (
        "author/public", "real/v1/chat/completions", "p")
    assert pinned({"disabled": ""}, "disabled/v1/chat/completions") == ("disabled", "", "p")
    assert pinned({"disabled": None}, "disabled") == ("disabled", "", "p")
    assert pinned({"public": "real"}, "real/v1/chat/completions") is None


def test_an_upstream_pin_matches_whole_segments_only() -> None:
    assert pinned({"pub": "real"}, "public/health") is None
    assert pinned({"public": "real"}, "public") == ("public", "real", "p")


def test_no_active_profile_pins_no_upstream_path() -> None:
    assert catalog().upstream_pin("public/health") is None
    assert catalog("gone").upstream_pin("public/health") is None
