"""`routing.scheduler.settings.serial.affinityBudget` (issue 23) from the file, the settings
page and the catalog to the scheduler, and back out through the export: off by default, `auto`
or seconds, and a clear error for anything else, naming the key."""

from __future__ import annotations

import pytest

from scheduling.affinity_budget import AUTO_SWAPS, Budget, parse_budget
from scheduling.catalog_db import build_catalog
from scheduling.exporter import export_document
from scheduling.importer import import_path
from scheduling.models import ProxySettings
from tests.test_admin import client, form_data, settings_url  # noqa: F401 (fixtures)
from tests.test_llamaswap_parse import error, parse

KEY = "routing.scheduler.settings.serial.affinityBudget"


@pytest.mark.parametrize(("value", "budget"), [
    (None, Budget()), ("", Budget()), ("off", Budget()), (" OFF ", Budget()), (0, Budget()),
    (False, Budget()), ("0", Budget()), ("auto", Budget(swaps=AUTO_SWAPS)),
    ("Auto", Budget(swaps=AUTO_SWAPS)), (120, Budget(seconds=120.0)),
    (7.5, Budget(seconds=7.5)), ("90", Budget(seconds=90.0)), ("90s", Budget(seconds=90.0)),
    ("2.5 s", Budget(seconds=2.5)),
])
def test_what_a_value_means(value, budget):
    assert parse_budget(value) == budget


@pytest.mark.parametrize("value", [True, -1, float("nan"), float("inf"), "soon", "-5",
                                   "auto6", "1e3", [30], {"k": 6}])
def test_anything_else_is_refused_with_the_remedy(value):
    with pytest.raises(ValueError, match="give auto, a number of seconds above 0, or off"):
        parse_budget(value)


def test_stored_and_written_forms():
    assert [parse_budget(v).text() for v in ("", "auto", 120, 7.5)] == ["", "auto", "120",
                                                                         "7.5"]
    assert [parse_budget(v).value() for v in ("", "auto", 120, 7.5)] == [None, "auto", 120,
                                                                          7.5]


def test_the_config_key_is_read_and_a_bad_value_names_it():
    def budget(snippet: str) -> str:
        return parse(f"""
            models: {{}}
            routing: {{scheduler: {{settings: {{serial: {{{snippet}}}}}}}}}
            """).settings.affinity_budget

    assert (budget(""), budget("affinityBudget: auto"), budget("affinityBudget: 45")) == (
        "", "auto", "45")
    err = error("""
        models: {}
        routing: {scheduler: {settings: {serial: {affinityBudget: forever}}}}
        """)
    assert err.path == KEY and "give auto" in str(err)


@pytest.mark.django_db
def test_imported_into_the_settings_the_scheduler_and_back_out(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("models: {}\nrouting: {scheduler: {settings: {serial: "
                    "{affinityBudget: auto}}}}\n")
    import_path(path)
    assert ProxySettings.load().affinity_budget == "auto"
    config = build_catalog().scheduler_config()
    assert (config.affinity_budget, config.affinity_budget_swaps) == (0.0, AUTO_SWAPS)
    assert "affinityBudget: auto" in export_document().text
    ProxySettings.objects.update(affinity_budget="120")
    config = build_catalog().scheduler_config()
    assert (config.affinity_budget, config.affinity_budget_swaps) == (120.0, 0.0)
    assert "affinityBudget: 120" in export_document().text
    ProxySettings.objects.update(affinity_budget="")
    assert "affinityBudget" not in export_document().text  # off: a file without the key


@pytest.mark.django_db
def test_the_settings_page_saves_it_normalised_and_refuses_nonsense(client, settings_url):  # noqa: F811
    r = client.post(settings_url, form_data(client.get(settings_url), affinity_budget=" AUTO "))
    assert r.status_code == 302, r.context["adminform"].form.errors
    assert ProxySettings.load().affinity_budget == "auto"
    r = client.post(settings_url, form_data(client.get(settings_url), affinity_budget="-5"))
    assert r.status_code == 200
    errors = r.context["adminform"].form.errors
    assert list(errors) == ["affinity_budget"] and "give auto" in errors["affinity_budget"][0]
    assert ProxySettings.load().affinity_budget == "auto"
