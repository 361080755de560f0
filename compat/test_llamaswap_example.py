"""llama-swap's own example config (its repository's config.example.yaml): gpuproxy imports it,
with the values it spells out, and warns about every section it does not honour.

Expected values are read by eye from the example, never produced by the code under test.
llama-swap's binary itself refuses this file (`unlisted-model` uses the default proxy without
${PORT} in its cmd, and its groups and priorities name models it does not define); gpuproxy
imports it with warnings instead (docs/configuration.md, "Differences from llama-swap").
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from scheduling.exporter import export_document, export_yaml
from scheduling.importer import import_config, import_path
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector

EXAMPLE_ENV = {"HOME": "/home/ada", "API_KEY_1": "sk-env-one", "API_KEY_2": "sk-env-two",
               "OPENROUTER_API_KEY": "sk-or-123"}


@pytest.fixture
def example_text(reference: Path) -> str:
    return (reference / "llama-swap-config.example.yaml").read_text(encoding="utf-8")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def warned_paths(warnings: list[str]) -> set[str]:
    return {w.split(": ", 1)[0] for w in warnings}


@pytest.mark.django_db
def test_the_llama_swap_example_imports_with_the_values_it_spells_out(example_text):
    report = import_config(parse_config(example_text, EXAMPLE_ENV))
    assert (report.models, report.groups, report.api_keys) == (3, 3, 4)

    assert sorted(ModelDefinition.objects.values_list("model_id", flat=True)) == [
        "docker-llama", "gpt-oss-120b", "unlisted-model"]

    gpt = ModelDefinition.objects.get(model_id="gpt-oss-120b")
    # ${latest-llama} (a folded global macro with --port ${PORT}), then the model's own
    # default_ctx (16384, overriding the global 4096) and temp (0.7); comment lines gone.
    assert gpt.cmd == ("/path/to/llama-server/llama-server-ec9e0301 --port 10002 "
                       "--model path/to/gpt-oss-120B.gguf --ctx-size 16384 --temperature 0.7")
    # startPort 10001, sorted ids: docker-llama gets 10001, gpt-oss-120b 10002.
    assert gpt.port == 10002
    assert gpt.proxy == "http://127.0.0.1:8999"
    assert gpt.name == "gpt-oss 120B"
    assert gpt.description == "A thinking model from OpenAI"
    assert gpt.env == ["CUDA_VISIBLE_DEVICES=0,1,2"]
    assert gpt.check_endpoint == "/custom-endpoint"
    assert (gpt.ttl, gpt.unload_timeout, gpt.concurrency_limit) == (60, 10, 0)
    assert gpt.use_model_name == "openai/gpt-oss-120B"
    assert gpt.send_loading_state is False
    assert gpt.strip_params == "temperature, top_p, top_k"
    assert gpt.set_params == {"temperature": 0.7, "top_p": 0.9}
    assert gpt.set_params_by_id == {
        "gpt-oss-120b": {"chat_template_kwargs": {"reasoning_effort": "medium"}},
        "gpt-oss-120b:high": {"chat_template_kwargs": {"reasoning_effort": "high"}},
        "gpt-oss-120b:low": {"chat_template_kwargs": {"reasoning_effort": "low"}},
    }
    # The explicit alias, then every setParamsByID key except the model's own id.
    assert gpt.aliases == ["gpt-4o-mini", "gpt-oss-120b:high", "gpt-oss-120b:low"]
    assert gpt.metadata == {
        "port": 10002,
        "temperature": 0.7,
        "note": "The gpt-oss-120b is running on port 10002 temp=0.7, context=16384",
        "a_list": [1, 1.23, "macros are OK in list and dictionary types: gpt-oss-120b"],
        "an_obj": {"a": "1", "b": 2, "c": [0.7, False, "model: gpt-oss-120b"]},
    }
    assert gpt.capabilities == {"in": ["text", "audio", "image"],
                                "out": ["text", "audio", "image"],
                                "tools": True, "reranker": False, "context": 32000}
    assert gpt.group is None

    docker = ModelDefinition.objects.get(model_id="docker-llama")
    assert docker.cmd == ("docker run --name docker-llama --init --rm -p 10001:8080 "
                          "-v /mnt/nvme/models:/models ghcr.io/ggml-org/llama.cpp:server "
                          "--model '/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf'")
    assert docker.cmd_stop == "docker stop docker-llama"
    assert docker.proxy == "http://127.0.0.1:10001"
    assert docker.port == 10001
    assert docker.group.group_id == "group2"

    unlisted = ModelDefinition.objects.get(model_id="unlisted-model")
    assert unlisted.unlisted is True
    assert unlisted.cmd == "some-upstream-server"
    assert unlisted.port is None

    groups = {g.group_id: g for g in ModelGroup.objects.all()}
    assert sorted(groups) == ["forever", "group1", "group2"]
    assert (groups["group1"].swap, groups["group1"].exclusive,
            groups["group1"].persistent) == (True, True, False)
    assert (groups["group2"].swap, groups["group2"].exclusive,
            groups["group2"].persistent) == (False, False, False)
    assert (groups["forever"].swap, groups["forever"].exclusive,
            groups["forever"].persistent) == (False, False, True)
    # The example's members are illustrative; only docker-llama is a defined model.
    assert [m.model_id for m in groups["group2"].members.all()] == ["docker-llama"]
    assert not groups["group1"].members.exists() and not groups["forever"].members.exists()

    s = ProxySettings.load()
    assert (s.health_check_timeout, s.global_ttl, s.unload_timeout, s.start_port) == (
        500, 0, 10, 10001)
    assert (s.send_loading_state, s.include_aliases_in_list, s.performance_monitoring) == (
        True, False, True)
    assert s.performance_interval == 15.0  # `every: 15s`
    assert s.scheduler == "fifo"
    assert s.preload == []  # "llama" is a selector there, not a model

    keys = ["sk-hunter2",
            "sk-gyCPiKUcIfPlaM4OSMZekkprgijPx6+OsmQs8Rsg0xZ9qpy6gKWsIKqHOk+cgXVx",
            "sk-env-one", "sk-env-two"]
    assert sorted(ApiKey.objects.values_list("name", "key_hash")) == sorted(
        (f"config-{sha(k)[:8]}", sha(k)) for k in keys)
    assert ApiKey.objects.get(key_hash=sha("sk-hunter2")).prefix == "sk-"  # a third at most





def test_example_warnings_name_every_unsupported_section_in_it(example_text):
    parsed = parse_config(example_text, EXAMPLE_ENV)
    expected = {
        "logLevel", "logTimeFormat", "logToStdout", "metricsMaxInMemory", "ui",
        "upstream.ignorePaths", "models.gpt-oss-120b.timeouts", "models.gpt-oss-120b.compat",
    }
    missing = expected - warned_paths(parsed.warnings)
    assert not missing, f"no warning names {sorted(missing)}; warnings: {parsed.warnings}"


#: The sections issue 19 brought in: none may be called unsupported any more.
ROUTING_SECTIONS = ("profiles", "selectors", "peers", "routing.router.settings.matrix",
                    "matrix")


def test_example_routing_sections_import_with_no_not_supported_warning(example_text):
    parsed = parse_config(example_text, EXAMPLE_ENV)
    unsupported = [w for w in parsed.warnings if "not supported" in w
                   and w.split(": ", 1)[0].startswith(ROUTING_SECTIONS)]
    assert unsupported == []


@pytest.mark.django_db
def test_example_matrix_peers_selectors_and_profiles_import_as_written(example_text):
    """Values read by eye from the example's `routing.router.settings.matrix`, `peers`,
    `selectors` and `profiles`."""
    import_config(parse_config(example_text, EXAMPLE_ENV))
    s = ProxySettings.load()
    assert s.router == "group"  # `use: group`: the matrix is kept, not used
    assert s.matrix_vars == {"g": "gemma-model", "q": "qwen-model", "m": "mistral-model",
                             "v": "voxtral-model", "e": "reranker-model"}
    assert s.matrix_evict_costs == {"v": 50, "llama-70B": 30}
    assert s.active_profile == ""  # startup selects none
    assert list(MatrixSet.objects.values_list("name", "dsl")) == [
        ("standard", "(g | qwen-model | m) & v"), ("with_rerank", "(g | q) & v & e"),
        ("creative", "(g | q) & stable-diffusion"), ("full", "llama-70B")]

    peers = {p.peer_id: p for p in Peer.objects.all()}
    assert sorted(peers) == ["llama-swap-peer", "openrouter"]
    local = peers["llama-swap-peer"]
    assert (local.proxy, local.api_key) == ("http://192.168.1.23", "")
    assert local.models_list == ["model_a", "model_b", "embeddings/model_c"]
    router = peers["openrouter"]
    assert (router.proxy, router.api_key) == ("https://openrouter.ai/api", "sk-or-123")
    assert router.models_list == [
        "meta-llama/llama-3.1-8b-instruct", "qwen/qwen3-235b-a22b-2507",
        "deepseek/deepseek-v3.2", "z-ai/glm-4.7", "moonshotai/kimi-k2-0905",
        "minimax/minimax-m2.1"]
    assert router.strip_params == "temperature, top_p"
    assert router.set_params == {"provider": {"data_collection": "deny", "zdr": True}}
    assert router.timeouts == {"connect": 30, "keepalive": 30, "responseHeader": 60,
                               "tlsHandshake": 10, "idleConn": 90}

    selectors = {x.selector_id: x for x in Selector.objects.all()}
    assert sorted(selectors) == ["coding-model", "llama", "llm-plan"]
    coding = selectors["coding-model"]
    assert (coding.strategy, coding.targets) == ("warm", ["gpt-oss-120b", "qwen-unlisted"])
    assert (coding.name, coding.description, coding.metadata) == (
        "Coding Model", "Best currently loaded coding model", {"purpose": "coding"})
    assert (selectors["llm-plan"].strategy, selectors["llm-plan"].targets) == (
        "pin", ["gpt-oss-120b", "z-ai/glm-4.7"])
    llama = selectors["llama"]
    assert (llama.strategy, llama.targets, llama.spillover) == (
        "spillover", ["docker-llama", "modelA", "modelB"], 4)

    (coding_profile,) = Profile.objects.all()
    assert (coding_profile.name, coding_profile.description) == (
        "coding", "Coding-focused model routing")
    assert set(coding_profile.pins) == {"llm-code", "llm-plan", "image-gen"}
    assert coding_profile.pins["llm-code"] == "gpt-oss-120b"
    assert coding_profile.pins["llm-plan"] == "qwen-unlisted"
    assert coding_profile.pins["image-gen"] in (None, "")  # `~`: the id is disabled (404)


def test_example_needs_every_env_variable_it_references_outside_comments(example_text):
    env = dict(EXAMPLE_ENV)
    del env["OPENROUTER_API_KEY"]
    with pytest.raises(ConfigError) as info:
        parse_config(example_text, env)
    assert info.value.path == "peers.openrouter.apiKey"
    assert "OPENROUTER_API_KEY" in str(info.value)
    # `${env.VAR_NAME}` appears only in comments of the example: it is not required.
    assert "VAR_NAME" not in EXAMPLE_ENV



@pytest.mark.django_db
def test_example_survives_export_and_import_unchanged(example_text):
    import_config(parse_config(example_text, EXAMPLE_ENV))
    before = sorted(ModelDefinition.objects.values_list("model_id", "cmd", "proxy", "aliases"))
    report = import_config(parse_config(export_yaml(), {}))
    assert (report.written, report.deleted) == (0, 0)
    assert sorted(ModelDefinition.objects.values_list("model_id", "cmd", "proxy",
                                                      "aliases")) == before


@pytest.mark.django_db
def test_the_example_exports_with_its_env_keys_and_the_names_it_skipped(
        example_text, tmp_path, monkeypatch):
    """What the import skipped with a warning (a selector in preload, priorities and group
    members naming no model) and the keys it read from the environment are written back;
    its two literal keys, whose values are not stored, are named in warnings."""
    for name, value in EXAMPLE_ENV.items():
        monkeypatch.setenv(name, value)
    source = tmp_path / "config.yaml"
    source.write_text(example_text, encoding="utf-8")
    import_path(source)
    document = export_document()
    data = yaml.safe_load(document.text)
    assert data["apiKeys"] == ["${env.API_KEY_1}", "${env.API_KEY_2}"]
    assert "sk-hunter2" not in document.text and "sk-env-one" not in document.text
    hunter = f"config-{sha('sk-hunter2')[:8]}"
    assert [w.split(" (", 1)[0] for w in document.warnings] == sorted(
        [f"API key {hunter!r}",
         f"API key 'config-{sha(EXAMPLE_LITERAL_KEY)[:8]}'"])
    assert data["hooks"] == {"on_startup": {"preload": ["llama"]}}
    assert data["routing"]["scheduler"] == {"use": "fifo", "settings": {"fifo": {
        "priority": {"A": 10, "B": 5, "C": 5, "D": 1}}}}
    # beside the example's matrix, the groups go under routing.router (as in the example)
    groups = data["routing"]["router"]["settings"]["groups"]
    assert groups["forever"]["members"] == ["forever-modelA", "forever-modelB",
                                            "forever-modelc"]


EXAMPLE_LITERAL_KEY = "sk-gyCPiKUcIfPlaM4OSMZekkprgijPx6+OsmQs8Rsg0xZ9qpy6gKWsIKqHOk+cgXVx"
