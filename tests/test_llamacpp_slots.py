"""Slots against the real llama.cpp server: what `-np` (or its absence) gives, and the proxy
keeping every slot busy. llama.cpp's own server code (compiled into the xllamacpp wheel, run
by `gpuproxy.testing.llama_server` with llama-server's flags) behind a real `gpuproxy serve`.

The numbers are the server's own (`/slots`, `/props` total_slots) and the ones read by eye
from each command; the code under test produces neither. Needs the test extras (xllamacpp,
gguf, numpy): without them these fail, they do not skip.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import httpx
import pytest

from scheduling.models import ModelDefinition
from tests.conftest import free_port
from tests.helpers import queue_until, running, until

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "python -m gpuproxy.testing.llama_server"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [m for m in ("xllamacpp", "gguf", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"missing test dependencies {', '.join(missing)}: install the test extras "
                    "with `pip install -e '.[test]'` (`make test` does)", pytrace=False)
    from gpuproxy.testing.tinymodel import ensure_model

    folder = tmp_path_factory.mktemp("slot-models")
    return {"chat": ensure_model(folder / "tiny-chat.gguf", seed=0, name="tiny-chat"),
            "writer": ensure_model(folder / "tiny-writer.gguf", seed=1, name="tiny-writer")}


def shipped_config(models: dict[str, Path]) -> str:
    """config.llamacpp.yaml as shipped, pointed at this run's models, interpreter and ports."""
    text = (ROOT / "config.llamacpp.yaml").read_text()
    for old, new in ((LAUNCHER, f"{sys.executable} -m gpuproxy.testing.llama_server"),
                     ("var/models/tiny-chat.gguf", str(models["chat"])),
                     ("var/models/tiny-writer.gguf", str(models["writer"])),
                     ("startPort: 5800", f"startPort: {free_port()}")):
        assert old in text, f"config.llamacpp.yaml no longer says {old!r}: update this test"
        text = text.replace(old, new)
    return text


def slots_of(base: str) -> list[dict]:
    return httpx.get(base + "/slots", trust_env=False, timeout=10).json()


def test_config_llamacpp_runs_two_requests_at_once_on_np_2(serve, tiny):
    """`-np 2` in the shipped macro: two slots in llama.cpp, and the proxy hands it two
    requests at once (before, `parallel` defaulted to 1 and the second one waited)."""
    proxy = serve(shipped_config(tiny))
    chat = ModelDefinition.objects.get(model_id="tiny-chat")
    assert (chat.parallel, chat.slots.parallel, chat.slots.source) == (None, 2,
                                                                        "`-np 2` in cmd")
    assert proxy.http.post("/api/models/load/tiny-chat").status_code == 200
    upstream = running(proxy)["tiny-chat"]["proxy"]
    assert len(slots_of(upstream)) == 2  # llama.cpp's own count

    answers: list[httpx.Response] = []

    def ask() -> None:
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=120) as h:
            # 3000 tokens: seconds of generation each, for two slots on one thread
            answers.append(h.post("/v1/chat/completions", json={
                "model": "chat", "max_tokens": 3000, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about the fox."}]}))

    callers = [threading.Thread(target=ask, daemon=True) for _ in range(2)]
    for c in callers:
        c.start()
    queue_until(proxy, lambda q: q["in_flight"].get("tiny-chat") == 2, within=30)

    def processing() -> set[int] | None:
        busy = {s["id"] for s in slots_of(upstream) if s["is_processing"]}
        return busy if len(busy) == 2 else None

    assert until("llama.cpp generating in both slots at once", processing, within=30) == {0, 1}
    for c in callers:
        c.join(120)
    assert [a.status_code for a in answers] == [200, 200]
    assert all(a.json()["usage"]["completion_tokens"] > 0 for a in answers)


def test_llama_servers_default_slots_are_what_the_derivation_says(serve, tiny):
    """The server as evidence: llama-server's default `-np` is -1 ("auto"), which llama.cpp's
    server turns into 4 slots; the look-alike with no -np fills llama.cpp's parameters
    itself and gets their default, 1 slot. The derived numbers match both."""
    launcher = f"{sys.executable} -m gpuproxy.testing.llama_server --host 127.0.0.1 -t 1"
    proxy = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 30
    models:
      auto:
        cmd: {launcher} --port ${{PORT}} -m {tiny["chat"]} -c 2048 -np -1
        proxy: http://127.0.0.1:${{PORT}}
      plain:
        cmd: {launcher} --port ${{PORT}} -m {tiny["chat"]} -c 2048
        proxy: http://127.0.0.1:${{PORT}}
    """)
    rows = {m.model_id: m.slots.parallel for m in ModelDefinition.objects.all()}
    assert rows == {"auto": 4, "plain": 1}
    for model, slots in (("auto", 4), ("plain", 1)):
        assert proxy.http.post(f"/api/models/load/{model}").status_code == 200
        base = running(proxy)[model]["proxy"]
        props = httpx.get(base + "/props", trust_env=False, timeout=10).json()
        assert (len(slots_of(base)), props["total_slots"]) == (slots, slots), model
