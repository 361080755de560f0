"""llama-swap's HTTP API, endpoint by endpoint, against the real llama-swap: both started on one
config (three models on the fake upstream, an alias listed with `includeAliasesInList`, an API
key, a group), the same requests sent to both, and compared: status, media type, the headers a
client reads (`Location`, `WWW-Authenticate`), the shape of a JSON body (every path and the
kind of value there, `compat/sidebyside.py`) and the values clients branch on (`object`,
`error.type`, `error.code`, `msg`). Values that must differ (ids, timestamps, `owned_by`,
ports) are not compared.

What llama-swap answers is the expectation. Every difference that remains is deliberate and
listed once, in `ALLOWED_DIFFERENCES` below (rendered in docs/llama-swap.md, "What differs"):
a comparison passes only when what differs is exactly the table's rows for that endpoint, so a
row that stops being true fails too, and the table cannot drift from what is checked.

A comparison for an endpoint not built yet is written from what llama-swap answers and
marked `pytest.mark.xfail(strict=True, reason="issue 18: <endpoint> not built yet")` until it
lands (an xfail that starts passing fails: remove its mark then). Issue 18's endpoints have
all landed: none is marked.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compat.sidebyside import (
    JSON,
    SSE,
    Side,
    media_type,
    read_events,
    shape,
    sse_events,
    start_gpuproxy,
    start_llamaswap,
    values_at,
)
from tests.conftest import FAKE, _worker_counts, database_url, free_port
from tests.helpers import until


@dataclass(frozen=True)
class Difference:
    """One deliberate difference: on `endpoint` (a case's name below, or ERRORS), `what` (the
    status, the media type, a header, or a JSON path) is `ours` here and `theirs` in
    llama-swap (a JSON path's kinds, `absent`, or a value as JSON), because `why`."""

    endpoint: str
    what: str
    ours: str
    theirs: str
    why: str


# `gpuproxy serve` uses this run's test database, which pytest-django creates only for a
# session with a test marked as using it.
pytestmark = pytest.mark.django_db

#: Applies to every answer whose llama-swap body carries its `src` marker.
ERRORS = "every error llama-swap writes itself"

ALLOWED_DIFFERENCES: tuple[Difference, ...] = (
    Difference(ERRORS, "src", "absent", "string",
               "gpuproxy's errors are OpenAI's envelope as OpenAI writes it "
               "(`gpuproxy/proxy/errors.py`); `src: \"llama-swap\"` names the other program"),
    Difference("GET /v1/models", "data[*].meta.gpuproxy", "object", "absent",
               "gpuproxy's own facts about a model go under `meta.gpuproxy`, beside "
               "llama-swap's `meta.llamaswap`, so a client of either reads the same fields"),
    Difference("GET /v1/models", "data[*].meta.gpuproxy.state", "string", "absent",
               "the upstream's state in gpuproxy's words (`starting`, `ready`, `stopping`, "
               "`failed`...), finer than `status.value`"),
    Difference("GET /models", "data[*].meta.gpuproxy", "object", "absent",
               "the same list as /v1/models"),
    Difference("GET /models", "data[*].meta.gpuproxy.state", "string", "absent",
               "the same list as /v1/models"),
    Difference("GET /api/performance", "gpu_stats", "array", "null",
               "no GPU: an empty list, where Go writes its nil slice as null; a client that "
               "iterates it works on both"),
    Difference("GET /api/events", "frame uiConfig", "absent", "sent",
               "llama-swap's `ui.*` settings are not supported (the import warns): there is "
               "no UI configuration to send"),
    Difference("GET /upstream", "location", "/", "/ui/models",
               "gpuproxy's dashboard is at `/` and lists the models first; llama-swap's UI "
               "paths (`/ui/...`) lead there too"),
    Difference("GET /running", "running[].pid", "number", "absent",
               "the upstream's process id, for the operator who must find it (ps, kill, "
               "py-spy); /running shows it to admin keys only"),
    *(Difference("POST /v1/chat/completions (loading stream)", f"loading chunk {what}", kind,
                 "absent", "each loading message is a whole `chat.completion.chunk`, as OpenAI's "
                 "clients expect of every chunk; llama-swap's carries only `choices[].delta`")
      for what, kind in (("id", "string"), ("object", "string"), ("created", "number"),
                         ("model", "string"), ("choices[].index", "number"),
                         ("choices[].finish_reason", "null"))),
    Difference("POST /v1/chat/completions (unknown model)", "error.code",
               '"model_not_found"', '"not_found"',
               "OpenAI's own code for a model that does not exist; the message names "
               "GET /v1/models"),
    Difference("POST /v1/chat/completions (no model)", "status", "400", "404",
               "a request that names no model is the client's mistake (400), not a missing "
               "model; the message says where `model` goes"),
    Difference("POST /v1/chat/completions (no model)", "error.code",
               '"missing_model"', '"not_found"', "as the status: says what is missing"),
    Difference("POST /v1/chat/completions (bad key)", "www-authenticate",
               'Bearer realm="gpuproxy", Basic realm="gpuproxy"', 'Basic realm="llama-swap"',
               "both schemes gpuproxy takes (RFC 6750 Bearer first), in its own realm"),
    Difference("POST /v1/chat/completions (bad key)", "error.code",
               '"invalid_api_key"', '"unauthorized"', "OpenAI's own code for a bad key"),
    Difference("POST /api/models/unload/{model}", "content-type", JSON, "text/plain",
               "JSON like every other management answer: `{\"msg\": \"ok\", \"model\": "
               "<the model an alias named>}` where llama-swap writes `OK`; a client that "
               "checks the status is unaffected"),
    Difference("POST /api/models/unload/{model} (unknown)", "error.code",
               '"model_not_found"', '"not_found"', "the same code as for inference"),
    Difference("GET /logs/stream/{model} (unknown)", "error.code",
               '"unknown_log_source"', '"bad_request"',
               "says what is wrong; the message lists what may follow /logs/stream/"),
    Difference("GET /api/captures/{id} (unknown)", "error.code",
               '"capture_not_found"', '"not_found"',
               "says what was not found; the message says why a capture can be missing"),
    *(Difference(endpoint, what, ours, theirs, why)
      for endpoint in ("POST /v1/messages (unknown model)",
                       "POST /v1/messages/count_tokens (unknown model)",
                       "POST /v1/messages (bad key)")
      for what, ours, theirs, why in (
          # Anthropic's paths answer Anthropic's error shape (issue 18, item 6), which its SDK
          # reads; llama-swap answers them with its OpenAI envelope.
          ("type", "string", "absent",
           "Anthropic's error shape: `{\"type\": \"error\", \"error\": {\"type\", "
           "\"message\"}}`, what the Anthropic SDK parses"),
          ("error.param", "absent", "null", "Anthropic's error shape has no `param`"),
          ("error.code", "absent", "string", "Anthropic's error shape has no `code`"))),
    *(Difference(endpoint, "error.type", '"not_found_error"', '"invalid_request_error"',
                 "Anthropic's type for a 404")
      for endpoint in ("POST /v1/messages (unknown model)",
                       "POST /v1/messages/count_tokens (unknown model)")),
    Difference("POST /v1/messages (bad key)", "www-authenticate",
               'Bearer realm="gpuproxy", Basic realm="gpuproxy"', 'Basic realm="llama-swap"',
               "as for /v1/chat/completions"),
    Difference("GET /v1/models (no key)", "www-authenticate",
               'Bearer realm="gpuproxy", Basic realm="gpuproxy"', 'Basic realm="llama-swap"',
               "as for /v1/chat/completions"),
    Difference("GET /v1/models (no key)", "error.code",
               '"invalid_api_key"', '"unauthorized"', "as for /v1/chat/completions"),
)

#: llama-swap's /metrics series (all from its performance monitor) and gpuproxy's for the
#: same thing, with the same labels; gpuproxy adds its scheduler's, requests', models' and
#: activity log's series (docs/metrics.md), which llama-swap has no equivalent of.
METRIC_NAMES: dict[str, str] = {
    "llamaswap_cpu_util_percent": "gpuproxy_cpu_util_percent",
    "llamaswap_memory_total_bytes": "gpuproxy_memory_total_bytes",
    "llamaswap_memory_used_bytes": "gpuproxy_memory_used_bytes",
    "llamaswap_memory_free_bytes": "gpuproxy_memory_free_bytes",
    "llamaswap_swap_total_bytes": "gpuproxy_swap_memory_total_bytes",
    "llamaswap_swap_used_bytes": "gpuproxy_swap_memory_used_bytes",
    "llamaswap_load_average": "gpuproxy_load_average",
    "llamaswap_network_bytes": "gpuproxy_network_bytes",
    "llamaswap_gpu_temperature_celsius": "gpuproxy_gpu_temperature_celsius",
    "llamaswap_gpu_vram_temperature_celsius": "gpuproxy_gpu_vram_temperature_celsius",
    "llamaswap_gpu_util_percent": "gpuproxy_gpu_util_percent",
    "llamaswap_gpu_memory_util_percent": "gpuproxy_gpu_memory_util_percent",
    "llamaswap_gpu_memory_used_bytes": "gpuproxy_gpu_memory_used_bytes",
    "llamaswap_gpu_memory_total_bytes": "gpuproxy_gpu_memory_total_bytes",
    "llamaswap_gpu_fan_speed_percent": "gpuproxy_gpu_fan_speed_percent",
    "llamaswap_gpu_power_draw_watts": "gpuproxy_gpu_power_draw_watts",
}

KEY = "sk-compat-api-4e1b"
CONFIG = """\
healthCheckTimeout: 30
startPort: {start_port}
apiKeys: ["{key}"]
includeAliasesInList: true
captureBuffer: 5
models:
  chat-a:
    cmd: {fake}
    name: Chat A
    description: the first fake
    aliases: [gpt-a]
    metadata: {{family: fake, size_b: 1}}
    capabilities: {{in: [text, image], out: [text], tools: true, context: 8192}}
  chat-b:
    cmd: {fake}
  embed:
    cmd: {fake}
  slow:
    cmd: {fake} --load-seconds 1.5
    sendLoadingState: true
groups:
  side:
    swap: false
    exclusive: false
    members: [embed]
"""
# gpuproxy's keys are ordinary unless marked admin (docs/security.md, "Which keys are admin
# keys"); llama-swap has one kind of key, which reaches everything. The export of the plain
# key listed beside it, with `admin: true`, makes it the same key on both sides.
ADMIN = """\
apiKeyHashes:
  - {{name: config-{digest8}, sha256: {digest}, admin: true}}
"""

CHAT = {"model": "chat-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MESSAGES = {"model": "chat-a", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
#: The values clients branch on, compared where present on either side.
VALUE_PATHS = ("object", "data[].object", "error.type", "error.code", "msg", "type")


def config(start_port: int, *, admin: bool) -> str:
    text = CONFIG.format(start_port=start_port, key=KEY, fake=FAKE)
    if admin:
        digest = hashlib.sha256(KEY.encode()).hexdigest()
        text += ADMIN.format(digest=digest, digest8=digest[:8])
    return text


@dataclass
class Pair:
    ours: Side
    theirs: Side

    def both(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, ...]:
        return tuple(side.http.request(method, path, **kwargs)
                     for side in (self.ours, self.theirs))


@pytest.fixture(scope="module", params=_worker_counts(), ids=lambda n: f"workers{n}")
def pair(request, llamaswap_bin: Path, tmp_path_factory, django_db_setup,
         django_db_blocker) -> Iterator[Pair]:
    """One llama-swap and one `gpuproxy serve --workers N` for the whole module (starting them
    is most of its time); each comparison sends both sides the same requests, so their state
    stays alike."""
    folder = tmp_path_factory.mktemp(f"sidebyside-{request.param}")
    with django_db_blocker.unblock():
        url = database_url()
    theirs = start_llamaswap(llamaswap_bin, config(free_port(), admin=False),
                             folder / "llama-swap", free_port(), key=KEY)
    try:
        ours = start_gpuproxy(config(free_port(), admin=True), folder / "gpuproxy",
                              free_port(), request.param, url, key=KEY)
    except BaseException:
        theirs.stop()
        raise
    yield Pair(ours, theirs)
    ours.stop()
    theirs.stop()


# ---------------------------------------------------------------------------- the comparison

Finding = tuple[str, str, str]  # (what, ours, theirs)
KEYED = re.compile(r"\[[^\]]+\]")


def _kinds(kinds: set[str] | None) -> str:
    return "|".join(sorted(kinds)) if kinds else "absent"


def findings(mine: httpx.Response, theirs: httpx.Response, case: Case) -> list[Finding]:
    found: list[Finding] = []
    if mine.status_code != theirs.status_code:
        found.append(("status", str(mine.status_code), str(theirs.status_code)))
    if case.only_status:
        return found
    if 300 <= theirs.status_code < 400:
        # a redirect is its Location; the body (Go writes a line of HTML) is for no one
        if mine.headers.get("location") != theirs.headers.get("location"):
            found.append(("location", str(mine.headers.get("location")),
                          str(theirs.headers.get("location"))))
        return found
    ours_type, their_type = media_type(mine), media_type(theirs)
    if ours_type != their_type:
        found.append(("content-type", ours_type, their_type))
    for header in case.headers:
        if mine.headers.get(header) != theirs.headers.get(header):
            found.append((header, str(mine.headers.get(header)),
                          str(theirs.headers.get(header))))
    if ours_type == their_type == JSON:
        found += json_findings(mine.json(), theirs.json(), case)
    elif case.same_text and mine.text != theirs.text:
        found.append(("body", mine.text, theirs.text))
    return found


def json_findings(mine: Any, theirs: Any, case: Case) -> list[Finding]:
    found: list[Finding] = []
    ours_shape = shape(mine, key_by=case.key_by, opaque=case.opaque)
    their_shape = shape(theirs, key_by=case.key_by, opaque=case.opaque)
    for path in sorted(set(ours_shape) | set(their_shape)):
        if ours_shape.get(path) != their_shape.get(path):
            found.append((path, _kinds(ours_shape.get(path)), _kinds(their_shape.get(path))))
    for path in VALUE_PATHS:
        a, b = values_at(mine, path), values_at(theirs, path)
        if a and b and a != b:
            found.append((path, ",".join(a), ",".join(b)))
    return found


def assert_alike(endpoint: str, mine: httpx.Response, theirs: httpx.Response,
                 case: Case | None = None) -> None:
    """The two answers differ exactly by the table's rows for `endpoint`."""
    found = findings(mine, theirs, case or Case(endpoint, "GET", ""))
    body = theirs.json() if media_type(theirs) == JSON else None
    assert_only_allowed(endpoint, found, isinstance(body, dict) and "src" in body,
                        f"ours {mine.status_code}: {mine.text[:500]}\n"
                        f"theirs {theirs.status_code}: {theirs.text[:500]}")


def assert_only_allowed(endpoint: str, found: list[Finding], llamaswap_error: bool = False,
                        detail: str = "") -> None:
    """What differs is exactly the table's rows for `endpoint`: nothing more (a new
    difference) and nothing less (a row no longer true)."""
    # one row covers every item of a list keyed by its ids: `data[chat-a].x` is `data[*].x`
    seen = {(KEYED.sub("[*]", what), a, b) for what, a, b in found}
    rows = [d for d in ALLOWED_DIFFERENCES
            if d.endpoint == endpoint or (llamaswap_error and d.endpoint == ERRORS)]
    allowed = {(d.what, d.ours, d.theirs) for d in rows}
    unexpected, stale = sorted(seen - allowed), sorted(allowed - seen)
    assert not unexpected and not stale, (
        f"{endpoint}: differences not in ALLOWED_DIFFERENCES (what, ours, theirs): "
        f"{unexpected}; rows no longer true: {stale}\n{detail}")


@dataclass(frozen=True)
class Case:
    """One request sent to both, after `before` (requests sent to both first, to bring both
    into the state the comparison needs)."""

    name: str
    method: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    before: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    headers: tuple[str, ...] = ()
    key_by: dict[str, str] = field(default_factory=dict)
    opaque: tuple[str, ...] = ()
    same_text: bool = False
    only_status: bool = False


LOAD_A = ("POST", "/v1/chat/completions", {"json": CHAT})
WRONG_KEY = {"headers": {"Authorization": "Bearer sk-not-a-key"}}
NO_KEY = {"headers": {"Authorization": ""}}


CASES = [
    Case("GET /v1/models", "GET", "/v1/models", key_by={"data": "id"}),
    Case("GET /models", "GET", "/models", key_by={"data": "id"}),
    Case("POST /v1/chat/completions", "POST", "/v1/chat/completions", {"json": CHAT}),
    Case("POST /v1/chat/completions (alias)", "POST", "/v1/chat/completions",
         {"json": {**CHAT, "model": "gpt-a"}}),
    Case("POST /v1/completions", "POST", "/v1/completions",
         {"json": {"model": "chat-a", "prompt": "hi", "max_tokens": 3}}),
    Case("POST /v1/embeddings", "POST", "/v1/embeddings",
         {"json": {"model": "embed", "input": "hi"}}),
    Case("GET /running", "GET", "/running", before=(LOAD_A,)),
    Case("GET /health", "GET", "/health", same_text=True),
    Case("GET /health (no key)", "GET", "/health", NO_KEY, same_text=True),
    Case("GET /v1/models (no key)", "GET", "/v1/models", NO_KEY, headers=("www-authenticate",)),
    Case("POST /v1/chat/completions (unknown model)", "POST", "/v1/chat/completions",
         {"json": {**CHAT, "model": "no-such-model"}}),
    Case("POST /v1/chat/completions (no model)", "POST", "/v1/chat/completions",
         {"json": {"messages": CHAT["messages"]}}),
    Case("POST /v1/chat/completions (bad key)", "POST", "/v1/chat/completions",
         {"json": CHAT, **WRONG_KEY}, headers=("www-authenticate",)),
    Case("GET /logs", "GET", "/logs"),
    Case("GET /logs/stream/{model} (unknown)", "GET", "/logs/stream/no-such-model"),
    Case("GET /upstream/{model}/...", "GET", "/upstream/chat-a/v1/models"),
    Case("GET /upstream/{model}", "GET", "/upstream/chat-a"),
    Case("POST /upstream/{model}", "POST", "/upstream/chat-a", {"json": {}}),
    Case("GET /upstream", "GET", "/upstream"),
    Case("GET /api/version", "GET", "/api/version"),
    Case("GET /api/metrics/activity", "GET", "/api/metrics/activity",
                      before=(LOAD_A,), opaque=("data[].metadata",)),
    Case("GET /api/metrics/stats", "GET", "/api/metrics/stats", before=(LOAD_A,)),
    Case("GET /api/metrics/activity (filtered, sorted)", "GET", "/api/metrics/activity",
         {"params": {"model": "chat-a", "limit": 2, "page": 1, "sort": "duration",
                     "order": "asc"}},
         before=(LOAD_A, LOAD_A, LOAD_A), opaque=("data[].metadata",)),
    Case("GET /api/metrics/stats?model=", "GET", "/api/metrics/stats",
         {"params": {"model": "chat-a"}}, before=(LOAD_A,)),
    Case("GET /api/hardware", "GET", "/api/hardware",
                      # what is detected differs by machine and by detector: the sections only
                      opaque=("architecture", "operating_system", "environment", "cpu",
                              "memory", "accelerators", "capture")),
    Case("POST /api/captures/{id} (wrong method)", "POST", "/api/captures/1",
                      only_status=True),
    Case("POST /api/inflight/{id}/cancel (unknown id)", "POST", "/api/inflight/999999/cancel"),
    Case("GET /api/inflight/{id}/cancel (wrong method)", "GET",
                      "/api/inflight/999999/cancel", only_status=True),
    Case("GET /props?model=", "GET", "/props", {"params": {"model": "chat-a"}},
                      before=(LOAD_A,)),
    Case("POST /v1/messages (unknown model)", "POST", "/v1/messages",
                      {"json": {**MESSAGES, "model": "no-such-model"}}),
    Case("POST /v1/messages (bad key)", "POST", "/v1/messages",
                      {"json": MESSAGES, **WRONG_KEY}, headers=("www-authenticate",)),
    Case("POST /v1/messages/count_tokens (unknown model)", "POST", "/v1/messages/count_tokens",
         {"json": {**MESSAGES, "model": "no-such-model"}}),
    Case("GET /unload", "GET", "/unload", before=(LOAD_A,), same_text=True),
    Case("POST /api/models/unload", "POST", "/api/models/unload", before=(LOAD_A,)),
    Case("POST /api/models/unload/{model}", "POST", "/api/models/unload/chat-a",
         before=(LOAD_A,)),
    Case("POST /api/models/unload/{model} (unknown)", "POST",
         "/api/models/unload/no-such-model"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_both_answer_alike(pair: Pair, case: Case) -> None:
    for method, path, kwargs in case.before:
        for r in pair.both(method, path, **kwargs):
            assert r.status_code == 200, (case.name, path, r.text)
    mine, theirs = pair.both(case.method, case.path, **case.kwargs)
    if case.path.startswith("/api/metrics/"):
        # Our activity rows are written by a batching writer thread: a row of an earlier
        # case may land a moment after its answer (seen under load). Read again until the
        # rows of every request made so far are there, or the comparison fails as it is.
        last = time.monotonic() + 10

        def settled() -> bool:
            nonlocal mine
            if time.monotonic() > last or not _unexpected(case, mine, theirs):
                return True
            mine = pair.both(case.method, case.path, **case.kwargs)[0]
            return False

        until(f"{case.name}: our rows written", settled, within=15)
    assert_alike(case.name, mine, theirs, case)


def _unexpected(case: Case, mine: httpx.Response, theirs: httpx.Response) -> bool:
    """Whether the two answers differ by more than the table allows (for a re-read)."""
    try:
        assert_alike(case.name, mine, theirs, case)
    except AssertionError:
        return True
    return False


def test_chat_streams_alike(pair: Pair) -> None:
    """A streamed chat: the same chunks (each one's shape, in order), `[DONE]` last, and the
    headers that keep a stream unbuffered on the way."""
    body = {**CHAT, "stream": True}
    mine, theirs = pair.both("POST", "/v1/chat/completions", json=body)
    assert (mine.status_code, media_type(mine)) == (theirs.status_code, media_type(theirs)) == (
        200, SSE)
    ours_events, their_events = sse_events(mine.text), sse_events(theirs.text)
    assert their_events[-1] == ours_events[-1] == "[DONE]"
    assert [shape(e) for e in ours_events] == [shape(e) for e in their_events]
    assert [e["object"] for e in ours_events[:-1]] == [e["object"] for e in their_events[:-1]]
    for header in ("x-accel-buffering", "cache-control"):
        assert mine.headers.get(header) == theirs.headers.get(header), header


def test_a_loading_stream_reads_alike(pair: Pair) -> None:
    """`sendLoadingState`: a stream that waits for its model's load gets 200 at once, chunks
    with the loading messages in `delta.reasoning_content`, then the answer's, `[DONE]` last.
    How many loading chunks each sends depends on timing: each kind's shapes are compared
    together (every path and kind in any of them)."""
    pair.both("POST", "/api/models/unload")
    mine, theirs = pair.both("POST", "/v1/chat/completions",
                             json={**CHAT, "model": "slow", "stream": True})
    assert (mine.status_code, media_type(mine)) == (theirs.status_code, media_type(theirs)) == (
        200, SSE)
    ours_events, their_events = sse_events(mine.text), sse_events(theirs.text)
    assert their_events[-1] == ours_events[-1] == "[DONE]"

    def union(events: list[Any], loading: bool) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for e in events[:-1]:
            if ("reasoning_content" in json.dumps(e)) == loading:
                for path, kinds in shape(e).items():
                    out.setdefault(path, set()).update(kinds)
        return out

    found: list[Finding] = []
    for loading, label in ((True, "loading chunk"), (False, "chunk")):
        a, b = union(ours_events, loading), union(their_events, loading)
        assert b, f"llama-swap sent no {label}: {theirs.text[:500]}"
        found += [(f"{label} {p}", _kinds(a.get(p)), _kinds(b.get(p)))
                  for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)]
    assert_only_allowed("POST /v1/chat/completions (loading stream)", found,
                        detail=f"ours: {mine.text[:800]}\ntheirs: {theirs.text[:800]}")


def test_a_capture_reads_alike(pair: Pair) -> None:
    """A chat request's capture, found through the activity list's newest row (once it is
    there: gpuproxy's rows are written off the request's path, a moment after the answer)."""
    def newest(side: Side) -> dict[str, Any]:
        return side.http.get("/api/metrics/activity", params={"limit": 1}).json()

    before = [newest(side)["total"] for side in (pair.ours, pair.theirs)]
    pair.both("POST", "/v1/chat/completions", json=CHAT)
    answers = []
    for side, total in zip((pair.ours, pair.theirs), before, strict=True):
        page = until(f"{side.name} lists the chat's row",
                     lambda side=side, total=total: (
                         page if (page := newest(side))["total"] > total else None))
        answers.append(side.http.get(f"/api/captures/{page['data'][0]['id']}"))
    case = Case("GET /api/captures/{id}", "GET", "",
                opaque=("req_headers", "resp_headers"))
    assert_alike(case.name, answers[0], answers[1], case)
    unknown = pair.both("GET", "/api/captures/999999")
    assert_alike("GET /api/captures/{id} (unknown)", *unknown)


def test_performance_reads_alike(pair: Pair) -> None:
    """The performance history, once each side has a sample (llama-swap's first comes a few
    seconds after its start: `sys_stats` is null until then). Per-GPU records only where
    there are GPUs (llama-swap: null otherwise), so `gpu_stats` is compared as a kind."""
    answers = []
    for side in (pair.ours, pair.theirs):
        answers.append(until(f"{side.name} has a performance sample", lambda side=side: (
            r if (r := side.http.get("/api/performance")).status_code != 200
            or r.json().get("sys_stats") else None), within=30))
    case = Case("GET /api/performance", "GET", "", opaque=("gpu_stats",))
    assert_alike(case.name, answers[0], answers[1], case)


def test_ui_opens_a_page(pair: Pair) -> None:
    """/ui leads to a page (llama-swap's SPA; gpuproxy's dashboard, or its login)."""
    mine, theirs = pair.both("GET", "/ui", follow_redirects=True)
    assert (mine.status_code, media_type(mine)) == (theirs.status_code, media_type(theirs)) == (
        200, "text/html")


#: What llama-swap sends first on /api/events (its initial payload), read from it by hand.
FIRST_EVENTS = {"logData", "modelStatus", "uiConfig", "profileChanged", "inflight"}


def test_events_begin_alike(pair: Pair) -> None:
    """/api/events opens with the same frame types (llama-swap's initial payload), and each
    frame's decoded `data` has the same shape (a model's status, the in-flight snapshot, a
    log chunk)."""
    theirs = read_events(pair.theirs, FIRST_EVENTS)
    assert theirs["status"] == (200, SSE) and FIRST_EVENTS <= set(theirs), theirs
    mine = read_events(pair.ours, FIRST_EVENTS)
    found: list[Finding] = []
    if mine["status"] != theirs["status"]:
        found.append(("status", str(mine["status"]), str(theirs["status"])))
    for frame in sorted(FIRST_EVENTS):
        if (frame in mine) != (frame in theirs):
            found.append((f"frame {frame}", "sent" if frame in mine else "absent",
                          "sent" if frame in theirs else "absent"))
        elif frame in mine:
            ours_shape = shape(json.loads(mine[frame]), key_by={"": "id"})
            their_shape = shape(json.loads(theirs[frame]), key_by={"": "id"})
            for path in sorted(set(ours_shape) | set(their_shape)):
                if ours_shape.get(path) != their_shape.get(path):
                    found.append((f"{frame} {path}", _kinds(ours_shape.get(path)),
                                  _kinds(their_shape.get(path))))
    assert_only_allowed("GET /api/events", found, detail=f"ours {mine}\ntheirs {theirs}")


def families(side: Side) -> dict[str, tuple[str, frozenset[str]]]:
    r = side.http.get("/metrics")
    assert r.status_code == 200, (side.name, r.text)
    return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels))
            for f in text_string_to_metric_families(r.text)}


def test_metrics_have_a_name_for_each_of_llamaswaps(pair: Pair) -> None:
    """Every series llama-swap's /metrics has (its performance gauges: no GPU here, so no
    `llamaswap_gpu_*`) is in gpuproxy's under METRIC_NAMES' name, with its type and labels."""
    mine, theirs = families(pair.ours), families(pair.theirs)
    assert theirs and all(name.startswith("llamaswap_") for name in theirs), sorted(theirs)
    for name, (kind_, labels) in theirs.items():
        assert name in METRIC_NAMES, f"llama-swap's {name} has no row in METRIC_NAMES"
        assert mine.get(METRIC_NAMES[name]) == (kind_, labels), (name, METRIC_NAMES[name])


def test_the_table_names_only_endpoints_that_are_compared() -> None:
    """A row for an endpoint no comparison checks would be a claim nobody verifies."""
    compared = {c.name for c in CASES} | {
        "GET /api/captures/{id}", "GET /api/captures/{id} (unknown)", "GET /api/performance",
        "GET /api/events", "POST /v1/chat/completions (loading stream)", ERRORS}
    assert {d.endpoint for d in ALLOWED_DIFFERENCES} <= compared


def test_the_migration_guide_shows_every_row() -> None:
    """docs/llama-swap.md's "What differs" is this table, rendered by hand: each row's
    endpoint, what, ours and theirs appear in one line of it."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "llama-swap.md").read_text()
    table = guide.split("## What differs", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")]

    def said(d: Difference) -> bool:
        # the endpoint's path and the case in parentheses, e.g. `POST /v1/messages` (bad key)
        path, _, case = d.endpoint.partition(" (")
        what = d.what.removeprefix("frame ")
        named = path if d.endpoint == ERRORS else f"`{path}`"
        return any(named in line and (not case or f"({case}" in line)
                   and what.lower() in line.replace("`", "").lower()
                   and d.ours.strip('"') in line and d.theirs.strip('"') in line
                   for line in lines)

    assert [d for d in ALLOWED_DIFFERENCES if not said(d)] == []
