"""Our export of a llama-swap config is a llama-swap config: its JSON schema accepts it, and
the real binary started on it runs with the same authentication (a `${env.KEY}` API key
refuses a request without the key, 401, and serves one with it).

The config is hand-written and uses only llama-swap features; what the binary answers is the
expectation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from scheduling.exporter import export_document
from scheduling.importer import import_path
from tests.conftest import free_port
from tests.helpers import until

pytestmark = pytest.mark.django_db

KEY = "sk-compat-export-77"
CONFIG = """\
    healthCheckTimeout: 30
    globalTTL: 300
    startPort: 12000
    apiKeys: ["${env.COMPAT_KEY}"]
    macros:
      server: /nonexistent/llama-server
    models:
      chat:
        cmd: ${server} --port ${PORT} -m ${env.COMPAT_MODELS}/chat.gguf
        aliases: [gpt-4o-mini]
        ttl: 60
      embed:
        cmd: ${server} --port ${PORT} --embedding
        unlisted: true
    groups:
      always:
        persistent: true
        swap: false
        members: [embed]
    hooks:
      on_startup:
        preload: [chat]
    routing:
      scheduler:
        use: fifo
        settings:
          fifo:
            priority: {chat: 5}
    """
ENV = {"COMPAT_KEY": KEY, "COMPAT_MODELS": "/srv/models"}


@pytest.fixture
def exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    source = tmp_path / "config.yaml"
    source.write_text(textwrap.dedent(CONFIG), encoding="utf-8")
    import_path(source)
    document = export_document()
    assert document.warnings == ()
    target = tmp_path / "exported.yaml"
    target.write_text(document.text, encoding="utf-8")
    return target


def test_the_schema_accepts_the_export(exported: Path, reference: Path):
    schema = json.loads((reference / "llama-swap-config-schema.json").read_text())
    data = yaml.safe_load(exported.read_text())
    found = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
             for e in jsonschema.Draft7Validator(schema).iter_errors(data)]
    assert found == []
    assert data["apiKeys"] == ["${env.COMPAT_KEY}"]
    assert data["models"]["chat"]["cmd"] == (
        "${server} --port ${PORT} -m ${env.COMPAT_MODELS}/chat.gguf")


def test_llama_swap_on_the_export_asks_for_the_key(exported: Path, llamaswap_bin: Path,
                                                  tmp_path: Path):
    listen = free_port()
    log = tmp_path / "llama-swap.log"
    # preload would start chat's (missing) server: the binary only needs to answer
    text = exported.read_text().replace("preload:\n    - chat\n", "preload: []\n")
    exported.write_text(text)
    proc = subprocess.Popen(
        [str(llamaswap_bin), "-config", str(exported), "-listen", f"127.0.0.1:{listen}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path,
        env={**os.environ, **ENV}, start_new_session=True)
    try:
        def listening() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"llama-swap refused our export (exit {proc.returncode}):\n"
                            f"{log.read_text(errors='replace')}\n---\n{text}")
            return "llama-swap listening on" in log.read_text(errors="replace")

        until("llama-swap listens", listening, within=30)
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30,
                          trust_env=False) as http:
            assert http.get("/v1/models").status_code == 401
            wrong = http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
            assert wrong.status_code == 401
            ok = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200, ok.text
            assert "chat" in {m["id"] for m in ok.json()["data"]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
