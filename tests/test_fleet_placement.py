"""Issue 24, item 2: a model placed on some nodes of the fleet (`nodes: [...]`). The file's
key round-trips through import and export, a bad node name is refused where it is written,
and a node never schedules a model placed elsewhere: the catalog keeps it out of `models`,
routes it "fleet", and a real serve neither preloads nor loads it."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from django.core.exceptions import ValidationError
from django.urls import reverse

from activity.models import Node
from scheduling.catalog_db import build_catalog
from scheduling.exporter import export_config
from scheduling.importer import import_config
from scheduling.llamaswap import ConfigError, parse_config
from scheduling.models import ModelDefinition, ProxySettings
from scheduling.nodes import serves_text
from tests.conftest import FAKE, free_port, processes_matching
from tests.helpers import until

PLACED = """
models:
  here:
    cmd: srv --port 9001
    proxy: http://127.0.0.1:9001
  there:
    cmd: srv --port 9002
    proxy: http://127.0.0.1:9002
    aliases: [far]
    nodes: [gpu-b, gpu-c]
"""


def apply(text: str):
    return import_config(parse_config(textwrap.dedent(text), {}))


def test_the_parser_reads_nodes_and_defaults_to_every_node():
    parsed = {m.model_id: m for m in parse_config(textwrap.dedent(PLACED), {}).models}
    assert parsed["there"].nodes == ("gpu-b", "gpu-c")
    assert parsed["here"].nodes == ()


@pytest.mark.parametrize(("nodes", "where", "words"), [
    ('["gpu b"]', "models.there.nodes[0]", "'gpu b' is not a node name"),
    ('["ok", "x/y"]', "models.there.nodes[1]", "'x/y' is not a node name"),
    ('["gpu-b", "gpu-b"]', "models.there.nodes[1]", "listed twice"),
    (f'["{"n" * 64}"]', "models.there.nodes[0]", "1 to 63 letters"),
])
def test_a_bad_node_name_is_refused_where_it_is_written(nodes, where, words):
    text = f"models:\n  there:\n    cmd: srv\n    proxy: http://h:1\n    nodes: {nodes}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, {})
    assert err.value.path == where
    assert words in str(err.value)


@pytest.mark.django_db
def test_import_stores_nodes_and_export_writes_them_back():
    apply(PLACED)
    assert ModelDefinition.objects.get(model_id="there").nodes == ["gpu-b", "gpu-c"]
    assert ModelDefinition.objects.get(model_id="here").nodes == []
    exported = export_config()
    assert exported["models"]["there"]["nodes"] == ["gpu-b", "gpu-c"]
    assert "nodes" not in exported["models"]["here"]  # the default, every node, is left out
    report = import_config(parse_config(yaml.safe_dump(exported), {}))
    assert report.written == 0  # the round trip changes nothing


@pytest.mark.django_db
def test_the_admin_form_refuses_a_bad_placement():
    apply(PLACED)
    row = ModelDefinition.objects.get(model_id="there")
    for bad, words in ((["a b"], "'a b' is not a node name"), ("gpu-b", "JSON list"),
                       (["x", "x"], "listed twice")):
        row.nodes = bad
        with pytest.raises(ValidationError) as err:
            row.full_clean()
        assert words in " ".join(err.value.message_dict["nodes"])


@pytest.mark.django_db
def test_the_catalog_keeps_a_model_placed_elsewhere_out_and_routes_it_fleet(settings):
    settings.GPUPROXY_NODE = "gpu-a"
    apply(PLACED)
    catalog = build_catalog()
    assert catalog.node == "gpu-a"
    assert set(catalog.models) == {"here"}
    assert catalog.elsewhere == {"there": ("gpu-b", "gpu-c")}
    assert catalog.resolve("there") is None and catalog.resolve("far") is None
    for name in ("there", "far"):
        route = catalog.route(name)
        assert (route.kind, route.target, route.requested, route.nodes) == (
            "fleet", "there", name, ("gpu-b", "gpu-c"))
    assert catalog.route("here").kind == "model"
    config = catalog.scheduler_config()
    assert set(config.models) == {"here"}
    assert config.elsewhere == {"there": ("gpu-b", "gpu-c"), "far": ("gpu-b", "gpu-c")}

    settings.GPUPROXY_NODE = "gpu-b"  # the same definitions, read on a node it is placed on
    catalog = build_catalog()
    assert set(catalog.models) == {"here", "there"} and not catalog.elsewhere
    assert catalog.route("far").kind == "model"


def test_serves_says_what_a_node_runs():
    placements = [("big", ["gpu-b"]), ("small", []), ("tiny", []), ("mid", ["gpu-a", "gpu-b"])]
    assert serves_text("gpu-b", placements) == "big, mid, all others (2 on every node)"
    assert serves_text("gpu-a", placements) == "mid, all others (2 on every node)"
    assert serves_text("gpu-c", placements) == "all (2 on every node)"
    assert serves_text("gpu-c", [("big", ["gpu-b"])]) == "-"


@pytest.mark.django_db
def test_the_admin_shows_the_placement_and_what_each_node_serves(admin_client):
    ModelDefinition.objects.create(model_id="anywhere", cmd="x", proxy="http://127.0.0.1:1")
    page = admin_client.get(reverse("admin:scheduling_modeldefinition_changelist"))
    # nothing placed: every model runs everywhere, and a single box's page has no such column
    assert "column-placement" not in page.content.decode()
    apply(PLACED)
    page = admin_client.get(reverse("admin:scheduling_modeldefinition_changelist"))
    assert "column-placement" in page.content.decode()
    assert page.status_code == 200
    html = page.content.decode()
    assert "gpu-b, gpu-c" in html and ">all<" in html
    from django.utils import timezone

    Node.objects.create(node="gpu-b", heartbeat_at=timezone.now(), started_at=timezone.now(),
                        pid=1, version="t", listen="127.0.0.1:1")
    page = admin_client.get(reverse("admin:activity_node_changelist"))
    assert page.status_code == 200
    assert "there, all others (1 on every node)" in page.content.decode()


@pytest.mark.django_db
def test_the_settings_refuse_a_bad_importer_node():
    row = ProxySettings.load()
    for ok in ("", "-", "gpu-a"):
        row.importer_node = ok
        row.full_clean()
    row.importer_node = "gpu a"
    with pytest.raises(ValidationError) as err:
        row.full_clean()
    assert "'gpu a' is not a node name" in " ".join(err.value.message_dict["importer_node"])


# ---- a real serve ------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_serve_never_starts_a_model_placed_on_another_node(serve):
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    hooks:
      on_startup:
        preload: [there]
    models:
      here:
        cmd: {FAKE}
      there:
        cmd: {FAKE}
        aliases: [far]
        nodes: [gpu-b]
    """, {"GPUPROXY_NODE": "gpu-a"})
    until("the preload is skipped", lambda: "preload of 'there' skipped" in proxy.output(),
          within=10)
    assert "node(s) gpu-b" in proxy.output()

    chat = proxy.http.post("/v1/chat/completions", json={
        "model": "far", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code in (404, 503), chat.text
    assert "gpu-b" in chat.json()["error"]["message"]

    load = proxy.http.post("/api/models/load/there")
    assert load.status_code == 404, load.text
    error = load.json()["error"]
    assert error["code"] == "model_not_found"
    assert "placed on node(s) gpu-b" in error["message"]

    listed = {m["id"]: m for m in proxy.http.get("/v1/models").json()["data"]}
    assert listed["there"]["meta"]["gpuproxy"]["nodes"] == ["gpu-b"]
    assert "nodes" not in listed["here"]["meta"]["gpuproxy"]

    assert proxy.http.post("/api/models/load/here").status_code == 200  # the local one runs
    assert processes_matching("--model here")
    assert not processes_matching("--model there")
