"""llama-swap's example config's own `peers`, `selectors` and `profiles`, and its `group` router,
run side by side with the real llama-swap.

llama-swap refuses its example as written (test_llamaswap_binary: `unlisted-model` has no
${PORT}, and a group names the selector `llama`), so the config here is the example's sections
read from the file, changed only where they must point at this machine: every local model a
selector, profile or group names is a fake upstream; each peer's `proxy` is a recording server
of this test and openrouter's `apiKey` a literal (its `${env.…}` is the example's); group1's
member `llama` (a selector) is left out. Everything else (the peers' model lists, openrouter's
filters and timeouts, the selectors' strategies, targets and metadata, the profile, the groups'
flags) is the example's own.

Compared: what reaches each peer for each of its model names (the path, the body after the
peer's filters, the key), which local model a selector starts, and `/v1/models`' ids.
llama-swap's answers are also checked against values read from the example by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from compat.routing_sides import (
    Recorder,
    Routed,
    fake_models,
    free_ports,
    model_list,
    start_recorder,
)
from compat.sidebyside import shape, start_gpuproxy, start_llamaswap
from tests.conftest import _worker_counts, database_url, free_port

pytestmark = pytest.mark.django_db

#: The local models the example's selectors, profile and groups name.
LOCAL = ("gpt-oss-120b", "qwen-unlisted", "docker-llama", "modelA", "modelB", "forever-modelA",
         "forever-modelB", "forever-modelc")
OPENROUTER_KEY = "sk-or-compat-8c1d"


def example_config(reference: Path, ports: dict[str, int], peers: dict[str, Recorder]) -> str:
    example = yaml.safe_load((reference / "llama-swap-config.example.yaml").read_text())
    routing = copy.deepcopy(example["routing"])
    routing["router"]["settings"].pop("matrix")  # `use: group`; the matrix is compared apart
    groups = routing["router"]["settings"]["groups"]
    groups["group1"]["members"] = [m for m in groups["group1"]["members"] if m in LOCAL]
    routing["scheduler"] = {"use": "fifo"}  # its priorities name models A-D it does not define
    sections = {"routing": routing, "peers": copy.deepcopy(example["peers"]),
                "selectors": example["selectors"], "profiles": example["profiles"]}
    for peer_id, peer in sections["peers"].items():
        peer["proxy"] = f"http://127.0.0.1:{peers[peer_id].port}"
        if "apiKey" in peer:
            peer["apiKey"] = OPENROUTER_KEY
    return ("healthCheckTimeout: 30\nmodels:\n" + fake_models(ports) + "\n"
            + yaml.safe_dump(sections, sort_keys=False))


@dataclass
class Both:
    ours: Routed
    theirs: Routed
    peers: dict[str, Recorder]

    @property
    def sides(self) -> tuple[Routed, Routed]:
        return (self.theirs, self.ours)


@pytest.fixture(scope="module", params=_worker_counts(), ids=lambda n: f"workers{n}")
def both(request, reference: Path, llamaswap_bin: Path, tmp_path_factory, django_db_setup,
         django_db_blocker) -> Iterator[Both]:
    folder = tmp_path_factory.mktemp(f"example-routing-{request.param}")
    peers = {"llama-swap-peer": start_recorder("llama-swap-peer"),
             "openrouter": start_recorder("openrouter")}
    with django_db_blocker.unblock():
        url = database_url()
    their_ports = free_ports(LOCAL)
    theirs = start_llamaswap(llamaswap_bin, example_config(reference, their_ports, peers),
                             folder / "llama-swap", free_port())
    try:
        our_ports = free_ports(LOCAL)
        ours = start_gpuproxy(example_config(reference, our_ports, peers), folder / "gpuproxy",
                              free_port(), request.param, url)
    except BaseException:
        theirs.stop()
        raise
    yield Both(Routed(ours, our_ports), Routed(theirs, their_ports), peers)
    ours.stop()
    theirs.stop()
    for peer in peers.values():
        peer.close()


#: (name asked for, the peer it reaches, the model name the peer sees), from the example's
#: `peers`: a qualified name, or a bare one that only one peer lists.
PEER_ROUTES = (
    ("llama-swap-peer/model_a", "llama-swap-peer", "model_a"),
    ("model_b", "llama-swap-peer", "model_b"),
    ("llama-swap-peer/embeddings/model_c", "llama-swap-peer", "embeddings/model_c"),
    ("embeddings/model_c", "llama-swap-peer", "embeddings/model_c"),
    ("openrouter/z-ai/glm-4.7", "openrouter", "z-ai/glm-4.7"),
    ("deepseek/deepseek-v3.2", "openrouter", "deepseek/deepseek-v3.2"),
)


def test_the_examples_peers_are_reached_alike(both: Both) -> None:
    """Each of the example's peer model names reaches its peer under the peer's own name; for
    openrouter with its key and its filters applied (`temperature` and `top_p` stripped,
    `provider` set); llama-swap-peer, which has no apiKey, gets the body as sent."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.3,
            "top_p": 0.5, "max_tokens": 2}
    for name, peer_id, upstream in PEER_ROUTES:
        seen = {}
        for routed in both.sides:
            r = routed.side.http.post("/v1/chat/completions", json={**body, "model": name})
            assert r.status_code == 200, (routed.side.name, name, r.text)
            got = both.peers[peer_id].take()
            assert len(got) == 1, (routed.side.name, name, got)
            h = got[0]["headers"]
            seen[routed.side.name] = (got[0]["path"], got[0]["body"], h.get("authorization"),
                                      h.get("x-api-key"))
        if peer_id == "openrouter":
            expected_body: dict[str, Any] = {
                "messages": body["messages"], "max_tokens": 2, "model": upstream,
                "provider": {"data_collection": "deny", "zdr": True}}
            key: str | None = OPENROUTER_KEY
        else:
            expected_body, key = {**body, "model": upstream}, None
        assert seen["llama-swap"] == ("/v1/chat/completions", expected_body,
                                      f"Bearer {key}" if key else None, key), (name, seen)
        assert seen["gpuproxy"] == seen["llama-swap"], (name, seen)
    for routed in both.sides:
        assert routed.running() == [], routed.side.name


def test_the_examples_selectors_start_the_same_models(both: Both) -> None:
    """`llm-plan` (pin: gpt-oss-120b first) starts gpt-oss-120b; `coding-model` (warm) then
    picks the loaded gpt-oss-120b; with qwen-unlisted loaded instead (group1 swaps it in,
    and the default group's gpt-oss-120b goes) it picks qwen-unlisted; `llama` (spillover 4,
    group2: swap false, exclusive false) starts docker-llama, its first target, beside
    qwen-unlisted (group2 evicts no other group), and stays there while it is under 4
    requests."""
    for routed in both.sides:
        routed.unload_all()
    steps = (("llm-plan", ["gpt-oss-120b"]), ("coding-model", ["gpt-oss-120b"]),
             ("qwen-unlisted", ["qwen-unlisted"]), ("coding-model", ["qwen-unlisted"]),
             ("llama", ["docker-llama", "qwen-unlisted"]),
             ("llama", ["docker-llama", "qwen-unlisted"]))
    for model, expected in steps:
        after = {}
        for routed in both.sides:
            r = routed.chat(model)
            assert r.status_code == 200, (routed.side.name, model, r.text)
            after[routed.side.name] = (r.json()["model"], routed.running())
        assert after["llama-swap"][1] == expected, (model, after)
        assert after["gpuproxy"] == after["llama-swap"], (model, after)


def test_the_examples_models_list_alike(both: Both) -> None:
    """/v1/models: the same ids (the local fakes, each peer model qualified, the three
    selectors), and each peer model's and selector's entry has the same fields."""
    theirs, ours = model_list(both.theirs), model_list(both.ours)
    peer_ids = {f"llama-swap-peer/{m}" for m in ("model_a", "model_b", "embeddings/model_c")}
    peer_ids |= {f"openrouter/{m}" for m in (
        "meta-llama/llama-3.1-8b-instruct", "qwen/qwen3-235b-a22b-2507",
        "deepseek/deepseek-v3.2", "z-ai/glm-4.7", "moonshotai/kimi-k2-0905",
        "minimax/minimax-m2.1")}
    selectors = {"coding-model", "llm-plan", "llama"}
    assert set(theirs) == set(LOCAL) | peer_ids | selectors, sorted(theirs)
    assert set(ours) == set(theirs), (sorted(set(ours) - set(theirs)),
                                      sorted(set(theirs) - set(ours)))
    for model_id in sorted(peer_ids | selectors):
        a, b = ours[model_id], theirs[model_id]
        ours_shape = {p: k for p, k in shape(a).items() if not p.startswith("meta.gpuproxy")}
        assert ours_shape == shape(b), (model_id, a, b)
        assert a.get("meta", {}).get("llamaswap") == b.get("meta", {}).get("llamaswap"), (
            model_id, a, b)
