"""llama-swap itself on our fixture (minus gpuproxy's extensions), beside `gpuproxy serve` on
the whole fixture: both load the file, list the same models, and build the same command line
for each. What llama-swap answers is the expectation; nothing here is computed by gpuproxy's
code except the side being checked.

The fixture's commands do not exist on this machine, so no model ever starts (or binds a
port): llama-swap logs the command it tried (`logLevel: debug`), and that is compared.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from compat.sidebyside import Side, start_llamaswap
from scheduling.llamaswap import parse_config
from tests.conftest import free_port
from tests.helpers import until
from tests.llamaswap_fixture import FIXTURE_ENV, as_llamaswap, fixture_text

KEY = {"Authorization": "Bearer sk-alice-7f3a"}  # the fixture's first apiKeys entry
START_COMMAND = re.compile(r"<(?P<model>[^>]+)> Executing start command: (?P<cmd>.*), env: ")


@pytest.fixture
def start_port() -> int:
    return free_port()


@pytest.fixture
def llamaswap(llamaswap_bin: Path, tmp_path: Path, start_port: int) -> Iterator[Side]:
    data = as_llamaswap()
    data["startPort"] = start_port
    # yaml.safe_dump(sort_keys=False) keeps the macros' order
    ls = start_llamaswap(llamaswap_bin, yaml.safe_dump(data, sort_keys=False), tmp_path,
                         free_port(), key=KEY["Authorization"].split()[-1], env=FIXTURE_ENV)
    yield ls
    ls.stop()


def ours(serve, start_port: int):
    config = fixture_text().replace("startPort: 9100", f"startPort: {start_port}")
    assert f"startPort: {start_port}" in config
    return serve(config, extra_env=FIXTURE_ENV)


def listing(http: httpx.Client) -> dict[str, dict]:
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


@pytest.mark.django_db(transaction=True)  # `gpuproxy serve` uses this run's test database
def test_both_list_the_same_models_with_the_same_names(llamaswap, serve, start_port):
    proxy = ours(serve, start_port)
    proxy.http.headers.update(KEY)
    theirs, mine = listing(llamaswap.http), listing(proxy.http)
    kind = {i: m["meta"]["llamaswap"]["type"] for i, m in theirs.items()}
    # Both list the fixture's selector and its peer's model (issue 19); only llama-swap lists
    # vllm-32b (`enabled: false`, a gpuproxy extension llama-swap never sees).
    assert {i for i, k in kind.items() if k in ("selector", "peer")} == {
        "fast", "openrouter/deepseek/deepseek-v3.2"}
    assert set(theirs) - set(mine) == {"vllm-32b"}
    assert set(mine) <= set(theirs)
    # includeAliasesInList: aliases are listed by both; `embed` is unlisted by both.
    assert {"chat", "gpt-4o-mini", "qwen-coder:think"} <= set(mine)
    assert "embed" not in theirs and "embed" not in mine
    for model_id in mine:
        for field in ("name", "description"):
            assert mine[model_id].get(field, "") == theirs[model_id].get(field, ""), (
                model_id, field)
    # metadata with macros and ${PORT}, as llama-swap expands them
    for field in ("port", "ctx", "note"):
        assert (mine["llama-8b"]["meta"]["llamaswap"][field]
                == theirs["llama-8b"]["meta"]["llamaswap"][field]), field


def test_both_build_the_same_command_line_for_every_model(llamaswap, start_port):
    config = fixture_text().replace("startPort: 9100", f"startPort: {start_port}")
    expected = {m.model_id: m.cmd for m in parse_config(config, FIXTURE_ENV).models}
    for model_id in expected:
        # Each request makes llama-swap try the model's command (which does not exist here).
        llamaswap.http.post("/v1/chat/completions", json={
            "model": model_id, "messages": [{"role": "user", "content": "hi"}]})
    tried = until("llama-swap tried every model's command", lambda: (
        found if len(found := {m["model"]: m["cmd"] for m in
                               START_COMMAND.finditer(llamaswap.output())}) == len(expected)
        else None), within=60)
    assert tried == expected


def test_llamaswap_refuses_its_own_example(llamaswap_bin, reference, tmp_path):
    """Where gpuproxy is lenient on purpose (docs/configuration.md, "Differences from
    llama-swap"): llama-swap's binary refuses its own example, which gpuproxy imports with
    warnings (test_llamaswap_example.py). First for `unlisted-model`'s default proxy without
    ${PORT} in its cmd; with that set, for a priority that names no model."""
    example = (reference / "llama-swap-config.example.yaml").read_text()
    env = {**os.environ, "HOME": "/home/ada", "API_KEY_1": "sk-env-one",
           "API_KEY_2": "sk-env-two", "OPENROUTER_API_KEY": "sk-or-123"}

    def refusal(text: str) -> str:
        config = tmp_path / "example.yaml"
        config.write_text(text)
        r = subprocess.run([str(llamaswap_bin), "-config", str(config), "-listen",
                            f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=30)
        assert r.returncode != 0, r.stdout + r.stderr
        return r.stdout + r.stderr

    assert "model unlisted-model: proxy uses ${PORT} but cmd does not" in refusal(example)
    unlisted = '    cmd: some-upstream-server\n'
    assert example.count(unlisted) == 1
    fixed = example.replace(unlisted, unlisted + "    proxy: http://127.0.0.1:9\n")
    # Go ranges over the priority map in random order: the name it reports first varies
    # (A, B, C, D all name no model), so any of them is llama-swap's refusal.
    said = refusal(fixed)
    assert re.search(r'fifo\.priority references unknown model \\"[ABCD]\\"', said), said
