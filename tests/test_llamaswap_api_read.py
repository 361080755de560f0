"""llama-swap's read API (`/api/metrics/activity`, `/api/metrics/stats`, `/api/version`, `/props`,
`/ui`, `/upstream`) on our data: rows inserted here, the expected answers written by hand from
them (llama-swap's shapes and messages, read from its code and its binary's answers)."""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.test import AsyncClient

from activity import outcomes
from activity.models import RequestLog
from gpuproxy.shell import runtime
from gpuproxy.testing.fakellm.endpoints import FAKE_N_CTX
from gpuproxy.version import version_info
from tests.conftest import FAKE, free_port
from tests.helpers import until

# The in-process tests run on SQLite too (`make test-sqlite`): the stats take another path
# there (no percentile_cont); the serve-based ones need PostgreSQL.
pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
async def client():
    yield AsyncClient()
    await runtime.shutdown()


def row(seconds: float, **kw) -> RequestLog:
    at = T0 + timedelta(seconds=seconds)
    base = {
        "request_id": uuid.uuid4(), "received_at": at, "finished_at": at, "method": "POST",
        "path": "/v1/chat/completions", "model_requested": "alpha", "model": "alpha",
        "status_code": 200, "outcome": outcomes.OK, "priority": 0, "band": "normal",
        "scheduler": "serial", "client": "127.0.0.1",
    }
    base.update(kw)
    return RequestLog(**base)


async def seed(rows: list[RequestLog]) -> list[int]:
    def create() -> list[int]:
        return [r.id for r in RequestLog.objects.bulk_create(rows)]
    return await runtime.run_db(create)


async def get(client, path: str, **params) -> dict:
    r = await client.get(path, params)
    assert r.status_code == 200, r.content
    return r.json()


# ---- /api/metrics/activity --------------------------------------------------------------------

async def test_a_row_in_llamaswaps_shape(client):
    rid = uuid.UUID("00000000-0000-0000-0000-0000000000a1")
    (pk,) = await seed([row(0.25, request_id=rid, stream=True, priority=7, band="interactive",
                            prompt_tokens=12, completion_tokens=34, cached_tokens=5,
                            prompt_tps=100.5, generation_tps=20.25, duration_ms=1234.6,
                            queue_wait_ms=1.5, ttft_ms=80.0)])
    body = await get(client, "/api/metrics/activity")
    assert body == {"page": 1, "limit": 25, "total": 1, "total_pages": 1, "data": [{
        "id": pk,
        "timestamp": "2026-03-01T12:00:00.250Z",
        "model": "alpha",
        "req_path": "/v1/chat/completions",
        "resp_content_type": "text/event-stream",
        "resp_status_code": 200,
        "tokens": {"cache_tokens": 5, "draft_tokens": -1, "draft_acc_tokens": -1,
                   "input_tokens": 12, "output_tokens": 34, "prompt_per_second": 100.5,
                   "tokens_per_second": 20.25},
        "duration_ms": 1235,
        "has_capture": False,
        "metadata": {"fifo_priority": "7", "outcome": "ok", "band": "interactive",
                     "scheduler": "serial", "model_requested": "alpha",
                     "request_id": "00000000-0000-0000-0000-0000000000a1",
                     "queue_wait_ms": "1.500", "ttft_ms": "80.000"},
    }]}


async def test_unknown_values_are_minus_one_and_errors_are_named(client):
    await seed([row(0, model="", model_requested="nope", status_code=404,
                    outcome=outcomes.UNKNOWN_MODEL, error="model 'nope' is not defined",
                    band="", scheduler="")])
    (entry,) = (await get(client, "/api/metrics/activity"))["data"]
    assert entry["model"] == "nope"  # what was asked for, as llama-swap records it
    assert entry["resp_content_type"] == ""
    assert entry["error_msg"] == "model 'nope' is not defined"
    assert entry["duration_ms"] == -1
    assert set(entry["tokens"].values()) == {-1}
    assert entry["metadata"] == {"fifo_priority": "0", "outcome": "unknown_model",
                                 "model_requested": "nope",
                                 "request_id": entry["metadata"]["request_id"]}


async def test_pages_newest_id_first(client):
    ids = await seed([row(i) for i in range(30)])
    first = await get(client, "/api/metrics/activity")
    assert [d["id"] for d in first["data"]] == ids[::-1][:25]
    assert (first["total"], first["total_pages"], first["limit"]) == (30, 2, 25)
    second = await get(client, "/api/metrics/activity", page=2)
    assert [d["id"] for d in second["data"]] == ids[4::-1]
    past = await get(client, "/api/metrics/activity", page=3)
    assert past["data"] == [] and past["page"] == 3 and past["total"] == 30
    exact = await get(client, "/api/metrics/activity", limit=10, page=3)
    assert [d["id"] for d in exact["data"]] == ids[9::-1] and exact["total_pages"] == 3
    one = await get(client, "/api/metrics/activity", limit=999)
    assert len(one["data"]) == 30 and one["total_pages"] == 1


async def test_sorting(client):
    a, b, c, d = await seed([
        row(3, prompt_tokens=50, path="/v1/embeddings"),
        row(1, prompt_tokens=None),
        row(2, prompt_tokens=50),
        row(0, prompt_tokens=10),
    ])

    async def ids(**params) -> list[int]:
        return [e["id"] for e in (await get(client, "/api/metrics/activity", **params))["data"]]

    # ties broken by id the same way; an unknown count (-1) is the smallest
    assert await ids(sort="prompt") == [c, a, d, b]
    assert await ids(sort="prompt", order="asc") == [b, d, a, c]
    assert await ids(sort="time", order="ASC") == [d, b, c, a]
    assert await ids(sort="req_path", order="asc") == [b, c, d, a]
    assert await ids(order="asc") == [a, b, c, d]


async def test_filters(client):
    a, b, c, d, e = await seed([
        row(0), row(10, model="beta", model_requested="b1"), row(20),
        row(30, model="", model_requested="nope", outcome=outcomes.UNKNOWN_MODEL),
        row(40, model="gamma"),
    ])

    async def ids(*params) -> list[int]:
        r = await client.get("/api/metrics/activity?" + "&".join(params))
        assert r.status_code == 200, r.content
        return [x["id"] for x in r.json()["data"]]

    assert await ids("model=alpha") == [c, a]
    assert await ids("model=beta", "model=nope", "model=") == [d, b]
    assert await ids("model=b1") == []  # the resolved id, not the alias asked for
    # start and end inclusive, offsets honoured; `+` unencoded arrives as a space
    assert await ids("start=2026-03-01T12:00:10Z", "end=2026-03-01T12:00:30Z") == [d, c, b]
    assert await ids("start=2026-03-01T13:00:20+01:00") == [e, d, c]
    assert await ids(f"min_id={b}", f"max_id={d}") == [d, c, b]
    assert await ids(f"min_id={d}", "model=alpha") == []
    body = (await client.get("/api/metrics/activity?model=alpha&limit=1")).json()
    assert (body["total"], body["total_pages"]) == (2, 2)


@pytest.mark.parametrize(("query", "param", "message"), [
    ("limit=0", "limit", "limit must be between 1 and 999"),
    ("limit=1000", "limit", "limit must be between 1 and 999"),
    ("limit=x", "limit", "invalid limit"),
    ("page=0", "page", "page must be >= 1"),
    ("page=two", "page", "page must be >= 1"),
    ("sort=score", "sort", "invalid sort column"),
    ("order=up", "order", "order must be asc or desc"),
    ("start=2026-03-01", "start", "invalid 'start' timestamp, use RFC3339 format"),
    ("end=2026-03-01T12:00:00", "end", "invalid 'end' timestamp, use RFC3339 format"),
    ("start=2026-03-02T00:00:00Z&end=2026-03-01T00:00:00Z", "start", "start must be before end"),
    ("min_id=0", "min_id", "min_id must be >= 1"),
    ("max_id=-3", "max_id", "max_id must be >= 1"),
    ("min_id=5&max_id=2", "min_id", "min_id must be <= max_id"),
    ("model=a%00b", "model", "model='a\\x00b' contains a NUL character"),
])
async def test_bad_parameters(client, query, param, message):
    r = await client.get("/api/metrics/activity?" + query)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith(message), error
    assert (error["param"], error["code"], error["type"]) == (
        param, "invalid_parameter", "invalid_request_error")


async def test_total_is_capped_on_a_big_filtered_table(client, monkeypatch):
    """The count stops at the cap (the admin's, for millions of rows); the pages still read."""
    monkeypatch.setattr("activity.admin.COUNT_CAP", 3)
    ids = await seed([row(i) for i in range(5)])
    body = await get(client, "/api/metrics/activity", model="alpha", limit=2, page=3)
    assert (body["total"], body["total_pages"]) == (3, 2)
    assert [e["id"] for e in body["data"]] == [ids[0]]


# ---- /api/metrics/stats -------------------------------------------------------------------------

EMPTY_STATS = {"total_requests": 0, "total_input_tokens": 0, "total_output_tokens": 0,
               "total_cache_tokens": 0, "prompt_histogram": None, "gen_histogram": None}


async def test_stats_of_an_empty_log(client):
    assert await get(client, "/api/metrics/stats") == EMPTY_STATS


async def test_stats_by_hand(client):
    await seed([
        row(0, prompt_tps=10, generation_tps=7.5, prompt_tokens=1, completion_tokens=2,
            cached_tokens=4),
        row(1, prompt_tps=20, generation_tps=7.5, prompt_tokens=10, completion_tokens=20,
            cached_tokens=0),
        row(2, prompt_tps=30, prompt_tokens=100),
        row(3, prompt_tps=40, generation_tps=0),
        row(4, prompt_tps=100),
        row(5, prompt_tps=0),  # not reported: in no histogram
        row(6, model="beta", prompt_tps=1000, generation_tps=3, prompt_tokens=1000,
            completion_tokens=1, cached_tokens=6),
    ])
    alpha = await get(client, "/api/metrics/stats", model="alpha")
    # five speeds 10, 20, 30, 40, 100: max(5, ceil(log2 5) + 1) = 5 bins of (100 - 10) / 5 = 18;
    # 10, 20 -> bin 0; 30, 40 -> bin 1; 100 -> 5, the last (4). Ranks p * 4: 2 -> 30;
    # 3.8 -> 40 + 0.8 * 60 = 88; 3.96 -> 40 + 0.96 * 60 = 97.6.
    assert alpha == {
        "total_requests": 6, "total_input_tokens": 111, "total_output_tokens": 22,
        "total_cache_tokens": 4,
        "prompt_histogram": {"bins": [2, 2, 0, 0, 1], "min": 10.0, "max": 100.0,
                             "binSize": 18.0, "p50": 30.0, "p95": pytest.approx(88.0),
                             "p99": pytest.approx(97.6)},
        "gen_histogram": {"bins": [2], "min": 7.5, "max": 7.5, "binSize": 0.0, "p50": 7.5,
                          "p95": 7.5, "p99": 7.5},
    }
    everything = await get(client, "/api/metrics/stats")
    assert (everything["total_requests"], everything["total_input_tokens"],
            everything["total_cache_tokens"]) == (7, 1111, 10)
    # 10, 20, 30, 40, 100, 1000: six values, 5 bins of 198: 10..100 in bin 0, 1000 in the last
    assert everything["prompt_histogram"]["bins"] == [5, 0, 0, 0, 1]
    assert everything["gen_histogram"]["bins"] == [1, 0, 0, 0, 2]
    assert await get(client, "/api/metrics/stats", model="nobody") == EMPTY_STATS


async def test_stats_bin_count_grows_with_the_rows(client):
    """Sturges: 40 values -> ceil(log2 40) + 1 = 7 bins; 100000 would be 18; capped at 20."""
    await seed([row(i, generation_tps=float(i + 1)) for i in range(40)])
    gen = (await get(client, "/api/metrics/stats"))["gen_histogram"]
    # 1..40 in 7 bins of 39 / 7: bin k holds values v with floor((v - 1) * 7 / 39) == k
    assert gen["bins"] == [6, 6, 5, 6, 5, 6, 6]
    assert (gen["min"], gen["max"]) == (1.0, 40.0)
    assert gen["binSize"] == pytest.approx(39 / 7)
    assert gen["p50"] == pytest.approx(20.5)


# ---- /api/version, /ui, /upstream -------------------------------------------------------------

async def test_version(client):
    body = await get(client, "/api/version")
    assert set(body) == {"version", "commit", "build_date"}
    assert body == version_info()


@pytest.mark.parametrize("path", ["/ui", "/ui/", "/ui/models", "/ui/index.html", "/upstream"])
async def test_llamaswap_ui_paths_lead_to_the_dashboard(client, path):
    r = await client.get(path)
    assert r.status_code == 302 and r["Location"] == "/"


@pytest.mark.parametrize("path", ["/ui/", "/upstream"])
async def test_ui_redirect_only_reads(path):
    # With CSRF enforced, as for a real client: its refusal would be an HTML page.
    r = await AsyncClient(enforce_csrf_checks=True).post(path)
    assert r.status_code == 405 and r["Allow"] == "GET, HEAD"
    assert r.json()["error"]["code"] == "method_not_allowed"


# ---- through `serve`: /props, keys ---------------------------------------------------------------

ADMIN_KEY = "sk-ops-41c2"
USER_KEY = "sk-user-93d0"


def config(start: int, keys: bool = False) -> str:
    text = f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      alpha:
        cmd: {FAKE}
        aliases: [a]
      beta:
        cmd: {FAKE}
    """
    if keys:
        digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
        text += f"""
    apiKeys: ["{USER_KEY}"]
    apiKeyHashes:
      - {{name: ops, sha256: "{digest}", admin: true}}
    """
    return text


@pytest.mark.postgres
def test_props_loads_the_model_and_relays_its_answer(serve):
    sp = free_port()
    proxy = serve(config(sp))
    r = proxy.http.get("/props", params={"model": "a", "x": "1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["default_generation_settings"]["n_ctx"] == FAKE_N_CTX
    assert body["model"] == "alpha" and r.headers["x-fake-served-by"] == f"alpha:{sp}"
    assert body["query"] == "model=a&x=1"  # the query string as the client sent it
    assert [m["model"] for m in proxy.http.get("/running").json()["running"]] == ["alpha"]
    # a read of a model's server, not an inference request: not in the activity log
    proxy.http.post("/v1/chat/completions", json={"model": "alpha", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "x"}]})
    rows = until("the chat's row", lambda: proxy.http.get("/api/metrics/activity").json()["data"])
    assert [e["req_path"] for e in rows] == ["/v1/chat/completions"]


@pytest.mark.postgres
def test_props_refusals(serve):
    proxy = serve(config(free_port()))
    r = proxy.http.get("/props")
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_model"
    r = proxy.http.get("/props", params={"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = proxy.http.post("/props", params={"model": "alpha"}, json={})
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    assert proxy.http.get("/running").json()["running"] == []


@pytest.mark.postgres
def test_who_may_read(serve):
    """The activity log is for admin keys (docs/security.md); the version and a model's props
    for any key."""
    proxy = serve(config(free_port(), keys=True))
    user = {"Authorization": f"Bearer {USER_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for path in ("/api/metrics/activity", "/api/metrics/stats"):
        assert proxy.http.get(path).status_code == 401
        r = proxy.http.get(path, headers=user)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert proxy.http.get(path, headers=admin).status_code == 200
    assert proxy.http.get("/api/version").status_code == 401
    # (the serve process read the commit at its start: another may have come since)
    assert proxy.http.get("/api/version", headers=user).json()["version"] == (
        version_info()["version"])
    assert proxy.http.get("/props", params={"model": "beta"}).status_code == 401
    assert proxy.http.get("/props", params={"model": "beta"}, headers=user).status_code == 200
