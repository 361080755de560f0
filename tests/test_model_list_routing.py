"""`/v1/models` beyond local models: peers' models, selectors and the active profile's pins,
listed as llama-swap's `handleListModels` lists them (internal/server/api.go at the commit
the real binary was built from). Expected entries are written out by hand from its rules;
compat/test_llamaswap_routing.py compares the same with the real binary."""

from __future__ import annotations

from dataclasses import dataclass

from gpuproxy.proxy.model_list import models_list
from gpuproxy.upstream.states import State
from scheduling.catalog import (
    Catalog,
    CatalogModel,
    CatalogPeer,
    CatalogProfile,
    CatalogSelector,
)
from scheduling.spec import UpstreamSpec


@dataclass
class _Proc:
    state: State


class _Port:
    """The listing reads one thing of the running proxy: each model's process state."""

    def __init__(self, states: dict[str, State]) -> None:
        self.states = states

    def upstream(self, model: str) -> _Proc | None:
        state = self.states.get(model)
        return _Proc(state) if state is not None else None


def _model(model_id: str, aliases: tuple[str, ...] = ()) -> CatalogModel:
    return CatalogModel(model_id, UpstreamSpec(model_id, "x", "http://127.0.0.1:1"),
                        aliases=aliases)


def _catalog(**kw) -> Catalog:
    kw.setdefault("profiles", {"day": CatalogProfile("day", pins={
        "chat": "big", "off": None, "empty": "", "small": "big", "lab/qwen": "big",
        "qwen": "big", "hidden": "big", "fresh": "coder"})})
    return Catalog(
        models={"big": _model("big", ("big-alias",)), "small": _model("small")},
        aliases={"big-alias": "big"},
        peers={"lab": CatalogPeer("lab", "http://lab", models=("qwen", "shared", "qwen")),
               "cloud": CatalogPeer("cloud", "https://api", models=("shared",))},
        selectors={
            "coder": CatalogSelector("coder", "warm", targets=("big-alias", "small"),
                                     name=" Coder ", description="picks one",
                                     metadata={"tier": "fast"}),
            "plan": CatalogSelector("plan", "pin", targets=("small", "big")),
            "spill": CatalogSelector("spill", "spillover", targets=("big", "lab/qwen"),
                                     spillover=2),
            "hidden": CatalogSelector("hidden", "pin", targets=("big",), unlisted=True)},
        **kw)


def _listed(states: dict[str, State], catalog: Catalog) -> dict[str, dict]:
    return {e["id"]: e for e in models_list(_Port(states), catalog)["data"]}  # type: ignore[arg-type]


def test_peer_models_are_listed_by_their_qualified_names_once_each():
    listed = _listed({}, _catalog())
    entry = listed["lab/qwen"]
    created = entry.pop("created")
    assert isinstance(created, int)
    assert entry == {"id": "lab/qwen", "object": "model", "owned_by": "gpuproxy",
                     "name": "lab: qwen", "meta": {"llamaswap": {"type": "peer",
                                                                 "peerID": "lab"}},
                     "status": {"value": "unloaded"}}
    peer_ids = sorted(i for i, e in listed.items() if e["meta"]["llamaswap"]["type"] == "peer")
    assert peer_ids == ["cloud/shared", "lab/qwen", "lab/shared"]


def test_selectors_are_listed_with_their_strategy_and_unlisted_ones_are_not():
    listed = _listed({}, _catalog())
    coder = listed["coder"]
    assert (coder["name"], coder["description"]) == ("Coder", "picks one")
    assert coder["meta"] == {"llamaswap": {"tier": "fast", "type": "selector",
                                           "strategy": "warm",
                                           "targets": ["big-alias", "small"]}}
    assert listed["spill"]["meta"]["llamaswap"] == {
        "type": "selector", "strategy": "spillover", "targets": ["big", "lab/qwen"],
        "spillover": 2}
    assert "name" not in listed["plan"] and "description" not in listed["plan"]
    assert "hidden" not in listed


def test_a_selector_is_loaded_when_a_target_it_would_pick_runs_or_starts():
    def status(states: dict[str, State], selector: str) -> str:
        return _listed(states, _catalog())[selector]["status"]["value"]

    assert status({}, "coder") == "unloaded"
    assert status({"small": State.STARTING}, "coder") == "loaded"  # a later target counts
    assert status({"big": State.READY}, "coder") == "loaded"  # through its alias
    assert status({"big": State.STOPPING}, "coder") == "unloaded"
    assert status({"big": State.READY}, "plan") == "unloaded"  # pin: the first target only
    assert status({"small": State.READY}, "plan") == "loaded"


def test_the_active_profiles_pins_to_something_new_are_listed():
    """A pin to nothing is not listed, nor one whose name is already listed (a model, an
    alias, a peer's qualified name, a peer's bare name one peer has, a selector, listed or
    not); the rest are, as `profile` entries."""
    assert not {"chat", "fresh"} & set(_listed({}, _catalog()))  # no profile active
    listed = _listed({}, _catalog(active_profile="day"))
    pins = sorted(i for i, e in listed.items() if e["meta"]["llamaswap"]["type"] == "profile")
    assert pins == ["chat", "fresh"]
    assert {k: v for k, v in listed["chat"].items() if k != "created"} == {
        "id": "chat", "object": "model", "owned_by": "gpuproxy",
        "meta": {"llamaswap": {"type": "profile"}}, "status": {"value": "unloaded"}}


def test_a_bare_name_two_peers_share_is_not_taken_so_a_pin_may_list_it():
    catalog = _catalog(active_profile="night",
                       profiles={"night": CatalogProfile("night", pins={"shared": "big"})})
    assert _listed({}, catalog)["shared"]["meta"]["llamaswap"] == {"type": "profile"}


def test_the_listing_is_sorted_by_id():
    ids = [e["id"] for e in models_list(_Port({}), _catalog(active_profile="day"))["data"]]  # type: ignore[arg-type]
    assert ids == sorted(ids)
