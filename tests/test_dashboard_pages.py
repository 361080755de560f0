"""The Performance, Logs, Captures and About pages without a browser: who may open them and
their endpoints (staff only), what they answer with monitoring or captures off, and the
helpers that shape what they show (a capture's bodies, the about page's lines). The pages
in a real browser against a real proxy: tests/test_browser_pages.py."""

from __future__ import annotations

import base64
import datetime as dt
import json
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import User
from django.test import Client

from dashboard.pages import about, captures, performance
from gpuproxy.shell import runtime
from scheduling.catalog import Catalog

PAGES = ["/dashboard/performance", "/dashboard/logs", "/dashboard/captures",
         "/dashboard/about"]
ENDPOINTS = ["/dashboard/performance/data", "/dashboard/logs/feed?source=proxy",
             "/dashboard/captures/list", "/dashboard/captures/7"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def stub_port(monkeypatch: pytest.MonkeyPatch):
    """The running proxy as the pages read it, with the catalog a test gives it."""
    def use(catalog: Catalog) -> None:
        async def port() -> SimpleNamespace:
            return SimpleNamespace(catalog=catalog)

        monkeypatch.setattr(runtime, "port", port)

    return use


# ---- who may see them ----------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("who", ["anonymous", "not staff"])
def test_the_pages_send_anyone_but_staff_to_the_login_and_the_endpoints_refuse(who):
    client = Client()
    if who == "not staff":
        client.force_login(User.objects.create_user("visitor", password="pw"))
    for url in PAGES:
        r = client.get(url)
        assert r.status_code == 302, url
        assert r["Location"] == f"/admin/login/?next={url}", url
    for url in ENDPOINTS:
        r = client.get(url)
        assert r.status_code == 403, url
        assert r.json()["error"]["code"] == "staff_required", url
        assert r.json()["error"]["message"] == "log in as staff (the admin's login) to read this"


@pytest.mark.django_db
def test_staff_without_the_view_permissions_read_no_activity_and_no_capture(stub_port):
    """Captures hold whole prompts and answers, the log who asked what: a staff member
    needs the permission the admin's own pages ask for, as an API caller needs an admin key."""
    stub_port(Catalog(capture_buffer_mb=5))
    client = Client()
    clerk = User.objects.create_user("clerk", password="pw", is_staff=True)
    client.force_login(clerk)
    for url in ("/dashboard/captures/list", "/dashboard/captures/7",
                "/dashboard/activity/rows", "/dashboard/activity/stats"):
        r = client.get(url)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "permission_required"), url
    from django.contrib.auth.models import Permission

    clerk.user_permissions.add(Permission.objects.get(codename="view_requestlog"),
                               Permission.objects.get(codename="view_capture"))
    client.force_login(User.objects.get(pk=clerk.pk))  # a fresh user: no cached permissions
    assert client.get("/dashboard/activity/rows").status_code == 200
    assert client.get("/dashboard/captures/list").status_code == 200


# ---- monitoring and captures off -----------------------------------------------------------

@pytest.mark.django_db
def test_with_monitoring_and_captures_off_the_endpoints_say_so_and_the_page_says_how(
        stub_port):
    stub_port(Catalog(performance_monitoring=False, capture_buffer_mb=0))
    client = Client()
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    r = client.get("/dashboard/performance/data")
    assert (r.status_code, r.json()) == (503, {"enabled": False})
    for url in ("/dashboard/captures/list", "/dashboard/captures/7"):
        r = client.get(url)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == (
            "capture not found: captures are off (captureBuffer: 0)")
    page = client.get("/dashboard/captures").content.decode()
    assert 'data-testid="captures-off"' in page
    assert "<code>captureBuffer: 5</code>" in page
    assert 'data-testid="capture-rows"' not in page


@pytest.mark.django_db
def test_the_performance_endpoint_refuses_an_after_without_its_offset(stub_port):
    stub_port(Catalog(performance_monitoring=True))
    client = Client()
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    r = client.get("/dashboard/performance/data?after=2026-01-02T15:04:05")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "after"
    assert "RFC 3339" in r.json()["error"]["message"]


@pytest.mark.django_db
def test_the_log_feed_refuses_a_source_that_is_no_model(stub_port):
    stub_port(Catalog())
    client = Client()
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    r = client.get("/dashboard/logs/feed?source=nope")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "no log for 'nope': not 'proxy', a model id or an "
                                            "alias", "type": "invalid_request_error",
                                 "param": None, "code": "unknown_log_source"}


def test_parse_after_reads_rfc3339_as_the_api_does():
    assert performance.parse_after("") is None
    assert performance.parse_after("2026-01-02T15:04:05.250Z") == dt.datetime(
        2026, 1, 2, 15, 4, 5, 250000, tzinfo=dt.UTC)
    assert performance.parse_after("2026-01-02T16:04:05+01:00") == dt.datetime(
        2026, 1, 2, 15, 4, 5, tzinfo=dt.UTC)
    for bad in ("2026-01-02T15:04:05", "yesterday"):
        with pytest.raises(ValueError):
            performance.parse_after(bad)


# ---- a capture's bodies --------------------------------------------------------------------

def test_a_json_body_is_pretty_printed():
    shown = captures.body(b64(b'{"model":"coder","n":[1,2]}'),
                          {"Content-Type": "application/json"})
    assert shown == {"kind": "json", "size": 27,
                     "text": '{\n  "model": "coder",\n  "n": [\n    1,\n    2\n  ]\n}'}


def test_an_sse_body_is_shown_as_events_and_the_streamed_answer_put_back_together():
    raw = (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
           b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n: keep-alive\n\n'
           b'event: error\ndata: oops\n\n'
           b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\ndata: [DONE]\n\n')
    shown = captures.body(b64(raw), {"Content-Type": "text/event-stream"})
    assert shown["kind"] == "sse" and shown["size"] == len(raw)
    assert shown["answer"] == "Hello"
    assert shown["events"] == [
        {"event": "message", "data": '{"choices": [{"delta": {"role": "assistant"}}]}',
         "json": True},
        {"event": "message", "data": '{"choices": [{"delta": {"content": "Hel"}}]}',
         "json": True},
        {"event": "comment", "data": "keep-alive", "json": False},
        {"event": "error", "data": "oops", "json": False},
        {"event": "message", "data": '{"choices": [{"delta": {"content": "lo"}}]}',
         "json": True},
        {"event": "message", "data": "[DONE]", "json": False},
    ]
    # recognised by its first line when the header says nothing; Anthropic's deltas too
    anthropic = (b'event: content_block_delta\ndata: {"type": "content_block_delta", '
                 b'"delta": {"type": "text_delta", "text": "Hi"}}\n\n')
    shown = captures.body(b64(anthropic), None)
    assert (shown["kind"], shown["answer"]) == ("sse", "Hi")
    assert shown["events"][0]["event"] == "content_block_delta"


def test_binary_empty_missing_and_plain_text_bodies():
    assert captures.body(b64(b"\xff\xd8\xff\xe0\x00\x10JFIF"), {"Content-Type": "image/jpeg"}
                         ) == {"kind": "binary", "size": 10, "content_type": "image/jpeg"}
    assert captures.body(b64(b""), {}) == {"kind": "empty", "size": 0}
    assert captures.body(None, {})["kind"] == "none"
    assert captures.body(b64("héllo <b>".encode()), {"Content-Type": "text/plain"}) == {
        "kind": "text", "size": 10, "text": "héllo <b>"}
    assert captures.body("%%%", {})["kind"] == "binary"


def test_present_keeps_the_stored_headers_and_shapes_both_bodies():
    stored = {"id": 7, "req_path": "/v1/chat/completions",
              "req_headers": {"Authorization": "[REDACTED]", "Content-Type": "application/json"},
              "req_body": b64(b'{"x":1}'), "resp_headers": {"Content-Type": "text/plain"},
              "resp_body": None}
    shown = captures.present(stored)
    assert shown["id"] == 7 and shown["req_path"] == "/v1/chat/completions"
    assert shown["request"]["headers"]["Authorization"] == "[REDACTED]"
    assert shown["request"]["body"] == {"kind": "json", "size": 7, "text": '{\n  "x": 1\n}'}
    assert shown["response"]["body"]["kind"] == "none"
    json.dumps(shown)  # what the endpoint sends


# ---- the about page's lines ----------------------------------------------------------------

def test_the_scheduler_summary_reads_the_catalog_in_force():
    catalog = Catalog(scheduler="fifo", swap_affinity_bonus=20, aging_divisor=30.0,
                      max_waiting=100, max_waiting_per_band={"batch": 5, "normal": 0},
                      queue_timeout=2.5, performance_monitoring=False, capture_buffer_mb=5,
                      api_keys={"h1": "a", "h2": "b"}, admin_keys=frozenset({"h1"}))
    assert dict(about.scheduler_summary(catalog)) == {
        "scheduler": "fifo", "swap affinity bonus": "20", "aging divisor": "30 s",
        "router": "group", "queue cap": "100", "queue cap per band": "batch 5",
        "queue timeout": "2.5 s", "models": "0", "performance monitoring": "off",
        "capture buffer": "5 MB", "API keys": "2 (1 admin)"}


def test_the_machine_lines_from_a_hardware_snapshot():
    snapshot = {
        "cpu": {"model": "AMD EPYC 7763", "physical_core_count": 64,
                "logical_thread_count": 128},
        "memory": {"capacity_bytes": 512 * 1024 ** 3},
        "operating_system": {"family": "linux", "name": "debian", "version": "12",
                             "kernel": "6.1.0"},
        "architecture": {"name": "x86_64"},
        "accelerators": [{"index": 0, "vendor": "NVIDIA", "model": "H100 80GB HBM3",
                          "memory": {"capacity_bytes": 80 * 1024 ** 3},
                          "driver": {"name": "NVIDIA", "version": "550.54"}}],
    }
    assert about.machine(snapshot) == [
        ("CPU", "AMD EPYC 7763 · 64 cores, 128 threads"),
        ("memory", "512.0 GiB"),
        ("system", "debian 12 6.1.0"),
        ("architecture", "x86_64"),
        ("GPU 0", "NVIDIA H100 80GB HBM3 · 80.0 GiB · driver 550.54"),
    ]
    bare = about.machine({"accelerators": []})
    assert ("GPUs", "none found (no nvidia-smi, or it lists none)") in bare
    assert ("memory", "unknown") in bare
