"""Trusted priority (docs/scheduling.md, "Trusted priority"): a key's range clamps what its
holder asks for, a global range covers keys without one, nothing configured leaves the seed's
unclamped priority, and the activity row keeps both the asked and the applied value.

Expected values are read off the ranges by hand (batch = -100, interactive = 100)."""

from __future__ import annotations

import hashlib
import textwrap

import httpx
import pytest
import yaml
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from activity.models import RequestLog
from activity.record import RequestRecord
from gpuproxy.proxy import urgency
from scheduling.catalog import Catalog
from scheduling.catalog_db import build_catalog, fingerprint
from scheduling.exporter import export_config
from scheduling.importer import import_config
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ApiKey, ProxySettings
from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until, until

INT64_MAX = 2**63 - 1
H = urgency.PRIORITY_HEADER


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def apply(text: str):
    return import_config(parse_config(textwrap.dedent(text), {}))


# ---- what a request asks for ----------------------------------------------------------------

@pytest.mark.parametrize(("headers", "body", "asked"), [
    ({}, None, None),
    ({}, {"model": "m"}, None),
    ({H: b"1000"}, None, 1000),
    ({H: b"0"}, None, 0),
    ({H: b"-000"}, None, 0),
    ({H: b"Normal"}, None, 0),
    ({H: b"batch"}, {"service_tier": "priority"}, -100),  # the header wins
    ({}, {"service_tier": "flex"}, -100),
    ({}, {"service_tier": "scale"}, None),  # unknown tier: asks for nothing
    ({H: b"1e3"}, None, None),  # junk: asks for nothing (the default applies)
    ({H: b""}, {"service_tier": "priority"}, None),  # an empty header still hides the tier
    ({H: b"9223372036854775808"}, None, None),
])
def test_what_a_request_asks_for(headers, body, asked):
    assert urgency.asked_priority(headers, body) == asked


# ---- the clamp ------------------------------------------------------------------------------

U = urgency.UNSET


@pytest.mark.parametrize(("asked", "key", "glob", "applied"), [
    (INT64_MAX, U, U, INT64_MAX),  # nothing configured: the seed's unclamped value
    (None, U, U, 0),
    (1000, (None, -100, None), U, -100),  # a batch tenant asking for 1000
    (-5000, (None, -100, None), U, -5000),  # only max: capped above only
    (-5000, (-100, None, None), U, -100),
    (1000, U, (None, 100, None), 100),  # keys without a range use the global one
    (1000, (None, 500, None), (None, 100, None), 500),  # the key's own max wins
    (-900, (None, 500, None), (-200, 100, None), -200),  # its unset min falls back
    (None, (None, None, 7), (None, None, 3), 7),  # the key's default
    (None, (None, -100, None), (None, None, 3), -100),  # the global default, clamped
    (None, U, (None, None, -100), -100),
    (None, U, (None, -50, None), -50),  # no default: 0, clamped into the range
    (42, (0, 100, 100), U, 42),  # inside: untouched
])
def test_the_clamp(asked, key, glob, applied):
    assert urgency.clamp(asked, key, glob) == applied


def test_the_presented_key_picks_its_range_and_the_record_keeps_the_asked_value():
    catalog = Catalog(api_keys={sha("sk-batch"): "batchy", sha("sk-free"): "free"},
                      priority_ranges={sha("sk-batch"): (None, -100, -100)},
                      priority_range=(None, 100, None))
    rec = RequestRecord("POST", "/v1/chat/completions", "", "")
    bearer = {b"authorization": b"Bearer sk-batch", H: b"1000"}
    assert urgency.applied_priority(bearer, None, catalog, rec) == -100
    assert rec.priority_asked == 1000
    assert urgency.applied_priority({b"x-api-key": b"sk-batch"}, None, catalog, rec) == -100
    assert rec.priority_asked is None
    # a key without a range, and no key at all: the global range
    assert urgency.applied_priority({b"x-api-key": b"sk-free", H: b"1000"}, None,
                                    catalog) == 100
    assert urgency.applied_priority({H: b"1000"}, None, catalog) == 100
    # service_tier maps first, then the clamp
    assert urgency.applied_priority({b"authorization": b"Bearer sk-batch"},
                                    {"service_tier": "priority"}, catalog, rec) == -100
    assert rec.priority_asked == 100
    assert rec.row()["priority_asked"] == 100


def test_a_trusted_peer_key_gets_its_own_range_not_the_global_one():
    """The entry node already applied its range; a receiving node caps a peer only by the
    range its key is given."""
    catalog = Catalog(api_keys={sha("sk-peer"): "entry", sha("sk-capped-peer"): "capped"},
                      trusted_peer_keys=frozenset({sha("sk-peer"), sha("sk-capped-peer")}),
                      priority_ranges={sha("sk-capped-peer"): (None, 50, None)},
                      priority_range=(-100, 100, -100))
    assert urgency.applied_priority({b"x-api-key": b"sk-peer", H: b"1000"}, None,
                                    catalog) == 1000
    assert urgency.applied_priority({b"x-api-key": b"sk-peer"}, None, catalog) == 0
    assert urgency.applied_priority({b"x-api-key": b"sk-capped-peer", H: b"1000"}, None,
                                    catalog) == 50
    assert urgency.applied_priority({b"x-api-key": b"sk-capped-peer", H: b"-900"}, None,
                                    catalog) == -900


# ---- the database, the admin, the config ----------------------------------------------------

@pytest.mark.django_db
def test_a_range_reaches_the_catalog_and_changes_its_fingerprint():
    key = ApiKey(name="batchy", priority_max=-100)
    key.set_key("sk-batch")
    key.save()
    ApiKey(name="plain", key_hash="2" * 64).save()
    before = fingerprint()
    catalog = build_catalog()
    assert catalog.priority_ranges == {sha("sk-batch"): (None, -100, None)}
    assert catalog.priority_range == (None, None, None)
    key.priority_min = -500
    key.save()
    assert fingerprint() != before
    settings = ProxySettings.load()
    settings.priority_max = 100
    settings.save()
    assert build_catalog().priority_range == (None, 100, None)


@pytest.mark.parametrize(("lo", "hi", "default", "field", "words"), [
    (100, -100, None, "priority_max", "below priority min"),
    (-200, -100, 0, "priority_default", "outside min..max"),
    (None, -100, 5, "priority_default", "outside min..max"),
    (2**63, None, None, "priority_min", "64-bit"),
])
def test_a_bad_range_is_refused_with_the_field(lo, hi, default, field, words):
    for row in (ApiKey(name="k", key_hash="1" * 64), ProxySettings()):
        row.priority_min, row.priority_max, row.priority_default = lo, hi, default
        with pytest.raises(ValidationError) as exc:
            row.clean()
        assert words in " ".join(exc.value.message_dict[field])


@pytest.mark.django_db
def test_the_admin_saves_a_range_and_refuses_min_above_max():
    User.objects.create_superuser("root", "r@example.com", "pw")
    client = Client()
    client.force_login(User.objects.get(username="root"))
    key = ApiKey(name="tenant", key_hash="3" * 64)
    key.save()
    url = reverse("admin:scheduling_apikey_change", args=[key.pk])
    form = {"name": "tenant", "priority_min": "10", "priority_max": "-100",
            "priority_default": ""}
    page = client.post(url, form)
    assert page.status_code == 200  # the form again, with the error
    assert "is below priority min" in page.content.decode()
    assert ApiKey.objects.get(pk=key.pk).priority_range() == (None, None, None)
    form["priority_min"] = ""
    assert client.post(url, form).status_code == 302
    assert ApiKey.objects.get(pk=key.pk).priority_range() == (None, -100, None)
    settings_url = reverse("admin:scheduling_proxysettings_change", args=[1])
    ProxySettings.load()
    page = client.get(settings_url)
    assert "Trusted priority" in page.content.decode()


RANGES = f"""
    apiKeys: [sk-plain-1]
    apiKeyHashes:
      - {{name: config-{sha('sk-plain-1')[:8]}, sha256: "{sha('sk-plain-1')}",
          priority: {{min: batch, max: 100}}}}
      - {{name: batchy, sha256: "{sha('sk-batch')}", admin: true,
          priority: {{max: batch, default: batch}}}}
      - {{name: free, sha256: "{sha('sk-free')}"}}
    queue:
      priority: {{max: interactive}}
    models:
      m:
        cmd: /bin/true --port ${{PORT}}
"""


@pytest.mark.django_db
def test_ranges_import_and_export_and_import_back_the_same():
    apply(RANGES)
    ranges = {k.name: k.priority_range() for k in ApiKey.objects.all()}
    assert ranges == {f"config-{sha('sk-plain-1')[:8]}": (-100, 100, None),
                      "batchy": (None, -100, -100), "free": (None, None, None)}
    assert ProxySettings.load().priority_range() == (None, 100, None)
    exported = export_config()
    by_name = {k["name"]: k for k in exported["apiKeyHashes"]}
    assert by_name["batchy"]["priority"] == {"max": -100, "default": -100}
    assert by_name[f"config-{sha('sk-plain-1')[:8]}"]["priority"] == {"min": -100, "max": 100}
    assert "priority" not in by_name["free"]
    assert exported["queue"]["priority"] == {"max": 100}
    # wipe, then import the export: the same ranges come back
    ApiKey.objects.update(priority_min=None, priority_max=None, priority_default=None)
    ProxySettings.objects.update(priority_max=None)
    exported.setdefault("apiKeys", ["sk-plain-1"])
    exported["apiKeys"] = ["sk-plain-1"]
    apply(yaml.safe_dump(exported))
    assert {k.name: k.priority_range() for k in ApiKey.objects.all()} == ranges
    assert ProxySettings.load().priority_range() == (None, 100, None)
    # a file that stops giving a key a `priority:` keeps the database's; `{}` clears it
    apply(RANGES.replace("priority: {max: batch, default: batch}", "priority: {}"))
    assert ApiKey.objects.get(name="batchy").priority_range() == (None, None, None)


@pytest.mark.parametrize(("entry", "path"), [
    ("priority: {max: 1.5}", "apiKeyHashes[0].priority.max"),
    ("priority: {max: urgent}", "apiKeyHashes[0].priority.max"),
    ("priority: {min: 5, max: -5}", "apiKeyHashes[0].priority.max"),
    ("priority: {max: -100, default: 0}", "apiKeyHashes[0].priority.default"),
    ("priority: 5", "apiKeyHashes[0].priority"),
])
def test_a_bad_range_in_the_config_names_its_path(entry, path):
    text = f"""
    apiKeyHashes:
      - {{name: k, sha256: "{sha('sk-k')}", {entry}}}
    models:
      m:
        cmd: /bin/true --port ${{PORT}}
    """
    with pytest.raises(ConfigError) as exc:
        parse_config(textwrap.dedent(text), {})
    assert path in str(exc.value)


def test_an_unknown_key_in_a_range_is_a_warning_as_elsewhere():
    parsed = parse_config(textwrap.dedent(f"""
    apiKeyHashes:
      - {{name: k, sha256: "{sha('sk-k')}", priority: {{ceiling: 5, max: 7}}}}
    models: {{}}
    """), {})
    assert parsed.api_key_hashes[0].priority == (None, 7, None)
    assert any("apiKeyHashes[0].priority.ceiling" in w for w in parsed.warnings)


# ---- through HTTP ---------------------------------------------------------------------------

ADMIN, TENANT = "sk-ops-admin-1", "sk-batch-tenant-1"


@pytest.mark.django_db(transaction=True)
def test_a_key_capped_at_batch_asking_for_1000_is_dispatched_at_the_cap(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    apiKeyHashes:
      - {{name: ops, sha256: "{sha(ADMIN)}", admin: true}}
      - {{name: batchy, sha256: "{sha(TENANT)}", priority: {{max: batch}}}}
    queue:
      priority: {{max: interactive}}
    models:
      solo:
        cmd: {FAKE}
    """)
    admin = httpx.Client(base_url=proxy.base, trust_env=False, timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN}"})
    proxy.http = admin  # queue_until reads /api/queue, an admin path

    def chat(key: str, priority: str | None, gate: str | None = None) -> Chat:
        c = Chat(proxy.base, "solo", priority, gate=gate, start=False)
        c.headers["Authorization"] = f"Bearer {key}"
        c.start()
        return c

    first = chat(ADMIN, None, gate="first")
    queue_until(proxy, lambda q: q["in_flight"].get("solo") == 1)
    tenant = chat(TENANT, "1000")
    queue_until(proxy, lambda q: len(q["queued"]) == 1)
    ops = chat(ADMIN, "1000")  # no range of its own: the global max
    q = queue_until(proxy, lambda q: len(q["queued"]) == 2)
    assert [(w["priority"], w["band"]) for w in q["queued"]] == [(100, "interactive"),
                                                                 (-100, "batch")]
    open_gate(start, "first")
    for c in (first, tenant, ops):
        assert c.answered().status_code == 200
    assert ops.served < tenant.served

    def rows() -> list[tuple]:
        return list(RequestLog.objects.order_by("received_at").values_list(
            "client", "priority_asked", "priority", "band", "score_parts__priority"))

    got = until("three activity rows", lambda: len(r := rows()) == 3 and r)
    assert got == [("ops", None, 0, "normal", 0), ("batchy", 1000, -100, "batch", -100),
                   ("ops", 1000, 100, "interactive", 100)]
    admin.close()
