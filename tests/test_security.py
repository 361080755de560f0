"""What docs/security.md promises, checked on a real `gpuproxy serve`: keys guard every
endpoint but /health (the upstream passthrough and the logs too), a key never appears in a
log or the activity log, and response headers name gpuproxy, not the stack or the upstream."""

from __future__ import annotations

import hashlib

import pytest

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-secret-4f8a1c9e2b7d"


@pytest.fixture
def proxy(serve):
    return serve(f"""
    startPort: {free_port()}
    apiKeyHashes:  # an admin key, so /logs below is read, not refused
      - {{name: ops, sha256: "{hashlib.sha256(KEY.encode()).hexdigest()}", admin: true}}
    models:
      solo:
        cmd: {FAKE}
    """)


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/running"), ("GET", "/logs"), ("GET", "/logs/stream/solo"), ("GET", "/metrics"),
    ("GET", "/api/queue"), ("GET", "/api/activity"), ("GET", "/api/fleet"),
    ("POST", "/api/models/load/solo"),
    ("POST", "/api/models/unload"), ("GET", "/upstream/solo/health"), ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions")])
def test_every_endpoint_but_health_needs_the_key(proxy, method, path):
    r = proxy.http.request(method, path, json={"model": "solo", "messages": []})
    assert r.status_code == 401, (path, r.text)
    assert r.json()["error"]["type"] == "authentication_error"
    assert proxy.http.get("/health").status_code == 200


def test_a_key_is_never_logged_nor_stored(proxy):
    r = proxy.http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 200
    r = proxy.http.post("/v1/chat/completions", headers={"Authorization": "Bearer wrong-key"},
                        json={"model": "solo", "max_tokens": 1, "messages": []})
    assert r.status_code == 401
    rows = until("both requests logged", lambda: list(RequestLog.objects.all())
                 if RequestLog.objects.count() == 2 else None)
    for row in rows:
        assert KEY not in " ".join(str(v) for v in row.__dict__.values())
    logs = proxy.http.get("/logs", headers={"Authorization": f"Bearer {KEY}"})
    assert logs.status_code == 200 and "solo" in logs.text
    assert KEY not in logs.text and KEY not in proxy.output()


def test_headers_name_gpuproxy_not_the_stack_or_the_upstream(proxy):
    auth = {"Authorization": f"Bearer {KEY}"}
    django = proxy.http.get("/health")
    assert django.headers["server"] == "gpuproxy"
    assert django.headers["x-content-type-options"] == "nosniff"
    relayed = proxy.http.post("/v1/chat/completions", headers=auth,
                              json={"model": "solo", "max_tokens": 1, "messages": []})
    assert relayed.status_code == 200
    assert relayed.headers.get("server") == "gpuproxy"  # not the upstream's "fakellm"
