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
