"""CORS on /v1/*, side by side: llama-swap's binary and `gpuproxy serve` on the same config
(with API keys, where gpuproxy's /v1/* is as permissive as llama-swap's; without keys it
answers only its own and the listed origins, docs/security.md "Exposure policy"). What
llama-swap answers is the expectation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from compat.sidebyside import start_llamaswap
from tests.conftest import free_port

KEY = "sk-cors-compat"
CONFIG = f"""
apiKeys: ["{KEY}"]
models:
  m:
    cmd: /bin/false
    proxy: http://127.0.0.1:9
"""
CORS = ("access-control-allow-origin", "access-control-allow-methods",
        "access-control-allow-headers", "access-control-max-age")
PATHS = ["/v1/chat/completions", "/v1/models", "/v1/embeddings", "/v1/audio/transcriptions",
         "/completion", "/v1/responses"]
PREFLIGHTS = [
    {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"},
    {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
     "Access-Control-Request-Headers": "authorization, content-type, x-llamaswap-priority"},
    {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "GET",
     "Access-Control-Request-Headers": "X-Api-Key, bad(header, x-llamaswap-queue-timeout"},
    {},  # any OPTIONS
]


@pytest.fixture
def llamaswap(llamaswap_bin: Path, tmp_path: Path) -> Iterator[httpx.Client]:
    ls = start_llamaswap(llamaswap_bin, CONFIG, tmp_path, free_port())
    yield ls.http
    ls.stop()


def cors(r: httpx.Response) -> tuple:
    return (r.status_code, *(r.headers.get(h) for h in CORS))


@pytest.mark.django_db(transaction=True)
def test_preflights_on_v1_are_answered_as_llama_swap_answers_them(llamaswap, serve):
    ours = serve(CONFIG)
    for path in PATHS:
        for headers in PREFLIGHTS:
            theirs = llamaswap.options(path, headers=headers)
            assert theirs.status_code == 204, (path, headers, theirs.text)
            assert cors(ours.http.options(path, headers=headers)) == cors(theirs), (
                path, headers)
    # a listing read from a page: both let the page read it
    listing = {"Origin": "https://chat.example", "Authorization": f"Bearer {KEY}"}
    theirs = llamaswap.get("/v1/models", headers=listing)
    mine = ours.http.get("/v1/models", headers=listing)
    assert (mine.status_code, mine.headers.get("access-control-allow-origin")) == (
        theirs.status_code, theirs.headers.get("access-control-allow-origin")) == (
        200, "https://chat.example")
