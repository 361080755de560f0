"""Importing llama-swap configs into the real database, exporting them back, and the commands.

Expected values are read by eye from the YAML (llama-swap's own example for the first tests),
never produced by the code under test.
"""

from __future__ import annotations

import hashlib
import io
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.importer import export_config, export_yaml, import_config, load_file
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings

EXAMPLE = (Path(__file__).resolve().parents[2] / "shared" / "reference"
           / "llama-swap-config.example.yaml")
EXAMPLE_ENV = {"HOME": "/home/ada", "API_KEY_1": "sk-env-one", "API_KEY_2": "sk-env-two",
               "OPENROUTER_API_KEY": "sk-or-123"}

pytestmark = pytest.mark.django_db


def example_text() -> str:
    if not EXAMPLE.is_file():
        pytest.fail(f"llama-swap's example config is missing: expected it at {EXAMPLE} (the "
                    "shared/ folder must sit beside the repository checkout)")
    return EXAMPLE.read_text(encoding="utf-8")


def apply(yaml_text: str, env: dict[str, str] | None = None, **kwargs: Any):
    return import_config(parse_config(textwrap.dedent(yaml_text), env or {}), **kwargs)


def snapshot() -> dict[str, list[dict[str, Any]]]:
    """Every row of every table the importer touches, all columns (pk and timestamps too)."""
    return {
        "models": list(ModelDefinition.objects.order_by("model_id").values()),
        "groups": list(ModelGroup.objects.order_by("group_id").values()),
        "settings": list(ProxySettings.objects.values()),
        "keys": list(ApiKey.objects.order_by("name").values()),
    }


def without_identity(snap: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The snapshot minus what a fresh database numbers differently (pks, times, version)."""
    drop = {"id", "updated_at", "created_at", "version", "group_id"}
    out = {name: [{k: v for k, v in row.items() if k not in drop} for row in rows]
           for name, rows in snap.items()}
    groups = dict(ModelGroup.objects.values_list("pk", "group_id"))
    for row, full in zip(out["models"], snap["models"], strict=True):
        row["group"] = groups.get(full["group_id"])
    return out


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


SEED = """
    globalTTL: 300
    apiKeys: [sk-seed-key]
    models:
      keep:
        cmd: server --port ${PORT}
        aliases: [k]
      other:
        cmd: other-server --port ${PORT}
    groups:
      g:
        swap: false
        members: [keep, other]
    """


# --- llama-swap's example ---------------------------------------------------------------------


def test_the_llama_swap_example_imports_with_the_values_it_spells_out():
    report = import_config(parse_config(example_text(), EXAMPLE_ENV))
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


def test_load_file_reads_env_from_the_process(monkeypatch, tmp_path):
    for name, value in EXAMPLE_ENV.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "config.yaml"
    path.write_text(example_text(), encoding="utf-8")
    parsed = load_file(path)
    assert "sk-env-two" in parsed.api_keys


# --- defaults ---------------------------------------------------------------------------------


def test_missing_keys_get_the_model_defaults():
    ProxySettings.objects.create(pk=1, global_ttl=99, scheduler="fifo", health_check_timeout=30)
    apply("models: {m: {cmd: server}}")
    s = ProxySettings.load()
    blank = ProxySettings()
    for field in ("scheduler", "aging_divisor", "swap_affinity_bonus", "health_check_timeout",
                  "global_ttl", "unload_timeout", "start_port", "send_loading_state",
                  "include_aliases_in_list", "performance_monitoring", "performance_interval",
                  "preload"):
        assert getattr(s, field) == getattr(blank, field), field
    m = ModelDefinition.objects.get()
    fresh = ModelDefinition()
    for field in ("ttl", "unload_timeout", "check_endpoint", "concurrency_limit", "parallel",
                  "aliases", "env", "metadata", "enabled", "send_loading_state"):
        assert getattr(m, field) == getattr(fresh, field), field


# --- the database matches the file --------------------------------------------------------------


def test_rows_not_in_the_file_are_deleted_and_kept_rows_update_in_place():
    apply(SEED)
    keep_pk = ModelDefinition.objects.get(model_id="keep").pk
    group_pk = ModelGroup.objects.get(group_id="g").pk
    report = apply("""
        models:
          keep:
            cmd: server --port ${PORT} --ctx 8192
          new: {cmd: new-server}
        groups:
          g: {members: [new]}
        """)
    assert report.deleted == 2  # model "other" and the seed's API key
    keep = ModelDefinition.objects.get(model_id="keep")
    assert keep.pk == keep_pk
    assert keep.cmd == "server --port 5800 --ctx 8192"
    assert keep.aliases == [] and keep.group is None
    assert sorted(ModelDefinition.objects.values_list("model_id", flat=True)) == ["keep", "new"]
    assert ModelGroup.objects.get().pk == group_pk
    assert ModelDefinition.objects.get(model_id="new").group.group_id == "g"
    assert not ApiKey.objects.exists()
    assert ProxySettings.load().global_ttl == 0


def test_importing_the_same_file_twice_changes_nothing():
    import_config(parse_config(example_text(), EXAMPLE_ENV))
    before = snapshot()
    report = import_config(parse_config(example_text(), EXAMPLE_ENV))
    assert (report.written, report.deleted) == (0, 0)
    assert snapshot() == before


def test_aliases_and_key_names_may_move_between_kept_rows():
    one, two = "1" * 64, "2" * 64
    apply(f"""
        apiKeyHashes:
          - {{name: alice, sha256: "{one}"}}
          - {{name: bob, sha256: "{two}"}}
        models:
          a: {{cmd: s, aliases: [x]}}
          b: {{cmd: s, filters: {{setParamsByID: {{y: {{k: 1}}}}}}}}
        """)
    apply(f"""
        apiKeyHashes:
          - {{name: bob, sha256: "{one}"}}
          - {{name: alice, sha256: "{two}"}}
        models:
          a: {{cmd: s, filters: {{setParamsByID: {{y: {{k: 1}}}}}}}}
          b: {{cmd: s, aliases: [x]}}
        """)
    assert ModelDefinition.objects.get(model_id="a").aliases == ["y"]
    assert ModelDefinition.objects.get(model_id="b").aliases == ["x"]
    assert dict(ApiKey.objects.values_list("name", "key_hash")) == {"bob": "1" * 64,
                                                                     "alice": "2" * 64}


# --- errors change nothing ---------------------------------------------------------------------

BAD_FILES = {
    # caught by the parser
    "unresolved macro": ("models:\n  m: {cmd: 'server ${FOO}'}\n", "models.m.cmd"),
    "type error": ("models:\n  m: {cmd: s, ttl: abc}\n", "models.m.ttl"),
    "model in two groups": ("models:\n  m: {cmd: s}\ngroups:\n  a: {members: [m]}\n"
                            "  b: {members: [m]}\n", "groups.b.members[0]"),
    "bad scheduler": ("models: {}\nrouting: {scheduler: {use: lottery}}\n",
                      "routing.scheduler.use"),
    "sampling too often": ("models: {}\nperformance: {every: 500ms}\n", "performance.every"),
    # pass the parser, refused by full_clean() after earlier rows were already written
    "name too long": ("globalTTL: 7\nmodels:\n  keep: {cmd: s}\n  zz: {cmd: s, name: '"
                      + "n" * 300 + "'}\n", "models.zz.name"),
    "empty checkEndpoint": ("apiKeys: [sk-new]\nmodels:\n  zz: {cmd: s, checkEndpoint: ''}\n",
                            "models.zz.checkEndpoint"),
    "api key name too long": ("models: {}\napiKeyHashes:\n  - {name: ok, sha256: '" + "a" * 64
                              + "', prefix: '1234567890123'}\n", "apiKeyHashes[0].prefix"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_an_error_anywhere_leaves_the_database_unchanged(case):
    apply(SEED)
    before = snapshot()
    text, path = BAD_FILES[case]
    with pytest.raises(ConfigError) as info:
        apply(text)
    assert info.value.path == path, str(info.value)
    assert snapshot() == before


def test_dry_run_validates_everything_and_writes_nothing():
    apply(SEED)
    before = snapshot()
    report = apply("models:\n  fresh: {cmd: s}\n", dry_run=True)
    assert report.dry_run and report.written >= 1 and report.deleted >= 1
    assert snapshot() == before
    with pytest.raises(ConfigError):
        apply(BAD_FILES["name too long"][0], dry_run=True)


# --- export ------------------------------------------------------------------------------------


def test_export_then_import_gives_identical_rows():
    import_config(parse_config(example_text(), EXAMPLE_ENV))
    ModelDefinition.objects.filter(model_id="unlisted-model").update(parallel=3, enabled=False)
    before = snapshot()
    exported = export_yaml()
    report = import_config(parse_config(exported, {}))
    assert (report.written, report.deleted) == (0, 0), exported
    assert snapshot() == before


@pytest.mark.parametrize(("every", "exported", "seconds"), [
    ("1m30s", "90s", 90.0), ("2.5s", "2.5s", 2.5), ("1.1s", "1.1s", 1.1)])
def test_performance_every_survives_export_and_import(every, exported, seconds):
    apply(f"performance: {{disabled: true, every: {every}}}\nmodels: {{m: {{cmd: s}}}}\n")
    s = ProxySettings.load()
    assert (s.performance_monitoring, s.performance_interval) == (False, seconds)
    before = snapshot()
    text = export_yaml()
    assert yaml.safe_load(text)["performance"] == {"disabled": True, "every": exported}
    report = import_config(parse_config(text, {}))
    assert (report.written, report.deleted) == (0, 0), text
    assert snapshot() == before


def test_export_recreates_the_state_in_an_empty_database():
    import_config(parse_config(example_text(), EXAMPLE_ENV))
    before = without_identity(snapshot())
    exported = export_yaml()
    ModelDefinition.objects.all().delete()
    ModelGroup.objects.all().delete()
    ApiKey.objects.all().delete()
    ProxySettings.objects.all().delete()
    import_config(parse_config(exported, {}))
    assert without_identity(snapshot()) == before


def test_export_is_llama_swap_shaped_and_holds_no_plain_keys():
    import_config(parse_config(example_text(), EXAMPLE_ENV))
    text = export_yaml()
    data = yaml.safe_load(text)
    assert data["startPort"] == 10001
    assert data["performance"] == {"disabled": False, "every": "15s"}
    assert data["routing"]["scheduler"]["use"] == "fifo"
    assert data["routing"]["scheduler"]["settings"]["serial"] == {"agingDivisor": 60.0,
                                                                  "swapAffinityBonus": 10}
    docker = data["models"]["docker-llama"]
    assert docker["cmd"].startswith("docker run --name docker-llama --init --rm -p ${PORT}:8080")
    assert docker["proxy"] == "http://127.0.0.1:${PORT}"
    assert data["models"]["unlisted-model"] == {"cmd": "some-upstream-server", "unlisted": True}
    assert data["models"]["gpt-oss-120b"]["aliases"] == ["gpt-4o-mini"]
    assert data["groups"]["group2"]["members"] == ["docker-llama"]
    assert {k["sha256"] for k in data["apiKeyHashes"]} == {sha("sk-hunter2"), sha("sk-env-one"),
                                                           sha(EXAMPLE_ENV["API_KEY_2"]),
                                                           ApiKey.objects.get(
                                                               name__startswith="config-",
                                                               prefix__startswith="sk-gyC").key_hash}
    assert "sk-hunter2" not in text and "sk-env-one" not in text


def test_export_writes_fifo_priorities_and_preload():
    apply("""
        models:
          a: {cmd: s, aliases: [alpha]}
          b: {cmd: s}
        hooks: {on_startup: {preload: [alpha]}}
        routing:
          scheduler:
            settings:
              fifo: {priority: {b: 5}}
        """)
    data = export_config()
    assert data["hooks"] == {"on_startup": {"preload": ["a"]}}
    assert data["routing"]["scheduler"]["settings"]["fifo"] == {"priority": {"b": 5}}
    assert data["routing"]["scheduler"]["use"] == "serial"


# --- management commands -----------------------------------------------------------------------


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_import_command_prints_warnings_then_a_summary(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("logLevel: debug\nmodels:\n  a: {cmd: 's --port ${PORT}'}\n"
                    "  b: {cmd: 's --port ${PORT}'}\ngroups:\n  g: {members: [a]}\n",
                    encoding="utf-8")
    out, err = run("import_config", str(path))
    assert err.splitlines() == [
        "warning: logLevel: not supported by gpuproxy; ignored (set GPUPROXY_LOG_LEVEL "
        "instead)"]
    assert out.strip() == f"imported 2 models, 1 group, 0 api keys from {path}"
    assert ModelDefinition.objects.count() == 2


def test_import_command_dry_run_changes_nothing(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("apiKeys: [sk-a]\nmodels:\n  a: {cmd: s}\n", encoding="utf-8")
    out, _ = run("import_config", str(path), "--dry-run")
    assert out.strip() == (f"would import 1 model, 0 groups, 1 api key from {path} "
                           "(dry run: nothing changed)")
    assert not ModelDefinition.objects.exists() and not ApiKey.objects.exists()


def test_import_command_error_exits_1_and_changes_nothing(tmp_path):
    apply(SEED)
    before = snapshot()
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  llama-8B: {cmd: 'server ${FOO}'}\n", encoding="utf-8")
    with pytest.raises(CommandError) as info:
        run("import_config", str(path))
    assert info.value.returncode == 1
    assert str(info.value) == (f"{path}: models.llama-8B.cmd: unresolved macro ${{FOO}}; define "
                               "it under macros: or models.llama-8B.macros:; nothing was "
                               "changed")
    assert snapshot() == before


def test_import_command_names_a_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(CommandError) as info:
        run("import_config", str(missing))
    assert str(missing) in str(info.value)
    assert info.value.returncode == 1


def test_export_command_to_stdout_and_to_a_file(tmp_path):
    apply(SEED)
    out, _ = run("export_config")
    assert yaml.safe_load(out)["models"]["keep"]["cmd"] == "server --port ${PORT}"
    target = tmp_path / "out.yaml"
    out, err = run("export_config", "-o", str(target))
    assert out == "" and str(target) in err
    assert target.read_text(encoding="utf-8") == export_yaml()
