"""The playground's session path on /v1/* (gpuproxy/proxy/staff_session.py) against a real
`gpuproxy serve` with API keys: a staff session is accepted only with a valid CSRF token and
this proxy's Origin, never alone; a non-staff session never; the API key path as before.

The requests carry a body, so the edge's head check (gpuproxy/proxy/edge.py) is crossed too.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from django.contrib.auth.models import User

from activity.models import RequestLog
from tests.conftest import FAKE, free_port
from tests.helpers import one_model, until

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-playground-1"
BODY = {"model": "solo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def logged_in(base: str, username: str) -> httpx.Client:
    """A client holding a session and a csrftoken cookie, through the admin's login form."""
    c = httpx.Client(base_url=base, timeout=60, trust_env=False)
    form = c.get("/admin/login/")
    token = form.text.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    r = c.post("/admin/login/?next=/admin/", data={
        "username": username, "password": "pw", "csrfmiddlewaretoken": token,
        "next": "/admin/"})
    assert r.status_code == 302, r.text  # a redirect: logged in
    assert "sessionid" in c.cookies and "csrftoken" in c.cookies
    return c


def chat(c: httpx.Client, **headers: str) -> httpx.Response:
    return c.post("/v1/chat/completions", content=json.dumps(BODY),
                  headers={"Content-Type": "application/json", **headers})


def test_staff_session_needs_csrf_and_origin_non_staff_never_keys_unchanged(serve):
    User.objects.create_user("root", password="pw", is_staff=True)
    User.objects.create_user("someone", password="pw", is_staff=True)
    proxy = serve(one_model(free_port(), extra=f"apiKeys: [{KEY}]"))
    staff = logged_in(proxy.base, "root")
    token = staff.cookies["csrftoken"]

    # the session alone, or with the token but no Origin, or a wrong token: refused
    for headers in ({}, {"Origin": proxy.base}, {"X-CSRFToken": token},
                    {"X-CSRFToken": "x" * 32, "Origin": proxy.base}):
        r = chat(staff, **headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    # the right token from another origin (another port of this host: the same site, so
    # the browser sends the cookies): refused
    r = chat(staff, **{"X-CSRFToken": token, "Origin": "http://127.0.0.1:1"})
    assert r.status_code == 401, r.text

    # staff, token and Origin: served, logged as the person
    r = chat(staff, **{"X-CSRFToken": token, "Origin": proxy.base})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    row = until("the staff row", lambda: RequestLog.objects.filter(
        client="staff:root", status_code=200).first())
    assert row.path == "/v1/chat/completions"

    # the session path is for inference only: the admin-key paths stay closed to it
    r = staff.post("/upstream/solo/v1/chat/completions", content=json.dumps(BODY),
                   headers={"X-CSRFToken": token, "Origin": proxy.base})
    assert r.status_code == 401, r.text

    # a user who is not staff cannot log in to the admin; give them a session another way:
    # log in while staff, then lose the flag. The same request is refused from then on.
    User.objects.filter(username="someone").update(is_staff=True)
    other = logged_in(proxy.base, "someone")
    User.objects.filter(username="someone").update(is_staff=False)
    r = chat(other, **{"X-CSRFToken": other.cookies["csrftoken"], "Origin": proxy.base})
    assert r.status_code == 401, r.text

    # the API key path, unchanged: no cookies, the key's name as the client
    plain = httpx.Client(base_url=proxy.base, timeout=60, trust_env=False)
    assert chat(plain).status_code == 401
    r = chat(plain, Authorization=f"Bearer {KEY}")
    assert r.status_code == 200, r.text
    name = "config-" + hashlib.sha256(KEY.encode()).hexdigest()[:8]
    until("the key's row", lambda: RequestLog.objects.filter(client=name,
                                                              status_code=200).first())
    assert RequestLog.objects.filter(client__startswith="staff:").count() == 1
    for c in (staff, other, plain):
        c.close()


def test_the_session_and_its_token_are_not_sent_upstream(serve):
    User.objects.create_user("root", password="pw", is_staff=True)
    start = free_port()
    proxy = serve(one_model(start, extra=f"apiKeys: [{KEY}]"))
    staff = logged_in(proxy.base, "root")
    token = staff.cookies["csrftoken"]
    r = chat(staff, **{"X-CSRFToken": token, "Origin": proxy.base, "X-Marker": "seen"})
    assert r.status_code == 200, r.text
    seen = httpx.get(f"http://127.0.0.1:{start}/fake/last-body", timeout=10).json()["headers"]
    assert seen.get("x-marker") == "seen"  # the headers are the request's
    assert "cookie" not in seen and "x-csrftoken" not in seen


def test_the_proxys_cookies_never_reach_an_upstream_whatever_the_verdict(serve):
    """A model that is sent the client's key (`forwardApiKey`), a stale CSRF token without
    keys, the `/upstream/` passthrough a model's web UI uses: the admin's session and CSRF
    cookies and the token header stay here; the upstream's own cookies still go."""
    User.objects.create_user("root", password="pw", is_staff=True)
    start = free_port()
    proxy = serve(f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE}
        metadata: {{gpuproxy: {{forwardApiKey: true}}}}
    """)
    staff = logged_in(proxy.base, "root")
    staff.cookies.set("upstream_pref", "dark")

    def seen() -> dict:
        return httpx.get(f"http://127.0.0.1:{start}/fake/last-body", timeout=10).json()[
            "headers"]

    for headers in ({"X-CSRFToken": staff.cookies["csrftoken"], "Origin": proxy.base},
                    {"X-CSRFToken": "x" * 32, "Origin": proxy.base}):  # stale: no session
        assert chat(staff, **headers).status_code == 200
        got = seen()
        assert "x-csrftoken" not in got, got
        assert got.get("cookie") == "upstream_pref=dark", got
    r = staff.post("/upstream/solo/v1/chat/completions", content=json.dumps(BODY))
    assert r.status_code == 200, r.text
    got = seen()
    assert got.get("cookie") == "upstream_pref=dark", got
    staff.close()


def test_without_keys_a_staff_session_is_named_and_its_cookie_kept_from_the_upstream(serve):
    User.objects.create_user("root", password="pw", is_staff=True)
    start = free_port()
    proxy = serve(one_model(start))
    staff = logged_in(proxy.base, "root")
    r = chat(staff, **{"X-CSRFToken": staff.cookies["csrftoken"], "Origin": proxy.base})
    assert r.status_code == 200, r.text
    seen = httpx.get(f"http://127.0.0.1:{start}/fake/last-body", timeout=10).json()["headers"]
    assert "cookie" not in seen and "x-csrftoken" not in seen
    until("the staff row", lambda: RequestLog.objects.filter(client="staff:root").first())
    # a wrong token is no staff session, and the open API serves it as anyone's
    r = chat(staff, **{"X-CSRFToken": "x" * 32, "Origin": proxy.base})
    assert r.status_code == 200, r.text
    rows = until("both rows", lambda: list(RequestLog.objects.order_by("id").values_list(
        "client", flat=True)) if RequestLog.objects.count() == 2 else None)
    assert rows[0] == "staff:root" and not rows[1].startswith("staff:"), rows
    staff.close()


def test_the_page_is_for_staff_only(client):
    """Anonymous and non-staff users get the admin's login, staff the page."""
    login = "/admin/login/?next=/dashboard/playground"
    assert client.get("/dashboard/playground")["Location"] == login
    client.force_login(User.objects.create_user("someone", password="pw"))
    assert client.get("/dashboard/playground")["Location"] == login
    client.force_login(User.objects.create_user("root", password="pw", is_staff=True))
    r = client.get("/dashboard/playground")
    assert r.status_code == 200
    assert b'data-testid="lt-timeline"' in r.content
