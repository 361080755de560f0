"""Admin API keys in the database, the config and the admin (docs/security.md, "Who can do
what"): keys that existed before the flag stay admin, new keys are not unless marked, a
config marks them under `apiKeyHashes` (`admin: true`), and export writes the flag back."""

from __future__ import annotations

import hashlib
import textwrap

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.urls import reverse

from scheduling.catalog_db import build_catalog, fingerprint
from scheduling.exporter import export_config
from scheduling.importer import import_config
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ApiKey

BEFORE = ("scheduling", "0007_parallel_derived_from_cmd")
AFTER = ("scheduling", "0008_apikey_admin")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def apply(text: str):
    return import_config(parse_config(textwrap.dedent(text), {}))


@pytest.mark.django_db(transaction=True)
def test_keys_that_existed_before_the_flag_stay_admin():
    """They could use everything: an upgrade takes nothing away from them."""
    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE])
    try:
        old = executor.loader.project_state([BEFORE]).apps.get_model("scheduling", "ApiKey")
        old.objects.create(name="ci", key_hash="1" * 64, prefix="sk-ci")
        executor = MigrationExecutor(connection)
        executor.migrate([AFTER])
        new = executor.loader.project_state([AFTER]).apps.get_model("scheduling", "ApiKey")
        assert list(new.objects.values_list("name", "admin")) == [("ci", True)]
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    # and a key made afterwards is not, unless marked
    ApiKey.objects.create(name="later", key_hash="2" * 64)
    assert ApiKey.objects.get(name="later").admin is False


@pytest.mark.django_db
def test_the_config_marks_admin_keys_under_apiKeyHashes():
    apply(f"""
        apiKeys: [sk-plain-1]
        apiKeyHashes:
          - {{name: ops, sha256: "{sha('sk-ops')}", admin: true}}
          - {{name: app, sha256: "{sha('sk-app')}", admin: false}}
          - {{name: old, sha256: "{sha('sk-old')}"}}
        models: {{a: {{cmd: s}}}}
        """)
    assert dict(ApiKey.objects.values_list("key_hash", "admin")) == {
        sha("sk-plain-1"): False, sha("sk-ops"): True, sha("sk-app"): False,
        sha("sk-old"): False}
    catalog = build_catalog()
    assert catalog.admin_keys == frozenset({sha("sk-ops")})
    assert set(catalog.api_keys) == {sha("sk-plain-1"), sha("sk-ops"), sha("sk-app"),
                                     sha("sk-old")}


@pytest.mark.django_db
def test_an_import_that_says_nothing_keeps_what_the_database_says():
    """A key ticked admin in the admin (or made admin by the upgrade) stays admin when the
    next `serve --config` imports a file that lists it without saying."""
    config = f"""
        apiKeys: [sk-plain-1]
        apiKeyHashes:
          - {{name: old, sha256: "{sha('sk-old')}"}}
        models: {{a: {{cmd: s}}}}
        """
    apply(config)
    ApiKey.objects.update(admin=True)
    report = apply(config)
    assert set(ApiKey.objects.values_list("admin", flat=True)) == {True}
    assert (report.written, report.deleted) == (0, 0)
    # saying it wins
    apply(config.replace('"}', '", admin: false}'))
    assert dict(ApiKey.objects.values_list("key_hash", "admin")) == {
        sha("sk-plain-1"): True, sha("sk-old"): False}


@pytest.mark.django_db
def test_a_plain_key_is_marked_by_its_export_listed_beside_it():
    name = "config-" + sha("sk-plain-1")[:8]
    apply(f"""
        apiKeys: [sk-plain-1]
        apiKeyHashes:
          - {{name: {name}, sha256: "{sha('sk-plain-1')}", admin: true}}
        models: {{a: {{cmd: s}}}}
        """)
    assert list(ApiKey.objects.values_list("name", "admin")) == [(name, True)]


@pytest.mark.django_db
def test_export_writes_the_flag_and_reimports_it():
    apply(f"""
        apiKeyHashes:
          - {{name: ops, sha256: "{sha('sk-ops')}", admin: true}}
          - {{name: app, sha256: "{sha('sk-app')}", admin: false}}
        models: {{a: {{cmd: s}}}}
        """)
    exported = export_config()
    assert [(k["name"], k["admin"]) for k in exported["apiKeyHashes"]] == [
        ("app", False), ("ops", True)]
    ApiKey.objects.update(admin=False)
    import_config(parse_config(__import__("yaml").safe_dump(exported), {}))
    assert dict(ApiKey.objects.values_list("name", "admin")) == {"ops": True, "app": False}


@pytest.mark.django_db
def test_keys_without_any_admin_key_are_warned_about():
    report = apply("""
        apiKeys: [sk-plain-1]
        models: {a: {cmd: s}}
        """)
    (warning,) = [w for w in report.warnings if "admin" in w]
    assert "apiKeyHashes" in warning and "/logs" in warning, warning
    report = apply(f"""
        apiKeyHashes:
          - {{name: ops, sha256: "{sha('sk-ops')}", admin: true}}
        models: {{a: {{cmd: s}}}}
        """)
    assert not [w for w in report.warnings if "admin" in w]


def test_admin_must_be_true_or_false():
    with pytest.raises(ConfigError) as info:
        parse_config(f"apiKeyHashes:\n  - {{name: x, sha256: '{sha('k')}', admin: yes}}\n"
                     "models: {}\n", {})
    assert info.value.path == "apiKeyHashes[0].admin"


@pytest.mark.django_db
def test_the_admin_page_has_the_checkbox_unticked_for_a_new_key():
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    page = client.get(reverse("admin:scheduling_apikey_add"))
    field = page.context["adminform"].form.fields["admin"]
    assert field.initial is False
    assert "/logs" in field.help_text and "/running" in field.help_text
    client.post(reverse("admin:scheduling_apikey_add"), {"name": "plain"})
    client.post(reverse("admin:scheduling_apikey_add"), {"name": "boss", "admin": "on"})
    assert dict(ApiKey.objects.values_list("name", "admin")) == {"plain": False, "boss": True}
    listing = client.get(reverse("admin:scheduling_apikey_changelist")).content.decode()
    assert "column-admin" in listing
    boss = ApiKey.objects.get(name="boss")
    assert build_catalog().admin_keys == frozenset({boss.key_hash})
    # unticking it is a change the running proxy picks up (its poll compares fingerprints)
    before = fingerprint()
    client.post(reverse("admin:scheduling_apikey_change", args=[boss.pk]), {"name": "boss"})
    assert ApiKey.objects.get(name="boss").admin is False
    assert fingerprint() != before and build_catalog().admin_keys == frozenset()
