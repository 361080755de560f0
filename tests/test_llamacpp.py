"""The proxy in front of a real inference server: llama.cpp's own HTTP server.

`gpuproxy.testing.llama_server` runs llama.cpp's server (compiled into the xllamacpp wheel) with
llama-server's flags; `gpuproxy.testing.tinymodel` writes the tiny llama models it serves (once
per session, from a content-keyed cache). Everything goes through a real `gpuproxy serve` and
the real `openai` client, as in test_proxy.py. These tests need the test extras (xllamacpp,
gguf, numpy): without them they fail, they do not skip.

`make test-vllm` runs the opt-in vLLM smoke test at the end of this file (GPUPROXY_TEST_VLLM=1).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.helpers import process_gone, running

pytestmark = pytest.mark.django_db(transaction=True)

# The xllamacpp launcher by default; GPUPROXY_LLAMA_SERVER=/path/to/llama-server runs the same
# command lines with the real binary (scripts/build-llama-server builds one).
LLAMA_SERVER = (os.environ.get("GPUPROXY_LLAMA_SERVER")
                or f"{sys.executable} -m gpuproxy.testing.llama_server") + (
    " --host 127.0.0.1 -t 1 --alias ${MODEL_ID}")
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]
UNLOAD_TIMEOUT = 5


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [m for m in ("xllamacpp", "gguf", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"missing test dependencies {', '.join(missing)}: install the test extras "
                    "with `pip install -e '.[test]'` (`make test` does)", pytrace=False)
    from gpuproxy.testing.tinymodel import ensure_model

    folder = tmp_path_factory.mktemp("models")
    return {"a": ensure_model(folder / "tiny-a.gguf", seed=0, name="tiny-a"),
            "b": ensure_model(folder / "tiny-b.gguf", seed=1, name="tiny-b")}


def config(models: dict[str, Path], *, slow_port: int = 1, busy_port: int = 1) -> str:
    return f"""
    startPort: {free_port()}
    healthCheckTimeout: 30
    unloadTimeout: {UNLOAD_TIMEOUT}
    models:
      tiny-a:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {models["a"]} -c 4096 -np 2
        proxy: http://127.0.0.1:${{PORT}}
      tiny-b:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {models["b"]} -c 4096
        proxy: http://127.0.0.1:${{PORT}}
      slow-load:
        # 16 slots of 32768 tokens: llama.cpp takes ~0.15 s to set up their 256 MB of KV
        # cache, and its /health answers 503 "Loading model" meanwhile (as for a big model).
        cmd: {LLAMA_SERVER} --port {slow_port} -m {models["a"]} -c 524288 -np 16
        proxy: http://127.0.0.1:{slow_port}
      long-gen:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {models["a"]} -c 32768
        proxy: http://127.0.0.1:${{PORT}}
      busy:
        cmd: {LLAMA_SERVER} --port {busy_port} -m {models["a"]} -c 512
        proxy: http://127.0.0.1:{busy_port}
    groups:
      pair:
        swap: true
        exclusive: false
        members: [tiny-a, tiny-b]
    """


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=60))


def test_first_request_loads_the_model_and_the_proxy_waits_for_health(serve, tiny_models):
    """llama.cpp answers /health 503 "Loading model" while it loads; the proxy forwards the
    first request only once it answers 200."""
    slow_port = free_port()
    proxy = serve(config(tiny_models, slow_port=slow_port))
    assert running(proxy) == {}
    seen: list[tuple[float, int, str]] = []  # what /health said, and when
    done = threading.Event()

    def watch_health() -> None:
        with httpx.Client(trust_env=False, timeout=2) as h:
            while not done.is_set():
                try:
                    r = h.get(f"http://127.0.0.1:{slow_port}/health")
                except httpx.TransportError:  # not listening yet
                    pass
                else:
                    seen.append((time.monotonic(), r.status_code, r.text))
                    if r.status_code == 200:
                        return
                time.sleep(0.005)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    try:
        chat = client(proxy).chat.completions.create(model="slow-load", messages=MESSAGES,
                                                     max_tokens=8)
        answered = time.monotonic()
    finally:
        # The watcher runs on until it sees the 200 itself: stopping it at the answer raced its
        # last 5 ms poll on a loaded machine (once it had seen only the 503s).
        watcher.join(5)
        done.set()

    assert chat.model == "slow-load"
    assert chat.choices[0].message.content.strip()
    assert chat.usage.completion_tokens == 8
    loading = [(t, body) for t, status, body in seen if status == 503]
    assert loading, f"llama.cpp never answered 503 while loading: {seen[:5]}"
    assert "Loading model" in loading[0][1]
    assert seen[-1][1] == 200
    assert answered > loading[-1][0]  # the proxy answered only after the load had finished
    assert running(proxy)["slow-load"]["state"] == "ready"


def test_chat_and_completions_streaming_and_not(serve, tiny_models):
    proxy = serve(config(tiny_models))
    oa = client(proxy)

    chat = oa.chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=16)
    assert chat.model == "tiny-a"  # llama.cpp names the model by its --alias
    assert chat.choices[0].message.content.strip()
    assert chat.choices[0].finish_reason == "length"  # the tiny model never stops by itself
    assert chat.usage.completion_tokens == 16 and chat.usage.prompt_tokens > 0
    assert chat.model_extra["timings"]["predicted_n"] == 16  # llama.cpp's timings, relayed

    chunks = list(oa.chat.completions.create(
        model="tiny-a", messages=MESSAGES, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage.completion_tokens == 16
    timings = [c.model_extra["timings"] for c in chunks if "timings" in c.model_extra]
    assert timings and timings[-1]["predicted_n"] == 16

    comp = oa.completions.create(model="tiny-a", prompt="the quick brown", max_tokens=12)
    assert comp.choices[0].text.strip()
    assert comp.usage.completion_tokens == 12
    assert comp.model_extra["timings"]["predicted_n"] == 12

    parts = list(oa.completions.create(model="tiny-a", prompt="the quick brown", max_tokens=12,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices).strip()
    assert parts[-1].usage.completion_tokens == 12
    assert parts[-1].model_extra["timings"]["predicted_n"] == 12

    # llama.cpp's native endpoint, and generation control the tests below rely on
    native = proxy.http.post("/completion", json={"model": "tiny-a", "prompt": "the dog",
                                                  "n_predict": 5}).json()
    assert native["timings"]["predicted_n"] == 5 and native["content"].strip()
    greedy = [oa.chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=8,
                                         temperature=0).choices[0].message.content
              for _ in range(2)]
    assert greedy[0] == greedy[1]
    from gpuproxy.testing.tinymodel import EOS_ID

    stopped = oa.chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=8,
                                         logit_bias={str(EOS_ID): 100})
    assert stopped.choices[0].finish_reason == "stop"


def test_swap_between_two_real_models(serve, tiny_models):
    proxy = serve(config(tiny_models))
    oa = client(proxy)
    first = oa.chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert first.model == "tiny-a"
    pid_a = running(proxy)["tiny-a"]["pid"]

    second = oa.chat.completions.create(model="tiny-b", messages=MESSAGES, max_tokens=8,
                                        temperature=0)
    assert second.model == "tiny-b"
    now = running(proxy)
    assert list(now) == ["tiny-b"] and now["tiny-b"]["state"] == "ready"
    assert process_gone(pid_a)
    # other weights, other words
    assert first.choices[0].message.content != second.choices[0].message.content


def test_unload_stops_llamacpp_with_sigterm_within_the_unload_timeout(serve, tiny_models):
    proxy = serve(config(tiny_models))
    assert proxy.http.post("/api/models/load/tiny-a").status_code == 200
    record = running(proxy)["tiny-a"]
    pid, upstream = record["pid"], record["proxy"]
    assert httpx.get(upstream + "/health", trust_env=False).status_code == 200

    began = time.monotonic()
    r = proxy.http.post("/api/models/unload/tiny-a")
    took = time.monotonic() - began
    assert r.status_code == 200
    assert took < UNLOAD_TIMEOUT
    assert running(proxy) == {}
    assert process_gone(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(upstream + "/health", trust_env=False)
    out = proxy.output()
    assert f'model "tiny-a" stopped (pid {pid}, exit code 0)' in out  # its own exit, no SIGKILL
    assert "did not exit" not in out and "outlived" not in out


def test_busy_port_fails_the_start_before_llamacpp_would(serve, tiny_models):
    """Another server has the model's port: the start fails at once and says so, and llama.cpp
    is not run to fail on its bind (its own error needs the log, not the client)."""
    with socket.socket() as holder:  # another server already has the port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        proxy = serve(config(tiny_models, busy_port=busy))
        r = proxy.http.post("/api/models/load/busy")
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "start_failed"
    message = error["message"]
    assert '"busy"' in message and "already in use" in message and str(busy) in message
    assert running(proxy) == {}
    assert "couldn't bind HTTP server socket" not in proxy.http.get("/logs").text


def test_a_client_leaving_mid_stream_stops_generation_on_the_server(serve, tiny_models):
    proxy = serve(config(tiny_models))
    oa = client(proxy)
    stream = oa.chat.completions.create(model="long-gen", messages=MESSAGES, max_tokens=30000,
                                        stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 20:
            break
    slots_url = running(proxy)["long-gen"]["proxy"] + "/slots"
    slots = httpx.get(slots_url, trust_env=False).json()
    assert any(s["is_processing"] for s in slots), slots  # 30000 tokens: still generating
    stream.close()

    deadline = time.monotonic() + 5
    while any(s["is_processing"] for s in httpx.get(slots_url, trust_env=False).json()):
        assert time.monotonic() < deadline, "llama.cpp still generating 5 s after the client left"
        time.sleep(0.02)
    # llama.cpp's own account: the task was cancelled long before its 30000 tokens
    logs = proxy.http.get("/logs").text
    assert "cancel task" in logs
    used = [int(n) for n in re.findall(r"stop processing: n_tokens = (\d+)", logs)]
    assert used and max(used) < 5000, used


# -- opt-in: vLLM's CPU package (`make test-vllm`; heavy, not run by `make test`) -----------------

if os.environ.get("GPUPROXY_TEST_VLLM"):

    def test_vllm_upstream_smoke(serve, tmp_path):
        """Load on first request, chat streaming and not, unload: vLLM's CPU build as the
        upstream (cold start about a minute). Runs under GPUPROXY_VLLM_PYTHON."""
        vllm_python = os.environ.get("GPUPROXY_VLLM_PYTHON", sys.executable)
        model_dir = tmp_path / "hf-tiny"
        subprocess.run([vllm_python, "-m", "gpuproxy.testing.tinymodel", str(model_dir), "--hf"],
                       check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
        proxy = serve(f"""
        healthCheckTimeout: 300
        startPort: {free_port()}
        models:
          vllm-tiny:
            cmd: >-
              {vllm_python} -m vllm.entrypoints.openai.api_server --model {model_dir}
              --host 127.0.0.1 --port ${{PORT}} --served-model-name ${{MODEL_ID}}
              --max-model-len 512 --max-num-seqs 4 --dtype bfloat16 --enforce-eager
            proxy: http://127.0.0.1:${{PORT}}
            env: [HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=nobind]
        """)
        oa = client(proxy)
        never_stop = {"ignore_eos": True}  # vLLM's sampling extension: exactly max_tokens
        chat = oa.chat.completions.create(model="vllm-tiny", messages=MESSAGES, max_tokens=8,
                                          extra_body=never_stop)
        assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens == 8
        chunks = list(oa.chat.completions.create(
            model="vllm-tiny", messages=MESSAGES, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body=never_stop))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
        assert chunks[-1].usage.completion_tokens == 8
        pid = running(proxy)["vllm-tiny"]["pid"]
        assert proxy.http.post("/api/models/unload/vllm-tiny").status_code == 200
        assert process_gone(pid)


QUEUED_CLIENTS = 4
QUEUED_REQUESTS = 400


def test_queued_streams_get_no_false_errors_although_llamacpp_closes_after_each(serve,
                                                                               tiny_models):
    """llama.cpp's server answers `Keep-Alive: timeout=5, max=100` but closes the connection
    after every streamed response. With one slot and four clients, the scheduler dispatches
    the next request the moment a stream ends: a pooled connection that carried a stream must
    not be reused, or a share of requests meets a dead socket and fails with a false 502."""
    proxy = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 30
    models:
      one:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {tiny_models["a"]} -c 4096
        proxy: http://127.0.0.1:${{PORT}}
    """)
    assert proxy.http.post("/api/models/load/one").status_code == 200
    failures: list[str] = []
    done = [0]
    lock = threading.Lock()

    def one_client() -> None:
        with httpx.Client(base_url=proxy.base, trust_env=False, timeout=60) as h:
            while True:
                with lock:
                    if done[0] >= QUEUED_REQUESTS:
                        return
                    done[0] += 1
                with h.stream("POST", "/v1/chat/completions", json={
                        "model": "one", "stream": True, "max_tokens": 48,
                        "messages": MESSAGES}) as r:
                    body = r.read().decode()
                data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
                if r.status_code != 200 or not data or data[-1] != "[DONE]":
                    failures.append(f"{r.status_code}: {body[-300:]}")

    threads = [threading.Thread(target=one_client, daemon=True) for _ in range(QUEUED_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert done[0] == QUEUED_REQUESTS
    assert failures == [], f"{len(failures)} of {QUEUED_REQUESTS} failed: {failures[:3]}"
    # No stream's connection was reused, so none needed the safety-net retry either.
    retries = [line for line in proxy.http.get("/metrics").text.splitlines()
               if line.startswith('gpuproxy_upstream_retries_total{model="one"}')]
    assert retries == ['gpuproxy_upstream_retries_total{model="one"} 0.0'], retries


def test_embeddings_from_llamacpp_with_its_pooling(serve, tiny_models):
    """`--embedding --pooling P`: llama.cpp's own /v1/embeddings through the proxy, one
    normalized vector per input (the tiny model is 64 wide), and the pooling reaches it."""
    proxy = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 30
    models:
      emb-mean:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {tiny_models["a"]} -c 512 --embedding --pooling mean
        proxy: http://127.0.0.1:${{PORT}}
      emb-last:
        cmd: {LLAMA_SERVER} --port ${{PORT}} -m {tiny_models["a"]} -c 512 --embedding --pooling last
        proxy: http://127.0.0.1:${{PORT}}
    groups:
      both:
        swap: false
        members: [emb-mean, emb-last]
    """)
    oa = client(proxy)
    texts = ["the quick brown fox", "the lazy dog"]
    mean = oa.embeddings.create(model="emb-mean", input=texts, encoding_format="float")
    assert [d.index for d in mean.data] == [0, 1]
    vectors = [d.embedding for d in mean.data]
    assert [len(v) for v in vectors] == [64, 64]
    for v in vectors:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-3  # llama.cpp normalizes (L2) by default
    assert vectors[0] != vectors[1]
    assert mean.usage.prompt_tokens > 0
    last = oa.embeddings.create(model="emb-last", input=texts[:1], encoding_format="float")
    assert len(last.data[0].embedding) == 64
    assert last.data[0].embedding != vectors[0]  # another pooling, another vector


def test_the_row_counts_cached_prompt_tokens_inside_input_as_the_client_saw(serve, tiny_models):
    """Issue 20's finding, against the real server: the second identical prompt is served
    mostly from llama.cpp's cache, its `timings.prompt_n` counts only the uncached tokens and
    its `usage.prompt_tokens` all of them. The row's `input_tokens` must be what the client
    saw in `usage` (cached included) and `cached_tokens` llama.cpp's `timings.cache_n`."""
    from activity.models import RequestLog

    proxy = serve(config(tiny_models))
    oa = client(proxy)
    answers = [oa.chat.completions.create(model="tiny-a", messages=MESSAGES, max_tokens=4,
                                          temperature=0) for _ in range(2)]
    timings = answers[1].model_extra["timings"]
    assert timings["cache_n"] > 0, timings  # the prefix came from the cache
    assert timings["prompt_n"] < answers[1].usage.prompt_tokens
    proxy.proc.send_signal(signal.SIGTERM)  # the writer flushes its rows at exit
    assert proxy.proc.wait(30) == 0, proxy.output()
    last = RequestLog.objects.filter(model="tiny-a").order_by("received_at").last()
    assert last is not None
    assert (last.input_tokens, last.cached_tokens, last.output_tokens) == (
        answers[1].usage.prompt_tokens, timings["cache_n"], 4)
