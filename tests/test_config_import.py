"""Importing llama-swap configs into the real database, exporting them back, and the commands.

Expected values are read by eye from the YAML (our fixture, tests/data/llama-swap-config.yaml,
for the first tests), never produced by the code under test. llama-swap's own example is
checked by `make compat` (compat/).
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

from scheduling.catalog_db import build_catalog
from scheduling.exporter import export_config, export_yaml
from scheduling.importer import import_config, import_path, load_file
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ApiKey, ConfigImport, ModelDefinition, ModelGroup, ProxySettings
from tests.llamaswap_fixture import FIXTURE_ENV, fixture_text

pytestmark = pytest.mark.django_db

GRAFANA_SHA = "b5a3c3be0096e84ea7bd2ccf4d24a4b2e297e8e904350b5a886343e3184e2791"


def import_fixture():
    return import_config(parse_config(fixture_text(), FIXTURE_ENV))


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


# --- the fixture --------------------------------------------------------------------------


def test_the_fixture_imports_with_the_values_it_spells_out():
    report = import_fixture()
    assert (report.models, report.groups, report.api_keys) == (5, 2, 3)
    models = {m.model_id: m for m in ModelDefinition.objects.select_related("group")}
    assert sorted(models) == ["embed", "llama-8b", "qwen-coder", "vllm-32b", "whisper"]

    llama = models["llama-8b"]
    # ${server} (a folded macro ending in --port ${PORT}), the model line, then ${args} with
    # the global ctx; the backslash continuation and both comment lines gone. Ports go from
    # startPort 9100 in sorted id order to the models whose cmd uses ${PORT}: embed 9100,
    # llama-8b 9101, qwen-coder 9102, vllm-32b 9103 (whisper names its own port).
    assert llama.cmd == ("/opt/llama.cpp/llama-server --port 9101 --model "
                         "/srv/models/gguf/llama-3.1-8b-q4.gguf --ctx-size 8192 -ngl 99")
    assert (llama.port, llama.proxy) == (9101, "http://localhost:9101")
    assert (llama.name, llama.description) == ("Llama 3.1 8B",
                                               "General chat, 8192 tokens of context")
    assert llama.aliases == ["chat", "gpt-4o-mini"]
    assert llama.env == ["CUDA_VISIBLE_DEVICES=0"]
    assert (llama.ttl, llama.unload_timeout, llama.check_endpoint) == (300, 0, "/health")
    assert llama.strip_params == "top_k, min_p"
    assert llama.set_params == {"temperature": 0.6, "model": "not-sent"}
    assert llama.set_params_by_id == {}
    assert llama.metadata == {"port": 9101, "ctx": 8192, "note": "llama-8b on 9101, ctx 8192"}
    assert llama.capabilities == {"in": ["text", "image"], "out": ["text"], "tools": True,
                                  "context": 8192}
    assert (llama.parallel, llama.stream_idle_timeout, llama.fifo_priority) == (2, 120, 10)
    assert llama.slots.parallel == 2  # written in the file: kept, whatever cmd says
    assert (llama.send_loading_state, llama.enabled, llama.unlisted) == (None, True, False)
    assert llama.group is None

    qwen = models["qwen-coder"]
    # The model's own ctx (32768) takes the global one's place, so ${args} sees it.
    assert qwen.cmd == ("/opt/llama.cpp/llama-server --port 9102 --model "
                        "/srv/models/gguf/qwen2.5-coder-32b.gguf --ctx-size 32768 -ngl 99 -np 4")
    assert (qwen.check_endpoint, qwen.unload_timeout, qwen.use_model_name) == (
        "/v1/models", 5, "qwen2.5-coder")
    assert (qwen.concurrency_limit, qwen.send_loading_state) == (6, False)
    assert qwen.strip_params == "seed"  # the legacy spelling, alone
    assert qwen.set_params_by_id == {
        "qwen-coder": {"chat_template_kwargs": {"enable_thinking": False}},
        "qwen-coder:think": {"chat_template_kwargs": {"enable_thinking": True}},
    }
    assert qwen.aliases == ["qwen-coder:think"]  # every setParamsByID key but its own id
    # No `parallel` in the file: not set in the database, and 4 from the command's `-np 4`.
    assert (qwen.ttl, qwen.parallel, qwen.fifo_priority) == (-1, None, 5)
    assert (qwen.slots.parallel, qwen.slots.source) == (4, "`-np 4` in cmd")
    assert qwen.group.group_id == "coders"

    embed = models["embed"]
    assert embed.cmd == ("/opt/llama.cpp/llama-server --port 9100 --model "
                         "/srv/models/gguf/nomic-embed.gguf --embedding --pooling mean")
    assert (embed.unlisted, embed.ttl, embed.port) == (True, 0, 9100)
    assert embed.capabilities == {"in": ["text"], "out": ["text"], "reranker": False}
    assert embed.group.group_id == "always-on"
    # llama-server with no -np: its own default, auto, is 4 slots (llama.cpp b11549)
    assert (embed.parallel, embed.slots.parallel) == (None, 4)

    vllm = models["vllm-32b"]
    assert vllm.cmd == ("docker run --rm --name vllm-32b --gpus all -p 9103:8000 "
                        "vllm/vllm-openai:v0.11.0 --model Qwen/Qwen2.5-32B-Instruct "
                        "--max-num-seqs 8 --scheduling-policy priority")
    assert vllm.cmd_stop == "docker stop vllm-32b"
    assert (vllm.proxy, vllm.port) == ("http://127.0.0.1:9103", 9103)
    assert (vllm.vllm_priority, vllm.enabled) == (True, False)
    assert vllm.group.group_id == "coders"
    assert (vllm.parallel, vllm.slots.parallel) == (None, 8)  # --max-num-seqs 8

    whisper = models["whisper"]
    assert whisper.cmd == "/opt/whisper.cpp/whisper-server --host 127.0.0.1 --port 9300"
    assert whisper.cmd_stop == "kill -INT ${PID}"
    assert (whisper.proxy, whisper.port) == ("http://127.0.0.1:9300", None)
    assert whisper.check_endpoint == "none"
    assert whisper.env == ["HF_TOKEN=hf_abc"]
    assert whisper.group.group_id == "always-on"
    assert (whisper.parallel, whisper.slots.parallel) == (None, 1)  # not a server we know

    groups = {g.group_id: g for g in ModelGroup.objects.all()}
    assert sorted(groups) == ["always-on", "coders"]
    assert (groups["coders"].swap, groups["coders"].exclusive,
            groups["coders"].persistent) == (True, False, False)
    assert (groups["always-on"].swap, groups["always-on"].exclusive,
            groups["always-on"].persistent) == (False, False, True)

    s = ProxySettings.load()
    assert (s.health_check_timeout, s.global_ttl, s.unload_timeout, s.start_port) == (
        15, 900, 10, 9100)  # 10 raised to the minimum; unloadTimeout 0 means 10
    assert (s.send_loading_state, s.include_aliases_in_list) == (True, True)
    assert (s.performance_monitoring, s.performance_interval) == (False, 90.0)
    assert (s.scheduler, s.aging_divisor, s.swap_affinity_bonus) == ("serial", 30.0, 99)
    assert s.preload == ["llama-8b"]  # `chat`, an alias; `fast` is a selector
    assert (s.max_waiting, s.max_waiting_interactive, s.max_waiting_normal,
            s.max_waiting_batch, s.queue_timeout) == (500, 0, 0, 100, 120)

    assert sorted(ApiKey.objects.values_list("name", "key_hash", "prefix")) == sorted([
        (f"config-{sha('sk-alice-7f3a')[:8]}", sha("sk-alice-7f3a"), "sk-a"),  # a third at most
        (f"config-{sha('sk-ci-5150')[:8]}", sha("sk-ci-5150"), "sk-"),
        ("grafana", GRAFANA_SHA, "sk-gra"),
    ])
    assert sha("sk-grafana-1") == GRAFANA_SHA  # the key the fixture's hash stands for


def test_load_file_reads_env_from_the_process(monkeypatch, tmp_path):
    for name, value in FIXTURE_ENV.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "config.yaml"
    path.write_text(fixture_text(), encoding="utf-8")
    parsed = load_file(path)
    assert "sk-ci-5150" in parsed.api_keys


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
    import_fixture()
    before = snapshot()
    report = import_fixture()
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
    import_fixture()
    ModelDefinition.objects.filter(model_id="embed").update(parallel=3, enabled=False)
    before = snapshot()
    exported = export_yaml()
    report = import_config(parse_config(exported, {}))
    assert (report.written, report.deleted) == (0, 0), exported
    assert snapshot() == before


def test_export_writes_an_explicit_parallel_and_leaves_a_derived_one_out():
    """A derived number is the command's: writing it would freeze it, and a later -np change
    would no longer reach the scheduler. An explicit one, even 1, stays explicit."""
    apply("""
        models:
          derived: {cmd: "llama-server --port ${PORT} -np 3"}
          pinned: {cmd: "llama-server --port ${PORT} -np 3", parallel: 1}
        """)
    models = export_config()["models"]
    assert "parallel" not in models["derived"]
    assert models["pinned"]["parallel"] == 1
    before = snapshot()
    report = import_config(parse_config(export_yaml(), {}))
    assert (report.written, report.deleted) == (0, 0)
    assert snapshot() == before
    rows = {m.model_id: m for m in ModelDefinition.objects.all()}
    assert (rows["derived"].parallel, rows["derived"].slots.parallel) == (None, 3)
    assert (rows["pinned"].parallel, rows["pinned"].slots.parallel) == (1, 1)


def test_the_catalog_serves_the_derived_slots_and_the_raw_concurrency_limit():
    """What the scheduler is told for the fixture: slots from each command where `parallel`
    is not written; concurrencyLimit as written (0 = unset: the scheduler decides, 10 under
    fifo, no cap of its own under serial)."""
    import_fixture()
    catalog = build_catalog()
    assert {m: c.parallel for m, c in catalog.models.items()} == {
        "llama-8b": 2, "qwen-coder": 4, "embed": 4, "whisper": 1}  # vllm-32b is disabled
    assert {m: c.concurrency_limit for m, c in catalog.models.items()} == {
        "llama-8b": 0, "qwen-coder": 6, "embed": 0, "whisper": 0}
    config = catalog.scheduler_config()
    assert (config.models["qwen-coder"].parallel, config.models["qwen-coder"].concurrency_limit,
            config.models["embed"].concurrency_limit) == (4, 6, 0)


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
    import_fixture()
    before = without_identity(snapshot())
    exported = export_yaml()
    ModelDefinition.objects.all().delete()
    ModelGroup.objects.all().delete()
    ApiKey.objects.all().delete()
    ProxySettings.objects.all().delete()
    import_config(parse_config(exported, {}))
    assert without_identity(snapshot()) == before


def test_export_is_llama_swap_shaped_and_holds_no_plain_keys():
    import_fixture()
    text = export_yaml()
    data = yaml.safe_load(text)
    assert data["startPort"] == 9100
    assert data["performance"] == {"disabled": True, "every": "90s"}
    assert data["queue"] == {"maxWaiting": 500, "timeout": 120,
                             "maxWaitingPerBand": {"batch": 100}}
    # `use: serial` is left out: it is what a file without `use` gets here, and llama-swap
    # refuses the name (its own scheduler is fifo)
    assert data["routing"]["scheduler"] == {
        "settings": {"serial": {"agingDivisor": 30.0, "swapAffinityBonus": 99},
                     "fifo": {"priority": {"llama-8b": 10, "qwen-coder": 5}}}}
    vllm = data["models"]["vllm-32b"]
    assert vllm["cmd"].startswith("docker run --rm --name vllm-32b --gpus all -p ${PORT}:8000")
    assert vllm["proxy"] == "http://127.0.0.1:${PORT}"
    assert (vllm["enabled"], vllm["vllmPriority"]) == (False, True)
    assert data["models"]["whisper"]["cmdStop"] == "kill -INT ${PID}"
    assert data["models"]["llama-8b"]["aliases"] == ["chat", "gpt-4o-mini"]
    assert data["models"]["qwen-coder"].get("aliases") is None  # they come from setParamsByID
    # beside the fixture's matrix (kept, unused, under `use: group`) the groups go under
    # routing.router too: llama-swap refuses top-level groups next to routing.router
    assert "groups" not in data
    router = data["routing"]["router"]
    assert router["settings"]["groups"]["coders"]["members"] == ["qwen-coder", "vllm-32b"]
    assert (router["use"], router["settings"]["matrix"]) == (
        "group", {"vars": {"l": "llama-8b", "q": "qwen-coder"}, "sets": {"day": "l & q"}})
    assert data["hooks"] == {"on_startup": {"preload": ["llama-8b"]}}
    assert {k["sha256"] for k in data["apiKeyHashes"]} == {
        sha("sk-alice-7f3a"), sha("sk-ci-5150"), GRAFANA_SHA}
    assert "sk-alice-7f3a" not in text and "sk-ci-5150" not in text


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
    assert "use" not in data["routing"]["scheduler"]  # serial: the default here


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
    assert out.splitlines() == [
        f"imported 2 models, 1 group, 0 api keys from {path}",
        "slots (requests each upstream serves at once), from cmd where `parallel` is not set:",
        "  a: 1 (not llama-server, vLLM or SGLang: 1 (set `parallel` to the server's slots))",
        "  b: 1 (not llama-server, vLLM or SGLang: 1 (set `parallel` to the server's slots))"]
    assert ModelDefinition.objects.count() == 2


def test_import_command_says_which_slots_it_derived_and_from_what(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("models:\n"
                    "  coder: {cmd: 'llama-server --port ${PORT} -np 4'}\n"
                    "  chat: {cmd: 'llama-server --port ${PORT}'}\n"
                    "  big: {cmd: 'vllm serve big --max-num-seqs 8'}\n"
                    "  pinned: {cmd: 'llama-server --port ${PORT}', parallel: 2}\n",
                    encoding="utf-8")
    out, _ = run("import_config", str(path))
    assert out.splitlines()[1:] == [
        "slots (requests each upstream serves at once), from cmd where `parallel` is not set:",
        "  big: 8 (`--max-num-seqs 8` in cmd)",
        "  chat: 4 (llama-server's default: -np auto = 4 slots)",
        "  coder: 4 (`-np 4` in cmd)"]


def test_import_command_dry_run_changes_nothing(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("apiKeys: [sk-a]\nmodels:\n  a: {cmd: s}\n", encoding="utf-8")
    out, _ = run("import_config", str(path), "--dry-run")
    assert out.splitlines()[0] == (f"would import 1 model, 0 groups, 1 api key from {path} "
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


# --- import_path: the last import, its hash, dry runs, -config-dir -----------------------------


def write(path, text: str):
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_import_path_records_the_import_and_skips_an_unchanged_file(tmp_path):
    path = write(tmp_path / "config.yaml", "models:\n  a: {cmd: s, ttl: 60}\n")
    report = import_path(path)
    assert not report.unchanged and report.changes == ["model 'a' added"]
    last = ConfigImport.last()
    assert last is not None and last.source_path == str(path)
    assert last.content_hash == hashlib.sha256(
        b"config.yaml\0" + path.read_bytes() + b"\0").hexdigest()
    ModelDefinition.objects.filter(model_id="a").update(ttl=5)  # an edit in the admin
    again = import_path(path)
    assert again.unchanged and again.changes == [] and again.written == 0
    assert ModelDefinition.objects.get(model_id="a").ttl == 5
    forced = import_path(path, force=True)
    assert not forced.unchanged and forced.changes == ["model 'a': ttl 5 -> 60"]
    assert ModelDefinition.objects.get(model_id="a").ttl == 60


def test_import_path_sees_a_changed_env_value_as_a_changed_config(tmp_path, monkeypatch):
    path = write(tmp_path / "config.yaml", "models:\n  a: {cmd: 's ${env.FLAGS}'}\n")
    monkeypatch.setenv("FLAGS", "-v")
    import_path(path)
    assert import_path(path).unchanged
    monkeypatch.setenv("FLAGS", "-q")
    report = import_path(path)
    assert not report.unchanged and report.changes == ["model 'a': cmd changed"]
    assert ModelDefinition.objects.get(model_id="a").cmd == "s -q"


def test_import_path_dry_run_lists_the_changes_and_writes_nothing(tmp_path):
    import_path(write(tmp_path / "old.yaml", """\
        globalTTL: 0
        apiKeyHashes: [{name: ci, sha256: %s, admin: true}]
        models:
          x: {cmd: old, ttl: 10}
          y: {cmd: s}
        """ % ("a" * 64)))
    before, last = snapshot(), ConfigImport.last()
    report = import_path(write(tmp_path / "new.yaml", """\
        globalTTL: 300
        apiKeyHashes: [{name: ci, sha256: %s, admin: false}]
        models:
          x: {cmd: new, ttl: 20}
          z: {cmd: s}
        groups:
          g: {members: [z]}
        """ % ("a" * 64)), dry_run=True)
    assert report.dry_run and not report.unchanged
    assert report.changes == [
        "settings: globalTTL 0 -> 300",
        "model 'x': cmd changed",
        "model 'x': ttl 10 -> 20",
        "model 'y' removed",
        "model 'z' added",
        "group 'g' added",
        "api key 'ci': admin true -> false",
    ]
    assert snapshot() == before
    assert ConfigImport.last() == last and ConfigImport.last().files == last.files


def test_import_command_dry_run_prints_the_diff(tmp_path):
    import_path(write(tmp_path / "a.yaml", "models:\n  a: {cmd: s}\n"))
    path = write(tmp_path / "b.yaml", "globalTTL: 60\nmodels:\n  a: {cmd: s, parallel: 1}\n"
                                      "  b: {cmd: s, parallel: 1}\n")
    out, _ = run("import_config", str(path), "--dry-run")
    assert out.splitlines()[1:] == ["changes it would make:",
                                    "  settings: globalTTL 0 -> 60",
                                    "  model 'a': parallel (unset) -> 1",
                                    "  model 'b' added"]
    assert list(ModelDefinition.objects.values_list("model_id", flat=True)) == ["a"]
    out, _ = run("import_config", str(path))
    assert "changes" not in out
    out, _ = run("import_config", str(path))
    assert out == (f"{path} is unchanged since the last import; nothing imported (use --force "
                   "to import it anyway)\n")


def test_a_config_dir_merges_its_yaml_files_in_name_order(tmp_path, monkeypatch):
    monkeypatch.setenv("KEY", "sk-from-env")
    write(tmp_path / "10-base.yaml", """\
        globalTTL: 60
        apiKeys: ["${env.KEY}"]
        models:
          a: {cmd: 'a --port ${PORT}'}
        hooks:
          on_startup:
            preload: [a]
        """)
    write(tmp_path / "20-more.yml", """\
        globalTTL: 60
        healthCheckTimeout: 30
        models:
          b: {cmd: 'b --port ${PORT}', ttl: 5}
        groups:
          g: {members: [a, b], swap: false}
        hooks:
          on_startup:
            preload: [b]
        """)
    write(tmp_path / "notes.txt", "models: {c: {cmd: c}}\n")  # not a config file
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "x.yaml", "models: {d: {cmd: d}}\n")  # not traversed
    report = import_path(tmp_path)
    assert (report.models, report.groups, report.api_keys) == (2, 1, 1)
    assert list(ModelDefinition.objects.values_list("model_id", "port", "ttl")) == [
        ("a", 5800, -1), ("b", 5801, 5)]
    s = ProxySettings.load()
    assert (s.global_ttl, s.health_check_timeout, s.preload) == (60, 30, ["a", "b"])
    assert ModelGroup.objects.get().swap is False
    assert list(ApiKey.objects.values_list("key_hash", flat=True)) == [sha("sk-from-env")]
    assert ConfigImport.last().files == [str(tmp_path / "10-base.yaml"),
                                         str(tmp_path / "20-more.yml")]
    assert import_path(tmp_path).unchanged


def test_a_config_dir_with_a_model_in_two_files_names_both(tmp_path):
    write(tmp_path / "a.yaml", "models:\n  m: {cmd: one}\n")
    write(tmp_path / "b.yaml", "models:\n  n: {cmd: two}\n  m: {cmd: three}\n")
    with pytest.raises(ConfigError) as info:
        import_path(tmp_path)
    assert str(info.value) == ("models.m: defined in two files (a.yaml and b.yaml); define it "
                               "in one of them")
    assert not ModelDefinition.objects.exists() and ConfigImport.last() is None


def test_a_config_dir_with_two_values_for_one_setting_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "globalTTL: 60\nmodels: {}\n")
    write(tmp_path / "b.yaml", "globalTTL: 90\n")
    with pytest.raises(ConfigError) as info:
        import_path(tmp_path)
    assert str(info.value) == ("globalTTL: b.yaml sets a different value than an earlier "
                               "file; set it in one file only")


def test_a_config_dir_names_the_file_of_a_key_given_twice(tmp_path):
    write(tmp_path / "a.yaml", "models:\n  m: {cmd: one}\n")
    write(tmp_path / "b.yaml", "globalTTL: 1\nglobalTTL: 2\n")
    with pytest.raises(ConfigError) as info:
        import_path(tmp_path)
    assert str(info.value) == "b.yaml: globalTTL: given twice (lines 1 and 2); keep one of them"


def test_the_last_import_names_its_file_by_absolute_path(tmp_path, monkeypatch):
    write(tmp_path / "config.yaml", "models:\n  a: {cmd: s}\n")
    monkeypatch.chdir(tmp_path)
    import_path(Path("config.yaml"))
    last = ConfigImport.last()
    assert (last.source_path, last.files) == (str(tmp_path / "config.yaml"),
                                              [str(tmp_path / "config.yaml")])
