"""Issue 19's routing side by side with the real llama-swap: its matrix, peers and selectors on
one config, the same requests sent to both, and what each did compared.

The config is derived from llama-swap's example (`llama-swap-config.example.yaml`): its matrix
as written (`use: matrix`, the vars, evict_costs and the four sets), the models it names
defined as fake upstreams (plus `loner`, in no set), two peers that are recording servers in
this test (`recorder`, with an apiKey, and `other`, sharing one model name with it), and the
example's three selector strategies on those models. Each fake gets a fixed port per side, so
the test can open a fake's gate (`X-Fake-Gate`) to decide when a request ends.

What is compared, after each request: which models run (`GET /running`: the matrix's eviction
decisions, and the target a selector chose), what reached a peer (its path, the model in the
body, the key llama-swap injects), and `/v1/models`. llama-swap's answers are also checked
against values worked out by hand from its rules, so a test cannot pass with both proxies
wrong the same way. gpuproxy runs under fifo (llama-swap's scheduler) and under serial, whose
evictions for a sequential client are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from compat.routing_sides import (
    Recorder,
    Routed,
    fake_models,
    free_ports,
    model_list,
    ready,
    start_recorder,
)
from compat.sidebyside import shape, start_gpuproxy, start_llamaswap
from tests.conftest import _worker_counts, database_url, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db

PEER_KEY = "sk-peer-7f3a-not-for-clients"
#: The example's matrix models (its vars and the ids its sets name), and one in no set.
MODELS = ("gemma-model", "qwen-model", "mistral-model", "voxtral-model", "reranker-model",
          "llama-70B", "stable-diffusion", "loner")

CONFIG = """\
healthCheckTimeout: 30
models:
{models}
routing:
  router:
    use: matrix
    settings:
      matrix:
        vars:
          g: gemma-model
          q: qwen-model
          m: mistral-model
          v: voxtral-model
          e: reranker-model
        evict_costs:
          v: 50
          llama-70B: 30
        sets:
          standard: "(g | qwen-model | m) & v"
          with_rerank: "(g | q) & v & e"
          creative: "(g | q) & stable-diffusion"
          full: "llama-70B"
  scheduler:
    use: {scheduler}
peers:
  recorder:
    proxy: http://127.0.0.1:{recorder}
    apiKey: {key}
    models: [model_a, shared]
  other:
    proxy: http://127.0.0.1:{other}
    models: [shared, model_b]
selectors:
  coding-model:
    strategy: warm
    targets: [gemma-model, qwen-model]
    name: Coding Model
    description: Best currently loaded coding model
    metadata:
      purpose: coding
  llm-plan:
    strategy: pin
    targets: [mistral-model, recorder/model_a]
  llama:
    strategy: spillover
    targets: [gemma-model, voxtral-model]
    settings:
      spillover: 1
"""


def config(ports: dict[str, int], recorder: int, other: int, scheduler: str) -> str:
    return CONFIG.format(models=fake_models(ports), recorder=recorder, other=other, key=PEER_KEY,
                         scheduler=scheduler)


@dataclass
class Both:
    ours: Routed
    theirs: Routed
    recorder: Recorder
    other: Recorder
    scheduler: str

    @property
    def sides(self) -> tuple[Routed, Routed]:
        return (self.theirs, self.ours)


@pytest.fixture(scope="module",
                params=[*((w, "fifo") for w in _worker_counts()), (1, "serial")],
                ids=lambda p: f"workers{p[0]}-{p[1]}")
def both(request, llamaswap_bin: Path, tmp_path_factory, django_db_setup,
         django_db_blocker) -> Iterator[Both]:
    """llama-swap and `gpuproxy serve` on the derived config (gpuproxy under fifo, and once
    under serial), with the two recording peers they share."""
    workers, scheduler = request.param
    folder = tmp_path_factory.mktemp(f"routing-{workers}-{scheduler}")
    recorder, other = start_recorder("recorder"), start_recorder("other")
    with django_db_blocker.unblock():
        url = database_url()
    their_ports = free_ports(MODELS)
    theirs = start_llamaswap(llamaswap_bin, config(their_ports, recorder.port, other.port,
                                                   "fifo"),
                             folder / "llama-swap", free_port())
    try:
        our_ports = free_ports(MODELS)
        ours = start_gpuproxy(config(our_ports, recorder.port, other.port, scheduler),
                              folder / "gpuproxy", free_port(), workers, url)
    except BaseException:
        theirs.stop()
        raise
    yield Both(Routed(ours, our_ports), Routed(theirs, their_ports), recorder, other, scheduler)
    ours.stop()
    theirs.stop()
    recorder.close()
    other.close()


# ---------------------------------------------------------------------------- the matrix

#: (the model requested, what runs after it), worked out by hand from the example's matrix:
#: the cheapest set holding the target, costs `v` 50, `llama-70B` 30, the rest 1.
MATRIX_SEQUENCE = (
    ("gemma-model", ["gemma-model"]),
    ("voxtral-model", ["gemma-model", "voxtral-model"]),  # standard: g & v, nothing evicted
    ("reranker-model", ["gemma-model", "reranker-model", "voxtral-model"]),  # with_rerank
    # q: standard (q & v) leaves out g and e (cost 2); with_rerank (q & v & e) only g (1)
    ("qwen-model", ["qwen-model", "reranker-model", "voxtral-model"]),
    # only creative holds stable-diffusion: q stays, v (50) and e (1) go
    ("stable-diffusion", ["qwen-model", "stable-diffusion"]),
    ("mistral-model", ["mistral-model"]),  # standard: m & v; q and sd go
    ("voxtral-model", ["mistral-model", "voxtral-model"]),
    ("llama-70B", ["llama-70B"]),  # full: alone
    ("gemma-model", ["gemma-model"]),  # no set holds g with llama-70B: it goes (cost 30)
    ("reranker-model", ["gemma-model", "reranker-model"]),  # a subset of with_rerank
    ("loner", ["loner"]),  # in no set: runs alone
    ("qwen-model", ["qwen-model"]),
)


def test_matrix_evicts_alike(both: Both) -> None:
    """The same request sequence on the example's matrix: after each, the same models run on
    both, and what runs is what the matrix's rules say."""
    for routed in both.sides:
        routed.unload_all()
    for model, expected in MATRIX_SEQUENCE:
        after = {}
        for routed in both.sides:
            r = routed.chat(model)
            assert r.status_code == 200, (routed.side.name, model, r.text)
            after[routed.side.name] = routed.running()
        assert after["llama-swap"] == expected, (model, after)
        assert after["gpuproxy"] == after["llama-swap"], (both.scheduler, model, after)


# ---------------------------------------------------------------------------- peers


def test_peer_requests_reach_the_peer_with_its_key(both: Both) -> None:
    """`recorder/model_a` and the bare `model_a` (one peer has it) reach the recorder as
    `model_a` with its apiKey as Bearer and `x-api-key`; `other/model_b` reaches the other
    peer with no key of ours. Nothing local starts for them."""
    for routed in both.sides:
        routed.unload_all()
    for model, peer, upstream_model, key in (
            ("recorder/model_a", both.recorder, "model_a", PEER_KEY),
            ("model_a", both.recorder, "model_a", PEER_KEY),
            ("recorder/shared", both.recorder, "shared", PEER_KEY),
            ("other/model_b", both.other, "model_b", None),
            ("model_b", both.other, "model_b", None)):
        seen = {}
        for routed in both.sides:
            r = routed.chat(model, **{"X-Client-Note": "hello"})
            assert r.status_code == 200, (routed.side.name, model, r.text)
            assert r.json()["choices"][0]["message"]["content"] == f"from {peer.name}"
            got = peer.take()
            assert len(got) == 1, (routed.side.name, model, got)
            h = got[0]["headers"]
            seen[routed.side.name] = (got[0]["path"], got[0]["body"]["model"],
                                      h.get("authorization"), h.get("x-api-key"),
                                      h.get("x-client-note"))
        expected = ("/v1/chat/completions", upstream_model,
                    f"Bearer {key}" if key else None, key, "hello")
        assert seen["llama-swap"] == expected, (model, seen)
        assert seen["gpuproxy"] == seen["llama-swap"], (model, seen)
    for routed in both.sides:
        assert routed.running() == [], routed.side.name


def test_a_bare_name_two_peers_have_is_not_found_alike(both: Both) -> None:
    """`shared` is on both peers: the bare name is ambiguous, so neither proxy routes it (404),
    and no peer sees it."""
    statuses = {}
    for routed in both.sides:
        statuses[routed.side.name] = routed.chat("shared").status_code
    assert statuses == {"llama-swap": 404, "gpuproxy": 404}
    assert both.recorder.take() == [] and both.other.take() == []


#: What llama-swap lists beside the local models, read from its answer on this config by hand.
PEER_IDS = {"recorder/model_a", "recorder/shared", "other/shared", "other/model_b"}
SELECTOR_IDS = {"coding-model", "llm-plan", "llama"}


def test_models_lists_peers_and_selectors_alike(both: Both) -> None:
    """/v1/models: the same ids (local, peer models, selectors), and for peer models and
    selectors the same fields (each one's JSON shape) and the same `name`, `description`,
    `status` and `meta.llamaswap` (peer id, strategy, targets, metadata); local models are
    compared field by field by test_llamaswap_api. With gemma-model loaded, a selector is
    `loaded` when a target it could pick is (a pin: its first), a peer model never is."""
    for routed in both.sides:
        routed.unload_all()
        assert routed.chat("gemma-model").status_code == 200
    theirs, ours = model_list(both.theirs), model_list(both.ours)
    assert {i: theirs[i]["status"]["value"] for i in PEER_IDS | SELECTOR_IDS} == {
        **dict.fromkeys(PEER_IDS, "unloaded"), "coding-model": "loaded", "llama": "loaded",
        "llm-plan": "unloaded"}
    assert set(theirs) == set(MODELS) | PEER_IDS | SELECTOR_IDS, sorted(theirs)
    assert set(ours) == set(theirs), (sorted(set(ours) - set(theirs)),
                                      sorted(set(theirs) - set(ours)))
    for model_id in sorted(PEER_IDS | SELECTOR_IDS):
        a, b = ours[model_id], theirs[model_id]
        ours_shape = {p: k for p, k in shape(a).items() if not p.startswith("meta.gpuproxy")}
        assert ours_shape == shape(b), (model_id, a, b)
        for key in ("object", "name", "description", "status"):
            assert a.get(key) == b.get(key), (model_id, key, a, b)
        assert a.get("meta", {}).get("llamaswap") == b.get("meta", {}).get("llamaswap"), (
            model_id, a, b)


# ---------------------------------------------------------------------------- selectors


def test_warm_selector_picks_alike(both: Both) -> None:
    """`coding-model` (warm: gemma-model, qwen-model): nothing loaded, the first target
    cold-starts; with qwen-model ready (gemma evicted by it), qwen-model is chosen."""
    for routed in both.sides:
        routed.unload_all()
    steps = (("coding-model", ["gemma-model"]),
             ("mistral-model", ["mistral-model"]),  # standard: m & v; g goes
             ("qwen-model", ["qwen-model"]),
             ("coding-model", ["qwen-model"]))  # warm: the ready target, no swap
    for model, expected in steps:
        after = {}
        for routed in both.sides:
            r = routed.chat(model)
            assert r.status_code == 200, (routed.side.name, model, r.text)
            after[routed.side.name] = routed.running()
        assert after["llama-swap"] == expected, (model, after)
        assert after["gpuproxy"] == after["llama-swap"], (model, after)


def test_pin_selector_picks_alike(both: Both) -> None:
    """`llm-plan` (pin: mistral-model, recorder/model_a): always the first, whatever runs."""
    for routed in both.sides:
        routed.unload_all()
    after = {}
    for routed in both.sides:
        assert routed.chat("qwen-model").status_code == 200
        r = routed.chat("llm-plan")
        assert r.status_code == 200, (routed.side.name, r.text)
        after[routed.side.name] = routed.running()
    assert after == {"llama-swap": ["mistral-model"], "gpuproxy": ["mistral-model"]}
    assert both.recorder.take() == []


def test_spillover_selector_fills_then_spills_alike(both: Both) -> None:
    """`llama` (spillover 1: gemma-model, voxtral-model, which may run together): the first
    request, held open at its upstream, fills gemma-model; the second spills to
    voxtral-model, which loads beside it. Which upstream served each is read from /running
    while both are held, then the gates open."""
    for routed in both.sides:
        routed.unload_all()
    for routed in both.sides:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(routed.chat, "llama", **{"X-Fake-Gate": "spill"})
            until(f"{routed.side.name}: the first is at gemma-model",
                  lambda routed=routed: routed.running() == ["gemma-model"]
                  and ready(routed, "gemma-model"), within=30)
            second = pool.submit(routed.chat, "llama", **{"X-Fake-Gate": "spill"})
            until(f"{routed.side.name}: the second spilled to voxtral-model",
                  lambda routed=routed: routed.running() == ["gemma-model", "voxtral-model"],
                  within=30)
            for model in ("gemma-model", "voxtral-model"):
                until(f"{model} ready", lambda routed=routed, model=model: ready(routed, model),
                      within=30)
                routed.open_gate(model, "spill")
            assert first.result(timeout=30).status_code == 200
            assert second.result(timeout=30).status_code == 200
            answered = sorted(f.result().json()["model"] for f in (first, second))
            assert answered == ["gemma-model", "voxtral-model"], (routed.side.name, answered)
