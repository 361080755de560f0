"""How many requests an upstream serves at once, read from its command the way the server
reads it (scheduling/slots.py). Pure: no database, no Django.

Every expected number is read by eye from the command and the server's documented behaviour:
llama-server `-np N` (default -1, "auto": 4 slots in llama.cpp b11549, the build xllamacpp
2026.10.11549 ships; tests/test_llamacpp_slots.py shows the server doing it), vLLM
`--max-num-seqs`, SGLang `--max-running-requests`, anything else 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduling.slots import derive_parallel, resolve_parallel

LLAMA = "/opt/llama.cpp/llama-server --port 9102 --model /m/q.gguf --ctx-size 32768 -ngl 99"
LOOKALIKE = "/venv/bin/python -m gpuproxy.testing.llama_server --host 127.0.0.1 --port 5800"
DOCKER_LLAMA = ("docker run --rm -p 9000:8080 -v /models:/models "
                "ghcr.io/ggml-org/llama.cpp:server-cuda -m /models/x.gguf --port 8080")
VLLM_DOCKER = ("docker run --rm --name vllm-32b --gpus all -p 9103:8000 "
               "vllm/vllm-openai:v0.11.0 --model Qwen/Qwen2.5-32B-Instruct "
               "--max-num-seqs 8 --scheduling-policy priority")


@pytest.mark.parametrize(("cmd", "env", "expected"), [
    # llama-server: -np / --parallel, the last one given wins (llama.cpp parses in order)
    (f"{LLAMA} -np 4", (), 4),
    (f"{LLAMA} --parallel 3", (), 3),
    (f"{LLAMA} --parallel=3", (), 3),
    (f"{LLAMA} -np 2 -np 6", (), 6),
    ("llama-server.exe -m x.gguf -np 2", (), 2),
    # no -np: llama-server's own default, -1 = auto, which its server turns into 4 slots
    (LLAMA, (), 4),
    (f"{LLAMA} -np -1", (), 4),
    (f"{LLAMA} --kv-unified", (), 4),
    # LLAMA_ARG_N_PARALLEL stands in for a missing flag; a flag beats it
    (LLAMA, ("CUDA_VISIBLE_DEVICES=0", "LLAMA_ARG_N_PARALLEL=3"), 3),
    (f"{LLAMA} -np 2", ("LLAMA_ARG_N_PARALLEL=3",), 2),
    # llama.cpp's server image runs llama-server; `-e` passes its environment
    (DOCKER_LLAMA, (), 4),
    (f"{DOCKER_LLAMA} -np 2", (), 2),
    (DOCKER_LLAMA.replace("docker run", "docker run -e LLAMA_ARG_N_PARALLEL=5"), (), 5),
    # a `${PORT}` the admin left for the proxy to fill does not hide the flag
    ("llama-server --port ${PORT} -m x.gguf -np 3", (), 3),
    # the look-alike builds llama.cpp's parameters itself: one slot unless told
    (f"{LOOKALIKE} -m x.gguf -np 2", (), 2),
    (f"{LOOKALIKE} -m x.gguf", (), 1),
    (f"{LOOKALIKE} -m x.gguf -np -1", (), 4),
    # vLLM and SGLang
    (VLLM_DOCKER, (), 8),
    ("vllm serve Qwen/Qwen2.5-7B --max-num-seqs=16", (), 16),
    ("vllm serve Qwen/Qwen2.5-7B", (), 1),
    ("python -m vllm.entrypoints.openai.api_server --model m --max-num-seqs 32", (), 32),
    ("python -m sglang.launch_server --model-path m --max-running-requests 12", (), 12),
    ("python -m sglang.launch_server --model-path m", (), 1),
    # anything else: 1, whatever its flags mean to it (whisper.cpp's -np is --no-prints)
    ("/opt/whisper.cpp/whisper-server --host 127.0.0.1 --port 9300 -np", (), 1),
    ("my-server --parallel 8", (), 1),
    ("/venv/bin/python -m gpuproxy.testing.fakellm --port 5800 --model m", (), 1),
])
def test_slots_follow_the_servers_own_reading(cmd, env, expected):
    assert derive_parallel(cmd, env).parallel == expected


@pytest.mark.parametrize(("cmd", "env", "says"), [
    (f"{LLAMA} -np 4", (), "`-np 4` in cmd"),
    (f"{LLAMA} --parallel=3", (), "`--parallel=3` in cmd"),
    (LLAMA, (), "llama-server's default: -np auto = 4 slots"),
    (f"{LLAMA} -np -1", (), "`-np -1` in cmd: auto = 4 slots"),
    (LLAMA, ("LLAMA_ARG_N_PARALLEL=3",), "LLAMA_ARG_N_PARALLEL=3 in env"),
    (f"{LOOKALIKE} -m x.gguf", (), "gpuproxy.testing.llama_server's default: 1 slot"),
    (VLLM_DOCKER, (), "`--max-num-seqs 8` in cmd"),
    ("vllm serve m", (), "vLLM without --max-num-seqs"),
    ("python -m sglang.launch_server --model-path m", (), "SGLang without --max-running-requests"),
    ("/opt/whisper.cpp/whisper-server --port 9300", (), "not llama-server, vLLM or SGLang"),
])
def test_the_source_says_where_the_number_came_from(cmd, env, says):
    assert says in derive_parallel(cmd, env).source


@pytest.mark.parametrize(("cmd", "says"), [
    (f"{LLAMA} -np 0", "`-np 0` in cmd: llama-server refuses 0"),
    (f"{LLAMA} -np four", "`-np four` in cmd is not a number"),
    (f"{LLAMA} -np", "`-np` in cmd has no value"),
    ("vllm serve m --max-num-seqs 0", "`--max-num-seqs 0` in cmd is below 1"),
    ('llama-server -m "unclosed', "cmd cannot be split"),
])
def test_a_value_the_server_would_refuse_gives_one_slot_and_says_why(cmd, says):
    slots = derive_parallel(cmd)
    assert slots.parallel == 1
    assert says in slots.source


def test_an_explicit_parallel_wins_over_the_command():
    assert resolve_parallel(2, f"{LLAMA} -np 4").parallel == 2
    assert resolve_parallel(2, f"{LLAMA} -np 4").source == "`parallel` set explicitly"
    assert resolve_parallel(None, f"{LLAMA} -np 4").parallel == 4


def test_the_module_is_pure():
    code = ("import sys, scheduling.slots; "
            "print(','.join(m for m in ('django', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[1],
                         check=True)
    assert out.stdout.strip() == ""
