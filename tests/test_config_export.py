"""The export keeps a config's meaning: macros and `${env.…}` references written back as they
were imported, entries naming no model kept, API keys never dropped without a word.

Every config here is hand-written YAML; every expected text is read off it by eye.
"""

from __future__ import annotations

import io
import json
import textwrap

import pytest
import yaml
from django.core.management import call_command

from scheduling.exporter import export_config, export_document
from scheduling.importer import import_path
from scheduling.models import ApiKey, ConfigImport, ModelDefinition, ModelGroup, ProxySettings

pytestmark = pytest.mark.django_db


def write(path, text: str):
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def rows() -> dict[str, list]:
    """The imported state, without what a fresh database numbers differently."""
    return {
        "models": list(ModelDefinition.objects.order_by("model_id").values(
            "model_id", "cmd", "proxy", "env", "port", "aliases", "metadata", "fifo_priority",
            "group__group_id")),
        "groups": list(ModelGroup.objects.values("group_id", "swap")),
        "settings": list(ProxySettings.objects.values("preload", "global_ttl")),
        "keys": list(ApiKey.objects.order_by("name").values("name", "key_hash", "admin")),
    }


MACROS = """\
    macros:
      server: /opt/llama/llama-server
      models: ${env.MODEL_DIR}
    models:
      small:
        macros:
          quant: Q4_K_M
        cmd: ${server} --port ${PORT} -m ${models}/small-${quant}.gguf
        env: ["HF_TOKEN=${env.HF_TOKEN}"]
        metadata: {port: "${PORT}", file: "${models}/small"}
      big:
        cmd: ${server} --port ${PORT} -m ${models}/big.gguf
        ttl: 60
"""


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("MODEL_DIR", "/srv/models")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_1")
    monkeypatch.setenv("KEY", "sk-env-key-1234")


def test_macros_and_env_references_are_written_as_imported(tmp_path, env):
    import_path(write(tmp_path / "config.yaml", MACROS))
    small = ModelDefinition.objects.get(model_id="small")
    assert small.cmd == ("/opt/llama/llama-server --port 5801 -m "
                         "/srv/models/small-Q4_K_M.gguf")
    assert small.env == ["HF_TOKEN=hf_secret_1"]
    text = export_document().text
    assert "hf_secret_1" not in text and "/srv/models" not in text
    data = yaml.safe_load(text)
    assert data["macros"] == {"server": "/opt/llama/llama-server",
                              "models": "${env.MODEL_DIR}"}
    assert data["models"]["small"] == {
        "macros": {"quant": "Q4_K_M"},
        "cmd": "${server} --port ${PORT} -m ${models}/small-${quant}.gguf",
        "env": ["HF_TOKEN=${env.HF_TOKEN}"],
        "metadata": {"port": "${PORT}", "file": "${models}/small"}}
    assert data["models"]["big"] == {"cmd": "${server} --port ${PORT} -m ${models}/big.gguf",
                                     "ttl": 60}


def test_a_value_edited_since_the_import_is_written_expanded(tmp_path, env):
    import_path(write(tmp_path / "config.yaml", MACROS))
    ModelDefinition.objects.filter(model_id="big").update(
        cmd="/opt/llama/llama-server --port 5800 -m /srv/models/big-v2.gguf")
    data = export_config()
    assert data["models"]["big"]["cmd"] == ("/opt/llama/llama-server --port ${PORT} -m "
                                            "/srv/models/big-v2.gguf")
    assert data["models"]["small"]["cmd"] == ("${server} --port ${PORT} -m "
                                              "${models}/small-${quant}.gguf")


def test_the_export_imports_back_to_the_same_rows(tmp_path, env):
    first = import_path(write(tmp_path / "config.yaml", MACROS + """\
    apiKeys: ["${env.KEY}"]
    hooks: {on_startup: {preload: [small]}}
    """))
    ApiKey.objects.update(admin=True)  # ticked in the admin: the export keeps the rank
    before = rows()
    exported = write(tmp_path / "exported.yaml", export_document().text)
    for model in (ModelDefinition, ModelGroup, ApiKey):
        model.objects.all().delete()
    report = import_path(exported)
    assert first.warnings[0].startswith("apiKeys: no admin key")
    assert report.warnings == ()
    assert rows() == before


def test_preload_priorities_and_members_naming_no_model_survive(tmp_path):
    import_path(write(tmp_path / "config.yaml", """\
        models:
          a: {cmd: s, aliases: [alpha]}
          b: {cmd: s}
        groups:
          g: {members: [a, retired]}
        hooks: {on_startup: {preload: [fast, alpha]}}
        routing:
          scheduler:
            use: fifo
            settings:
              fifo: {priority: {b: 5, ghost: 9}}
        """))
    data = export_config()
    assert data["hooks"] == {"on_startup": {"preload": ["fast", "alpha"]}}
    assert data["routing"] == {"scheduler": {"use": "fifo", "settings": {
        "fifo": {"priority": {"b": 5, "ghost": 9}}}}}
    assert data["groups"]["g"]["members"] == ["a", "retired"]
    # edited in the admin: the database's values, plus the names that are no model
    ProxySettings.objects.filter(pk=1).update(preload=["b"])
    ModelDefinition.objects.filter(model_id="b").update(fifo_priority=7)
    ModelDefinition.objects.filter(model_id="b").update(group=ModelGroup.objects.get())
    data = export_config()
    assert data["hooks"] == {"on_startup": {"preload": ["b", "fast"]}}
    assert data["routing"]["scheduler"]["settings"]["fifo"] == {"priority": {"b": 7,
                                                                             "ghost": 9}}
    assert data["groups"]["g"]["members"] == ["a", "b", "retired"]


KEY_WARNING = (
    "API key {name!r} ({prefix}…): its value is not stored (only its SHA-256), so the "
    "exported file has no usable key for it: llama-swap ignores apiKeyHashes. Replace its "
    "commented placeholder under apiKeys with the key, or with an ${{env.…}} reference to it")


def test_keys_from_env_export_as_references_and_the_others_as_placeholders(tmp_path, env):
    import_path(write(tmp_path / "config.yaml", """\
        apiKeys: ["${env.KEY}", sk-literal-abcdef]
        models: {a: {cmd: s}}
        """))
    made = ApiKey(name="alice", admin=True)
    made.set_key("sk-gp-made-in-admin-1")
    made.save()
    document = export_document()
    assert "sk-env-key-1234" not in document.text and "sk-literal-abcdef" not in document.text
    literal = ApiKey.objects.get(prefix="sk-li")
    assert document.warnings == (KEY_WARNING.format(name="alice", prefix="sk-gp-m"),
                                 KEY_WARNING.format(name=literal.name, prefix="sk-li"))
    assert document.text.endswith(
        "apiKeys:\n"
        "- ${env.KEY}\n"
        "# - <the key of 'alice' (sk-gp-m…): its value is not stored; write it here, or an "
        "${env.…} reference to it>\n"
        f"# - <the key of {literal.name!r} (sk-li…): its value is not stored; write it "
        "here, or an ${env.…} reference to it>\n")
    data = yaml.safe_load(document.text)
    assert data["apiKeys"] == ["${env.KEY}"]
    # apiKeyHashes (gpuproxy's) keeps the two for a re-import here; llama-swap ignores it
    assert [k["name"] for k in data["apiKeyHashes"]] == ["alice", literal.name]


def test_an_export_with_no_usable_key_says_llama_swap_would_run_open():
    made = ApiKey(name="ops")
    made.set_key("sk-gp-ops-key-xyz")
    made.save()
    document = export_document()
    assert document.warnings[-1] == (
        "the exported file has no usable API key: a llama-swap started on it runs with no "
        "authentication until apiKeys holds at least one key")
    assert yaml.safe_load(document.text)["apiKeys"] is None


def test_export_command_prints_the_key_warnings_on_stderr(tmp_path):
    made = ApiKey(name="ops")
    made.set_key("sk-gp-ops-key-xyz")
    made.save()
    out, err = io.StringIO(), io.StringIO()
    call_command("export_config", stdout=out, stderr=err)
    assert err.getvalue().splitlines()[0] == "warning: " + KEY_WARNING.format(
        name="ops", prefix="sk-gp")
    assert "# - <the key of 'ops'" in out.getvalue()


def test_a_key_only_partly_from_env_is_not_kept_even_in_part(tmp_path, monkeypatch):
    monkeypatch.setenv("SUFFIX", "tail-9876")
    import_path(write(tmp_path / "config.yaml", """\
        apiKeys: ["sk-head-${env.SUFFIX}"]
        models: {a: {cmd: s}}
        """))
    assert "sk-head" not in json.dumps(ConfigImport.last().meaning)
    document = export_document()
    assert "sk-head" not in document.text and "tail-9876" not in document.text
    assert len(document.warnings) == 2  # the key, and: no usable key at all


def test_the_fixture_round_trips_through_its_export_with_its_meaning(tmp_path, monkeypatch):
    """tests/data/llama-swap-config.yaml (macros, ${env.…}, setParamsByID, groups, keys of
    every kind): import, export, import the export into an empty database: the same rows."""
    from tests.llamaswap_fixture import FIXTURE, FIXTURE_ENV
    from tests.test_config_import import snapshot, without_identity

    for name, value in FIXTURE_ENV.items():
        monkeypatch.setenv(name, value)
    import_path(FIXTURE)
    ApiKey.objects.update(admin=True)
    before = without_identity(snapshot())
    document = export_document()
    for value in FIXTURE_ENV.values():
        assert value not in document.text
    exported = write(tmp_path / "exported.yaml", document.text)
    for model in (ModelDefinition, ModelGroup, ApiKey, ProxySettings):
        model.objects.all().delete()
    import_path(exported)
    assert without_identity(snapshot()) == before
