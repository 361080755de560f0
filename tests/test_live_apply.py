"""A committed save reaches the running proxy at once, from any process, without a restart,
and without cutting off work in flight.

The proxy runs with `GPUPROXY_RELOAD_SECONDS=3600`, so its periodic check cannot be what
applied a change: on PostgreSQL it is the NOTIFY sent by the saving transaction
(scheduling/signals.py); on SQLite, an admin save in the proxy's own process applies through
`transaction.on_commit`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from scheduling.models import ModelDefinition, ProxySettings
from tests.conftest import FAKE, Proxy, free_port
from tests.helpers import Chat, open_gate, running, until

pytestmark = pytest.mark.django_db(transaction=True)

NO_POLLING = {"GPUPROXY_RELOAD_SECONDS": "3600"}


def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
      other:
        cmd: {FAKE}
    groups:
      both:
        swap: false
        members: [solo, other]
    """


def scheduler_of(proxy: Proxy) -> str:
    return proxy.http.get("/api/queue").json()["scheduler"]


@pytest.mark.postgres
def test_a_settings_save_from_another_process_applies_at_once(serve):
    proxy = serve(config(free_port()), extra_env=NO_POLLING)
    assert scheduler_of(proxy) == "serial"
    settings = ProxySettings.load()
    settings.scheduler = "fifo"
    settings.save()  # this test process is "another process" to the proxy
    until("the proxy switched to fifo", lambda: scheduler_of(proxy) == "fifo")


@pytest.mark.postgres
def test_a_model_added_elsewhere_is_served_and_a_deleted_one_gets_404(serve):
    start = free_port()
    proxy = serve(config(start), extra_env=NO_POLLING)
    ModelDefinition.objects.create(
        model_id="newbie", cmd=FAKE.replace("${PORT}", str(start + 5)),
        proxy=f"http://127.0.0.1:{start + 5}")
    until("newbie is listed", lambda: "newbie" in {
        m["id"] for m in proxy.http.get("/v1/models").json()["data"]})
    r = proxy.http.post("/v1/chat/completions",
                        json={"model": "newbie", "max_tokens": 1, "messages": []})
    assert r.status_code == 200 and r.json()["model"] == "newbie"
    ModelDefinition.objects.filter(model_id="newbie").delete()
    until("newbie is unloaded", lambda: "newbie" not in running(proxy))
    r = proxy.http.post("/v1/chat/completions",
                        json={"model": "newbie", "max_tokens": 1, "messages": []})
    assert r.status_code == 404


@pytest.mark.postgres
def test_a_changed_model_restarts_when_idle_never_cutting_off_work(serve):
    start = free_port()
    proxy = serve(config(start), extra_env=NO_POLLING)
    held = Chat(proxy.base, "solo", gate="g1", max_tokens=2)
    until("solo in flight", lambda: proxy.http.get("/api/queue").json()["in_flight"]
          .get("solo") == 1)
    old_pid = running(proxy)["solo"]["pid"]

    d = ModelDefinition.objects.get(model_id="solo")
    d.cmd = d.cmd + " --tps 1000"
    d.save()
    until("the restart is pending", lambda: re.search(
        r'gpuproxy_model_restart_pending\{model="solo"\} 1\.0',
        proxy.http.get("/metrics").text))
    # while it waits, the running process keeps its request and its pid
    assert running(proxy)["solo"]["pid"] == old_pid
    waiting = Chat(proxy.base, "solo", gate="g2")  # arrives meanwhile: waits for the new one
    until("the second request queued", lambda: len(
        proxy.http.get("/api/queue").json()["queued"]) == 1)

    open_gate(start + 1, "g1")  # solo sorts after other: the second port
    held.join(30)
    assert held.status == 200
    new = until("solo restarted", lambda: (m := running(proxy).get("solo"))
                and m["state"] == "ready" and m["pid"] != old_pid and m)
    assert "--tps 1000" in new["cmd"]
    open_gate(start + 1, "g2")  # the new process, on the same port
    waiting.join(30)
    assert waiting.status == 200


@pytest.mark.postgres
def test_disabling_a_model_lets_its_request_finish_then_stops_it(serve):
    start = free_port()
    proxy = serve(config(start), extra_env=NO_POLLING)
    held = Chat(proxy.base, "other", gate="g")
    until("other in flight", lambda: proxy.http.get("/api/queue").json()["in_flight"]
          .get("other") == 1)
    ModelDefinition.objects.filter(model_id="other").update(enabled=False)
    ProxySettings.load().save()  # .update() sends no signal: a save announces it
    until("other is unlisted", lambda: "other" not in {
        m["id"] for m in proxy.http.get("/v1/models").json()["data"]})
    assert running(proxy)["other"]["state"] == "ready"  # still serving its request
    r = proxy.http.post("/v1/chat/completions",
                        json={"model": "other", "max_tokens": 1, "messages": []})
    assert r.status_code == 404
    open_gate(start, "g")  # `other` sorts before `solo`: the first port
    held.join(30)
    assert held.status == 200
    until("other is stopped", lambda: "other" not in running(proxy))


def test_an_admin_save_on_sqlite_applies_through_on_commit(tmp_path: Path):
    """No PostgreSQL, no polling: the admin is served by the proxy's own process, and the
    save's on_commit hook tells the run loop."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(GPUPROXY_DATA_DIR=str(data), **NO_POLLING,
               DJANGO_SUPERUSER_PASSWORD="pw", DJANGO_SUPERUSER_USERNAME="root",
               DJANGO_SUPERUSER_EMAIL="root@example.com")
    gp = str(Path(sys.executable).with_name("gpuproxy"))
    subprocess.run([gp, "migrate", "-v0"], env=env, check=True, cwd=tmp_path)
    subprocess.run([gp, "createsuperuser", "--noinput"], env=env, check=True, cwd=tmp_path)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config(free_port()))
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([gp, "serve", "--config", str(cfg), "--listen",
                             f"127.0.0.1:{port}"], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    proxy = Proxy(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
    try:
        until("serve answers", lambda: _health(proxy), within=60)
        assert scheduler_of(proxy) == "serial"
        h = httpx.Client(base_url=proxy.base, trust_env=False, timeout=30)
        csrf = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
        r = h.get("/admin/login/")
        h.post("/admin/login/?next=/admin/", data={
            "username": "root", "password": "pw", "next": "/admin/",
            "csrfmiddlewaretoken": csrf.search(r.text).group(1)})
        page = h.get("/admin/scheduling/proxysettings/1/change/")
        assert page.status_code == 200, page.text
        form = _form_fields(page.text)
        form["scheduler"] = "fifo"
        r = h.post("/admin/scheduling/proxysettings/1/change/", data=form)
        assert r.status_code == 302, r.text
        until("the proxy switched to fifo", lambda: scheduler_of(proxy) == "fifo", within=10)
    finally:
        proc.terminate()
        proc.wait(30)
        proxy.http.close()


def _health(proxy: Proxy) -> bool:
    try:
        return proxy.http.get("/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return proxy.proc.poll() is not None and pytest.fail(proxy.output())


def _form_fields(page: str) -> dict[str, str]:
    """The change form's current values, as a browser would submit them."""
    fields: dict[str, str] = {}
    for m in re.finditer(r"<input([^>]*)>", page):
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        name = attrs.get("name")
        if not name or attrs.get("type") in ("submit",):
            continue
        if attrs.get("type") == "checkbox":
            if "checked" in m.group(1):
                fields[name] = "on"
            continue
        fields[name] = attrs.get("value", "")
    for m in re.finditer(r'<select name="(\w+)"[^>]*>(.*?)</select>', page, re.S):
        chosen = re.search(r'<option value="([^"]*)"[^>]*selected', m.group(2))
        fields[m.group(1)] = chosen.group(1) if chosen else ""
    for m in re.finditer(r'<textarea name="(\w+)"[^>]*>(.*?)</textarea>', page, re.S):
        fields[m.group(1)] = m.group(2).strip()
    fields["_save"] = "Save"
    return fields
