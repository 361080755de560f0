"""llama-swap's binary and `gpuproxy serve` started on one config, and what their answers are
made of: status, media type, chosen headers, and the shape of a JSON body (its paths and value
kinds), so that two answers can be compared without the values that must differ (ids,
timestamps, `owned_by`, the ports each one's upstreams got).

Each side runs its own fake upstreams (`python -m gpuproxy.testing.fakellm`, one per model, on
ports from its own `startPort`): the same program, so what either proxy passes through is the
same. llama-swap needs an upstream that sets TCP_NODELAY (its README: a server that writes
head and body apart stalls 40 ms per request on delayed ACKs); the fake is an asyncio server,
and asyncio sets TCP_NODELAY on every TCP transport it makes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import until

JSON = "application/json"
SSE = "text/event-stream"


@dataclass
class Side:
    """One proxy under comparison: its process (a group of its own), address and output."""

    name: str
    proc: subprocess.Popen
    base: str
    log: Path
    http: httpx.Client

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.http.close()


def _client(base: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base, headers=headers, timeout=60, trust_env=False)


def start_llamaswap(binary: Path, config: str, folder: Path, listen: int,
                    key: str | None = None, env: dict[str, str] | None = None) -> Side:
    """llama-swap on `config`, answered once it says it listens (it fails the test, with its
    output, if it exits first: a config it refuses)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-swap.yaml"
    path.write_text(config)
    log = folder / "llama-swap.log"
    proc = subprocess.Popen(
        [str(binary), "-config", str(path), "-listen", f"127.0.0.1:{listen}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=folder,
        env={**os.environ, **(env or {})}, start_new_session=True)
    base = f"http://127.0.0.1:{listen}"
    side = Side("llama-swap", proc, base, log, _client(base, key))

    def listening() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"llama-swap exited ({proc.returncode}):\n{side.output()}")
        return "llama-swap listening on" in side.output()

    until("llama-swap listens", listening, within=30)
    return side


def start_gpuproxy(config: str, folder: Path, listen: int, workers: int, database_url: str,
                   key: str | None = None) -> Side:
    """`gpuproxy serve --workers N` on `config`, answered once /health says OK and the log
    says it listens on this very address (not another process that holds the port)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpuproxy.yaml"
    path.write_text(config)
    log = folder / "gpuproxy.log"
    env = {**os.environ, "DATABASE_URL": database_url,
           "GPUPROXY_DATA_DIR": str(folder / "data")}
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(path),
         "--listen", f"127.0.0.1:{listen}", "--workers", str(workers)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=folder,
        start_new_session=True)
    base = f"http://127.0.0.1:{listen}"
    side = Side("gpuproxy", proc, base, log, _client(base, key))

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"gpuproxy serve exited ({proc.returncode}):\n{side.output()}")
        try:
            healthy = side.http.get("/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
        return healthy and f"listening on {base}" in side.output()

    until("gpuproxy serve answers /health", ready, within=90)
    return side


# ---------------------------------------------------------------------------- what answers hold

def media_type(r: httpx.Response) -> str:
    """The media type without its parameters: `charset=utf-8` is said by one side and not the
    other for the same bytes (Go's and Django's defaults), and no client reads it for JSON."""
    return (r.headers.get("content-type") or "none").split(";")[0].strip().lower()


def kind(value: Any) -> str:
    """A JSON value's kind; int and float are one (Go writes 0 where Python writes 0.0)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def shape(value: Any, *, key_by: dict[str, str] | None = None, opaque: Iterable[str] = (),
          ) -> dict[str, set[str]]:
    """Every path in a JSON value with the kinds found there: `a.b`, list items as `a[]` (the
    union of all items), or `a[<id>]` where `key_by` names the field that identifies a
    list's items (so one item's missing key is not hidden by another's). Below an `opaque`
    path only the kind is kept: maps keyed by data (header names, hardware details)."""
    keyed = key_by or {}
    stop = set(opaque)
    out: dict[str, set[str]] = {}

    def walk(v: Any, path: str) -> None:
        out.setdefault(path or "$", set()).add(kind(v))
        if path in stop:
            return
        if isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list):
            field = keyed.get(path)
            for item in v:
                label = str(item.get(field)) if field and isinstance(item, dict) else ""
                walk(item, f"{path}[{label}]")

    walk(value, "")
    return out


def values_at(value: Any, path: str) -> list[str]:
    """The values (as JSON) at a dotted path, `[]` stepping into every item of a list."""
    found = [value]
    for step in path.replace("[]", ".[]").split("."):
        nxt: list[Any] = []
        for v in found:
            if step == "[]" and isinstance(v, list):
                nxt.extend(v)
            elif isinstance(v, dict) and step in v:
                nxt.append(v[step])
        found = nxt
    return sorted({json.dumps(v, sort_keys=True) for v in found})


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded (`[DONE]` kept as the string)."""
    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def read_events(side: Side, want: set[str], within: float = 15.0, quiet: float = 3.0
                ) -> dict[str, Any]:
    """The first frame of each `type` on `GET /api/events` (llama-swap's `event: message`,
    `data: {"type", "data": "<json>"}`), read until every type in `want` came or `within`
    seconds passed, or nothing came for `quiet` seconds (the initial payload is over); the
    status and media type under `status`."""
    first: dict[str, Any] = {}
    deadline = time.monotonic() + within
    with side.http.stream("GET", "/api/events",
                          timeout=httpx.Timeout(within, read=quiet)) as r:
        first["status"] = (r.status_code, media_type(r))
        if r.status_code != 200:
            return first
        try:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    frame = json.loads(line[5:])
                    first.setdefault(frame.get("type"), frame.get("data"))
                if want <= set(first) or time.monotonic() > deadline:
                    break
        except httpx.ReadTimeout:
            pass  # a quiet stream: what came is its initial payload
    return first
