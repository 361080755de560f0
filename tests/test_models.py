"""Validation shared by the admin and import: each refusal says why (real PostgreSQL)."""

import pytest
from django.core.exceptions import ValidationError

from scheduling.models import ApiKey, ModelDefinition, ProxySettings

pytestmark = pytest.mark.django_db


def model(**kw) -> ModelDefinition:
    base = {"model_id": "m", "cmd": "llama-server --port 5800", "proxy": "http://127.0.0.1:5800"}
    base.update(kw)
    return ModelDefinition(**base)


def errors(obj) -> dict:
    with pytest.raises(ValidationError) as info:
        obj.full_clean()
    return info.value.message_dict


def test_valid_model_passes():
    model().full_clean()


@pytest.mark.parametrize(("kw", "field", "fragment"), [
    ({"cmd": ""}, "cmd", "empty"),
    ({"cmd": "kill ${PID}"}, "cmd", "cmd stop"),
    ({"cmd": "x --y ${UNDEFINED}"}, "cmd", "unresolved macro"),
    ({"proxy": "localhost:5800"}, "proxy", "http://"),
    ({"ttl": -5}, "ttl", "-1"),
    ({"env": ["NOEQUALS"]}, "env", "NAME=value"),
    ({"aliases": ["ok", ""]}, "aliases", "non-empty"),
])
def test_model_refusals_name_the_problem(kw, field, fragment):
    errs = errors(model(**kw))
    assert field in errs
    assert fragment in " ".join(errs[field])


def test_alias_unique_across_models():
    model(model_id="a", aliases=["shared"]).save()
    errs = errors(model(model_id="b", aliases=["shared"]))
    assert "already used by model 'a'" in errs["aliases"][0]
    errs = errors(model(model_id="c", aliases=["a"]))
    assert "already a model id" in errs["aliases"][0]
    errs = errors(model(model_id="shared"))
    assert "already an alias" in errs["model_id"][0]


@pytest.mark.parametrize(("kw", "field"), [
    ({"aging_divisor": 0}, "aging_divisor"),
    ({"aging_divisor": -1.5}, "aging_divisor"),
    ({"swap_affinity_bonus": 100}, "swap_affinity_bonus"),
    ({"health_check_timeout": 14}, "health_check_timeout"),
    ({"performance_interval": 0.5}, "performance_interval"),
    ({"performance_interval": float("inf")}, "performance_interval"),
])
def test_settings_refusals(kw, field):
    settings = ProxySettings.load()
    for k, v in kw.items():
        setattr(settings, k, v)
    assert field in errors(settings)


def test_performance_interval_below_one_second_says_why():
    message = errors(ProxySettings(performance_interval=0.5))["performance_interval"][0]
    assert "at least 1 second" in message and "nvidia-smi" in message
    ProxySettings(performance_interval=1.0).full_clean()


def test_settings_singleton_and_version():
    first = ProxySettings.load()
    v = first.version
    first.aging_divisor = 0.5
    first.full_clean()
    first.save()
    again = ProxySettings.load()
    assert again.pk == 1 and again.aging_divisor == 0.5 and again.version == v + 1
    assert ProxySettings.objects.count() == 1
    with pytest.raises(ValidationError):
        again.delete()


def test_api_key_stored_hashed():
    key = ApiKey.generate()
    row = ApiKey(name="alice")
    row.set_key(key)
    row.save()
    assert key not in row.key_hash and len(row.key_hash) == 64
    with pytest.raises(ValidationError):
        ApiKey(name="x").set_key("has space")


def test_spec_resolution_uses_globals():
    settings = ProxySettings.load()
    settings.global_ttl = 120
    settings.unload_timeout = 7
    m = model(cmd="srv --port ${PORT} --alias ${MODEL_ID}", proxy="http://127.0.0.1:${PORT}",
              env=["A=1", "B=x=y"])
    spec = m.to_upstream_spec(settings, port=5901)
    assert spec.argv() == ["srv", "--port", "5901", "--alias", "m"]
    assert spec.proxy == "http://127.0.0.1:5901"
    assert spec.ttl == 120 and spec.unload_timeout == 7
    assert spec.env == {"A": "1", "B": "x=y"}
    m.ttl = 0
    assert m.to_upstream_spec(settings, port=1).ttl == 0


def test_parallel_is_empty_by_default_and_at_least_1_when_set():
    """Empty (None) means "derive it from cmd"; a number is the upstream's slots, so 0 would
    refuse every request for good."""
    fresh = model()
    assert fresh.parallel is None
    fresh.full_clean()
    assert "at least 1" in errors(model(parallel=0))["parallel"][0]
    model(parallel=1).full_clean()


def test_a_model_saved_without_parallel_gets_the_slots_of_its_command():
    """As a model created in the admin: nothing written in `parallel`, and the catalog the
    scheduler reads serves -np's 3, or LLAMA_ARG_N_PARALLEL's 5, or llama-server's auto 4."""
    from scheduling.catalog_db import build_catalog

    model(model_id="np", cmd="llama-server --port ${PORT} -np 3").save()
    model(model_id="env", cmd="llama-server --port ${PORT}",
          env=["LLAMA_ARG_N_PARALLEL=5"]).save()
    model(model_id="auto", cmd="llama-server --port ${PORT}").save()
    model(model_id="pinned", cmd="llama-server --port ${PORT} -np 3", parallel=1).save()
    rows = {m.model_id: m for m in ModelDefinition.objects.all()}
    assert {m: r.parallel for m, r in rows.items()} == {
        "np": None, "env": None, "auto": None, "pinned": 1}
    assert {m: (r.slots.parallel, r.slots.source) for m, r in rows.items()} == {
        "np": (3, "`-np 3` in cmd"),
        "env": (5, "LLAMA_ARG_N_PARALLEL=5 in env"),
        "auto": (4, "llama-server's default: -np auto = 4 slots"),
        "pinned": (1, "`parallel` set explicitly")}
    assert {m: c.parallel for m, c in build_catalog().models.items()} == {
        "np": 3, "env": 5, "auto": 4, "pinned": 1}


@pytest.mark.django_db(transaction=True)
def test_the_migration_makes_the_old_default_follow_the_command():
    """Before 0007 an unset parallel was stored as 1: those become empty (read from cmd), so
    an existing `-np 2` model gets its two slots; any other number stays as written."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before, after = [("scheduling", "0006_queue_caps")], [
        ("scheduling", "0007_parallel_derived_from_cmd")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps.get_model("scheduling",
                                                                   "ModelDefinition")
        for model_id, parallel in (("was-default", 1), ("written", 3)):
            old.objects.create(model_id=model_id, cmd="llama-server -np 2",
                               proxy="http://127.0.0.1:1", parallel=parallel)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
    finally:
        MigrationExecutor(connection).migrate(
            MigrationExecutor(connection).loader.graph.leaf_nodes())
    rows = {m.model_id: m for m in ModelDefinition.objects.all()}
    assert {m: r.parallel for m, r in rows.items()} == {"was-default": None, "written": 3}
    assert rows["was-default"].slots.parallel == 2
