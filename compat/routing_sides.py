"""The pieces of a routing comparison with llama-swap (compat/test_llamaswap_routing*.py): a
peer that records what reaches it, and one proxy seen through what a client can ask it (a chat,
`/running`, `/v1/models`) with its fakes' ports, to open a fake's gate."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from compat.sidebyside import Side
from tests.conftest import free_port
from tests.helpers import until

FAKE_CMD = "{python} -m gpuproxy.testing.fakellm --port {port} --model {model}"


def free_ports(models: Iterable[str]) -> dict[str, int]:
    """A port per model (free_port's block of ten: at most ten models)."""
    models = list(models)
    assert len(models) <= 10, "free_port reserves ten ports"
    base = free_port()
    return {m: base + i for i, m in enumerate(models)}


def fake_models(ports: dict[str, int], indent: str = "  ") -> str:
    """`models:` entries, one fake upstream per model on its fixed port (so its gate can be
    opened from the test)."""
    return "\n".join(
        f"{indent}{m}:\n{indent}  cmd: {FAKE_CMD.format(python=sys.executable, port=port, model=m)}"
        f"\n{indent}  proxy: http://127.0.0.1:{port}" for m, port in ports.items())


@dataclass
class Recorder:
    """A peer that answers every POST with a chat completion naming the model it was asked
    for, and keeps what it received (path, headers, body)."""

    name: str
    server: ThreadingHTTPServer
    seen: list[dict[str, Any]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take(self) -> list[dict[str, Any]]:
        taken, self.seen[:] = list(self.seen), []
        return taken


def start_recorder(name: str) -> Recorder:
    rec: Recorder

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0))
                              or b"{}")
            rec.seen.append({"path": self.path, "body": body,
                             "headers": {k.lower(): v for k, v in self.headers.items()}})
            answer = json.dumps({"id": "chatcmpl-rec", "object": "chat.completion",
                                 "created": 0, "model": body.get("model"),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant",
                                                          "content": f"from {name}"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            """Quiet: pytest shows the test's own output."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec = Recorder(name, server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return rec


# ---------------------------------------------------------------------------- both proxies


@dataclass
class Routed:
    """One proxy with its own fakes' ports."""

    side: Side
    ports: dict[str, int]

    def chat(self, model: str, **headers: str) -> httpx.Response:
        return self.side.http.post("/v1/chat/completions", headers=headers, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    def running(self) -> list[str]:
        """The models /running lists, by name (every state: a loading model holds its GPUs)."""
        r = self.side.http.get("/running")
        assert r.status_code == 200, (self.side.name, r.text)
        return sorted(item["model"] for item in r.json()["running"])

    def unload_all(self) -> None:
        r = self.side.http.post("/api/models/unload")
        assert r.status_code == 200, (self.side.name, r.text)
        until(f"{self.side.name} runs nothing", lambda: not self.running(), within=30)

    def open_gate(self, model: str, gate: str) -> None:
        r = httpx.post(f"http://127.0.0.1:{self.ports[model]}/fake/gates/open",
                       json={"gate": gate}, timeout=10, trust_env=False)
        assert r.status_code == 200, r.text



def model_list(routed: Routed) -> dict[str, dict[str, Any]]:
    r = routed.side.http.get("/v1/models")
    assert r.status_code == 200, (routed.side.name, r.text)
    return {item["id"]: item for item in r.json()["data"]}


def ready(routed: Routed, model: str) -> bool:
    r = routed.side.http.get("/running").json()["running"]
    return any(item["model"] == model and item.get("state") == "ready" for item in r)
