"""llama-swap's live API: `/api/events` (SSE), `/api/inflight/{id}/cancel`, `/api/performance`
and `/api/hardware`, served by `gpuproxy serve` at `--workers 1` and `2` (where the stream is
answered by one request process while the requests run in any). Expected shapes are
llama-swap's, as its binary answers them (`internal/server/apigroup.go`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import Chat, memory_total_bytes, one_model, open_gate, runtime_on, until

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_KEY = "sk-live-admin-7c1d"
USER_KEY = "sk-live-user-2f9a"


class Events(threading.Thread):
    """`GET /api/events` read in the background: every frame as (type, decoded data)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.headers = base, headers or {}
        self.frames: list[tuple[str, Any]] = []
        self.raw: list[bytes] = []
        self.status: int | None = None
        self.content_type = ""
        self._stop = threading.Event()
        self.ended = False
        self.start()
        until("the event stream answered", lambda: self.status is not None)

    def run(self) -> None:
        try:
            self._read()
        except httpx.TransportError:
            pass  # the proxy stopped: `ended` says so
        finally:
            self.ended = True

    def _read(self) -> None:
        with httpx.Client(base_url=self.base, trust_env=False, timeout=None) as h, \
                h.stream("GET", "/api/events", headers=self.headers) as r:
            self.status, self.content_type = r.status_code, r.headers.get("content-type", "")
            buffer = b""
            for chunk in r.iter_raw():
                buffer += chunk
                while b"\n\n" in buffer:
                    one, buffer = buffer.split(b"\n\n", 1)
                    self.raw.append(one)
                    event, data = one.split(b"\n", 1)
                    assert event == b"event:message" and data.startswith(b"data:"), one
                    envelope = json.loads(data[len(b"data:"):])
                    self.frames.append((envelope["type"], json.loads(envelope["data"])))
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()

    def of(self, kind: str) -> list[Any]:
        return [data for t, data in list(self.frames) if t == kind]

    def wait(self, what: str, kind: str, predicate: Any, within: float = 30.0) -> Any:
        return until(what, lambda: next((d for d in self.of(kind) if predicate(d)), None),
                     within)


def stream_chat(base: str, gate: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A streaming chat request held by the fake upstream on `gate`, in the background; the
    dict gets its status and body once it ends."""
    out: dict[str, Any] = {}

    def run() -> None:
        with httpx.Client(base_url=base, trust_env=False, timeout=60) as h:
            r = h.post("/v1/chat/completions", headers={"X-Fake-Gate": gate, **(headers or {})},
                       json={"model": "solo", "stream": True, "max_tokens": 3,
                             "messages": [{"role": "user", "content": "x"}]})
        out["status"], out["body"] = r.status_code, r.text

    threading.Thread(target=run, daemon=True).start()
    return out


def test_the_first_frames_then_model_status_after_a_load(serve):
    proxy = serve(one_model(free_port()))
    events = Events(proxy.base)
    assert events.status == 200 and events.content_type.startswith("text/event-stream")
    until("the initial payload", lambda: len(events.frames) >= 5)
    kinds = [t for t, _ in events.frames[:5]]
    assert kinds == ["logData", "logData", "modelStatus", "profileChanged", "inflight"]
    assert events.frames[0][1]["source"] == "proxy"
    assert events.frames[1][1]["source"] == "upstream"
    assert events.frames[2][1] == [{"id": "solo", "name": "", "description": "",
                                    "state": "stopped", "unlisted": False, "peerID": ""}]
    assert events.frames[3][1] == {"active": None}
    assert events.frames[4][1] == {"operation": "snapshot"}  # llama-swap omits an empty list
    assert events.raw[2].startswith(b'event:message\ndata:{"type":"modelStatus","data":"[{')

    assert proxy.http.post("/api/models/load/solo").status_code == 200
    events.wait("modelStatus says ready", "modelStatus", lambda d: d[0]["state"] == "ready")
    # the upstream's output comes as `upstream` logData
    events.wait("the upstream's log", "logData",
                lambda d: d["source"] == "upstream" and d["data"].strip())
    events.close()


def test_an_activity_event_names_the_row_of_the_request(serve):
    proxy = serve(one_model(free_port()))
    events = Events(proxy.base)
    until("the initial payload", lambda: len(events.frames) >= 4)
    assert Chat(proxy.base, "solo").answered().status_code == 200
    (event,) = [events.wait("an activity event", "activity", lambda d: True)]
    rows = until("the row is listed", lambda: proxy.http.get("/api/activity").json()["data"])
    assert event == {"id": rows[0]["id"]}
    assert rows[0]["model"] == "solo" and rows[0]["outcome"] == "ok"
    events.close()


def test_inflight_upsert_remove_and_cancel_of_a_streaming_request(serve):
    start = free_port()
    proxy = serve(one_model(start))
    events = Events(proxy.base)
    until("the initial payload", lambda: len(events.frames) >= 4)

    done = stream_chat(proxy.base, "one", {"Authorization": "Bearer not-ours",
                                           "X-Session-ID": "s-1"})
    upsert = events.wait("an upsert", "inflight", lambda d: d["operation"] == "upsert")
    entry = upsert["request"]
    assert (entry["model"], entry["req_path"], entry["method"]) == (
        "solo", "/v1/chat/completions", "POST")
    assert entry["req_headers"]["Authorization"] == "[REDACTED]"
    assert entry["req_headers"]["X-Session-Id"] == "s-1"
    assert entry["remote_ip"] == "127.0.0.1"
    assert entry["timestamp"].endswith("Z") and entry["elapsed_ms"] >= 0
    open_gate(start, "one")
    events.wait("its remove", "inflight",
                lambda d: d == {"operation": "remove", "id": entry["id"]})
    until("the stream ended", lambda: "status" in done)
    assert done["status"] == 200 and "[DONE]" in done["body"]

    held = stream_chat(proxy.base, "two")
    second = events.wait("a second upsert", "inflight",
                         lambda d: d["operation"] == "upsert"
                         and d["request"]["id"] != entry["id"])["request"]
    r = proxy.http.post(f"/api/inflight/{second['id']}/cancel")
    assert (r.status_code, r.json()) == (200, {"msg": "ok"})
    until("the cancelled client's answer ended", lambda: "status" in held, within=10)
    assert "cancelled_by_admin" in held["body"]
    events.wait("the cancelled one's remove", "inflight",
                lambda d: d == {"operation": "remove", "id": second["id"]})
    row = until("its activity row", lambda: next(
        (r for r in proxy.http.get("/api/activity").json()["data"]
         if r["request_id"] == second["id"]), None))
    assert row["outcome"] == "cancelled_by_admin"

    gone = proxy.http.post(f"/api/inflight/{second['id']}/cancel")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert proxy.http.post("/api/inflight/nope/cancel").status_code == 404
    events.close()


def test_an_open_event_stream_does_not_hold_the_shutdown(serve):
    """llama-swap ends its streams at shutdown; a drain must not wait its grace for one."""
    proxy = serve(one_model(free_port()), {"GPUPROXY_SHUTDOWN_GRACE_SECONDS": "30"})
    events = Events(proxy.base)
    until("the initial payload", lambda: len(events.frames) >= 4)
    began = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    proxy.proc.wait(25)
    assert time.monotonic() - began < 15, proxy.output()[-2000:]
    until("the stream ended", lambda: events.ended)


def test_keys_guard_the_live_api(serve):
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    proxy = serve(one_model(free_port(), extra=f"""
    apiKeys: ["{USER_KEY}"]
    apiKeyHashes:
      - {{name: ops, sha256: "{digest}", admin: true}}
    """))
    user = {"Authorization": f"Bearer {USER_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for method, path in [("GET", "/api/events"), ("POST", "/api/inflight/x/cancel"),
                         ("GET", "/api/performance"), ("GET", "/api/hardware")]:
        r = proxy.http.request(method, path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    for method, path in [("GET", "/api/events"), ("POST", "/api/inflight/x/cancel")]:
        r = proxy.http.request(method, path, headers=user)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert proxy.http.get("/api/hardware", headers=user).status_code == 200
    assert proxy.http.get("/api/performance", headers=user).status_code in (200, 503)
    assert proxy.http.post("/api/inflight/x/cancel", headers=admin).status_code == 404
    events = Events(proxy.base, admin)
    assert events.status == 200
    until("the initial payload", lambda: len(events.frames) >= 4)
    events.close()


def test_performance_history_and_its_after_filter(serve):
    proxy = serve(one_model(free_port(), extra="performance: {every: 1s}"))
    body = until("two samples", lambda: (b := proxy.http.get("/api/performance").json())
                 and len(b.get("sys_stats") or []) >= 2 and b)
    assert body["enabled"] is True and body["gpu_stats"] == []  # no GPU on the test box
    first, second = body["sys_stats"][:2]
    assert set(first) == {"timestamp", "cpu_util_per_core", "mem_total_mb", "mem_used_mb",
                          "mem_free_mb", "swap_total_mb", "swap_used_mb", "load_avg_1",
                          "load_avg_5", "load_avg_15", "net_io"}
    assert first["mem_total_mb"] == memory_total_bytes() // (1024 * 1024)
    assert len(first["cpu_util_per_core"]) == os.cpu_count()
    assert all(n["name"] != "lo" for n in first["net_io"])
    later = proxy.http.get("/api/performance", params={"after": first["timestamp"]}).json()
    assert first["timestamp"] not in [s["timestamp"] for s in later["sys_stats"]]
    assert second["timestamp"] in [s["timestamp"] for s in later["sys_stats"]]
    bad = proxy.http.get("/api/performance", params={"after": "yesterday"})
    assert bad.status_code == 400 and "RFC3339" in bad.json()["error"]["message"]


def test_performance_disabled_answers_503(serve):
    proxy = serve(one_model(free_port(), extra="performance: {disabled: true}"))
    r = proxy.http.get("/api/performance")
    assert (r.status_code, r.json()) == (503, {"enabled": False})


def test_hardware_fields(serve):
    proxy = serve(one_model(free_port()))
    hw = proxy.http.get("/api/hardware").json()
    assert set(hw) == {"schema_version", "captured_at", "capture", "architecture",
                       "operating_system", "environment", "cpu", "memory", "accelerators"}
    assert hw["schema_version"] == 1
    assert hw["capture"]["scope"] == "inference_host" and hw["capture"]["method"] == "detected"
    assert hw["operating_system"]["family"] == "linux"
    assert hw["operating_system"]["kernel"] == os.uname().release
    assert hw["architecture"]["name"] == {"x86_64": "x86_64", "aarch64": "arm64"}.get(
        os.uname().machine, os.uname().machine)
    assert hw["cpu"]["logical_thread_count"] == os.cpu_count()
    assert hw["memory"]["capacity_bytes"] == memory_total_bytes()
    assert isinstance(hw["accelerators"], list)
    assert proxy.http.get("/api/hardware").json()["captured_at"] == hw["captured_at"]


def test_a_client_that_never_reads_does_not_stall_the_proxy(serve):
    proxy = serve(one_model(free_port()))
    host, port = proxy.base.removeprefix("http://").split(":")
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect((host, int(port)))
    stuck.sendall(f"GET /api/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    try:
        for _ in range(40):  # each one logs and makes events the stuck client never reads
            began = time.monotonic()
            assert Chat(proxy.base, "solo").answered(within=20).status_code == 200
            assert time.monotonic() - began < 10
        log = proxy.http.get("/logs", timeout=10)
        assert log.status_code == 200
    finally:
        stuck.close()


async def test_a_client_that_leaves_leaves_no_task_behind():
    """In-process: the bus runs while a stream is open and stops with the last one."""
    from channels.testing import ApplicationCommunicator

    from gpuproxy.api.events import BUS
    from gpuproxy.asgi import application
    from gpuproxy.shell import runtime

    await runtime_on(f"""
startPort: {free_port()}
models:
  alpha:
    cmd: {FAKE}
""")
    try:
        def opened() -> ApplicationCommunicator:
            return ApplicationCommunicator(application, {
                "type": "http", "http_version": "1.1", "method": "GET",
                "path": "/api/events", "raw_path": b"/api/events", "query_string": b"",
                "root_path": "", "scheme": "http", "headers": [(b"host", b"127.0.0.1")],
                "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)})

        before = len(asyncio.all_tasks())
        clients = [opened() for _ in range(3)]
        for c in clients:
            await c.send_input({"type": "http.request", "body": b"", "more_body": False})
            assert (await c.receive_output(10))["status"] == 200
            # the first payload leads with the proxy's log history: past 64 KiB (earlier
            # tests' lines, in this process) Django sends it in more than one body message
            body = b""
            for _ in range(64):
                body += (await c.receive_output(10))["body"]
                if b"modelStatus" in body:
                    break
            assert b"modelStatus" in body
        assert len(BUS.clients) == 3 and BUS.running
        for c in clients:
            await c.send_input({"type": "http.disconnect"})
            await c.wait(10)
        assert not BUS.clients and not BUS.running
        assert len(asyncio.all_tasks()) <= before
    finally:
        await runtime.shutdown()


async def test_model_status_names_aliases_and_capabilities_as_llama_swap():
    from gpuproxy.api.events import model_status
    from gpuproxy.shell import runtime

    rt = await runtime_on(f"""
startPort: {free_port()}
models:
  vis:
    cmd: {FAKE}
    name: Vision
    aliases: [eyes]
    capabilities: {{in: [text, image], out: [text], context: 8192}}
  plain:
    cmd: {FAKE}
    unlisted: true
""")
    try:
        assert model_status(rt) == [
            {"id": "plain", "name": "", "description": "", "state": "stopped",
             "unlisted": True, "peerID": ""},
            {"id": "vis", "name": "Vision", "description": "", "state": "stopped",
             "unlisted": False, "peerID": "", "aliases": ["eyes"],
             "capabilities": {"vision": True}, "context_length": 8192},
        ]
    finally:
        await runtime.shutdown()


def test_an_activity_id_that_commits_after_a_higher_one_is_still_told():
    """Two writers (two processes) can commit ids out of order: 5 seen after 10."""
    from gpuproxy.api.events import ACTIVITY_LOOKBACK, NewIds

    ids = NewIds()
    assert ids.news([1, 2, 3]) == []  # the table as the stream found it
    assert ids.news([1, 2, 3, 10]) == [10]
    assert ids.floor < 5  # the next read looks back below the highest id seen
    assert ids.news([1, 2, 3, 5, 10]) == [5]
    assert ids.news([1, 2, 3, 5, 10, 11]) == [11]  # nothing told twice
    far = 11 + ACTIVITY_LOOKBACK + 1
    assert ids.news([far]) == [far]
    assert ids.floor == far - ACTIVITY_LOOKBACK and ids.seen == {far}
