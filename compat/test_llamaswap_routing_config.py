"""The routing sections' rules asked of llama-swap itself: every config that
tests/test_routing_config.py's `REFUSALS` says gpuproxy refuses, llama-swap's binary refuses
too, in words our message holds; a selector target or pin naming nothing, which gpuproxy only
warns about (docs/configuration.md, "Differences from llama-swap"), llama-swap refuses.

Our export of a routing config is one llama-swap runs (its schema takes it, its binary serves
its peers and selectors). And llama-swap's own example imported from a file: the apiKey its
peer reads from `${env.OPENROUTER_API_KEY}` is exported as that reference, never as the key,
and the export imports back to the same rows.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from scheduling.exporter import export_yaml
from scheduling.importer import import_config, import_path
from scheduling.llamaswap import parse_config
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector
from tests.conftest import free_port
from tests.helpers import until
from tests.test_routing_config import MODELS, REFUSALS, checked


def llamaswap_refusal(binary: Path, text: str, tmp_path: Path) -> str:
    """llama-swap's error for a config, which it must refuse (it exits at once)."""
    config = tmp_path / "config.yaml"
    config.write_text(text, encoding="utf-8")
    r = subprocess.run([str(binary), "-config", str(config), "-listen",
                        f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=5)
    assert r.returncode != 0, f"llama-swap accepted it: {r.stdout}{r.stderr}"
    return (r.stdout + r.stderr).replace('\\"', '"')


@pytest.mark.parametrize(("snippet", "phrase"), [(c[1], c[3]) for c in REFUSALS],
                         ids=[c[0] for c in REFUSALS])
def test_llama_swap_refuses_what_we_refuse_in_the_same_words(llamaswap_bin, tmp_path,
                                                             snippet, phrase):
    said = llamaswap_refusal(llamaswap_bin, MODELS + snippet, tmp_path)
    assert phrase in said, said


@pytest.mark.parametrize("snippet", [
    "selectors:\n  s: {strategy: pin, targets: [zz]}\n",
    "profiles:\n  night: {pins: {x: zz}}\n",
])
def test_a_name_matching_nothing_llama_swap_refuses_and_we_warn_about(llamaswap_bin, tmp_path,
                                                                     snippet):
    said = llamaswap_refusal(llamaswap_bin, MODELS + snippet, tmp_path)
    assert 'references unknown model "zz"' in said, said
    _, warnings = checked(MODELS + snippet)
    assert len(warnings) == 1 and "'zz'" in warnings[0]


def rows() -> dict[str, list[dict]]:
    return {model.__name__: [{k: v for k, v in r.items() if k != "id"}
                             for r in model.objects.values()]
            for model in (MatrixSet, Peer, Selector, Profile)}


@pytest.mark.django_db
def test_the_example_exports_its_peer_key_as_the_reference(reference, tmp_path, monkeypatch):
    env = {"HOME": "/home/ada", "API_KEY_1": "sk-env-one", "API_KEY_2": "sk-env-two",
           "OPENROUTER_API_KEY": "sk-or-secret-123"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    source = tmp_path / "config.yaml"
    source.write_text((reference / "llama-swap-config.example.yaml").read_text("utf-8"),
                      encoding="utf-8")
    import_path(source)
    assert Peer.objects.get(peer_id="openrouter").api_key == "sk-or-secret-123"
    before = rows()
    text = export_yaml()
    assert "sk-or-secret-123" not in text
    assert yaml.safe_load(text)["peers"]["openrouter"]["apiKey"] == "${env.OPENROUTER_API_KEY}"
    again = tmp_path / "again.yaml"
    again.write_text(text, encoding="utf-8")
    report = import_path(again)
    assert (report.written, report.deleted, report.changes) == (0, 0, [])
    assert rows() == before


LLAMASWAP_ROUTED = MODELS + """\
peers:
  remote: {proxy: 'http://127.0.0.1:9', apiKey: sk-remote-1, models: [m1, org/m2],
           timeouts: {responseHeader: 5}}
selectors:
  fast: {strategy: warm, targets: [bee, a], name: Fast}
  pool: {strategy: spillover, targets: [a, c, remote/m1], settings: {spillover: 2}}
profiles:
  night: {description: Nights, pins: {fast: c, off: ~}}
routing:
  router:
    use: matrix
    settings:
      matrix:
        vars: {A: a}
        evict_costs: {A: 7}
        sets: {big: "A & c", small: "b", all: "+big | b"}
"""


@pytest.mark.django_db
def test_llama_swap_runs_our_export_of_its_routing(llamaswap_bin, reference, tmp_path):
    """The export is llama-swap's shape: its schema takes it, and the binary loads it and
    lists the peers' models and the selectors in /v1/models."""
    import_config(parse_config(LLAMASWAP_ROUTED, {}))
    text = export_yaml()
    data = yaml.safe_load(text)
    schema = json.loads((reference / "llama-swap-config-schema.json").read_text())
    jsonschema.validate({k: v for k, v in data.items() if k != "apiKeyHashes"}, schema)
    config = tmp_path / "exported.yaml"
    config.write_text(text, encoding="utf-8")
    port = free_port()
    proc = subprocess.Popen([str(llamaswap_bin), "-config", str(config), "-listen",
                             f"127.0.0.1:{port}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def listed() -> set[str] | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            except httpx.HTTPError:
                assert proc.poll() is None, "llama-swap exited: it refused the export"
                return None
            return {m["id"] for m in r.json()["data"]}

        ids = until("llama-swap serves the export", listed)
        assert {"a", "b", "c", "fast", "pool", "remote/m1", "remote/org/m2"} <= ids
    finally:
        proc.terminate()
        proc.wait(timeout=10)
