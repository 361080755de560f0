"""tests/data/llama-swap-config.yaml, our own llama-swap config fixture, and the environment it
reads. compat/ also uses `as_llamaswap` to hand the same file to llama-swap itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

FIXTURE = Path(__file__).resolve().parent / "data" / "llama-swap-config.yaml"
FIXTURE_ENV = {"MODELS": "/srv/models", "CI_KEY": "sk-ci-5150", "HF_TOKEN": "hf_abc",
               "OPENROUTER_KEY": "sk-or-9"}

# gpuproxy's extensions in the fixture (docs/configuration.md, "gpuproxy extensions"), written
# out by hand: what `as_llamaswap` removes.
TOP_EXTENSIONS = ("apiKeyHashes", "queue")
MODEL_EXTENSIONS = ("parallel", "enabled", "vllmPriority", "streamIdleTimeout")


def fixture_text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


def as_llamaswap() -> dict[str, Any]:
    """The fixture minus gpuproxy's extensions: what a llama-swap user's file holds.

    Read with yaml's own loader, which keeps mapping order (llama-swap expands macros in
    declaration order, so a sorted dump would change their meaning)."""
    data = yaml.safe_load(fixture_text())
    for key in TOP_EXTENSIONS:
        data.pop(key)
    for model in data["models"].values():
        for key in MODEL_EXTENSIONS:
            model.pop(key, None)
    scheduler = data["routing"]["scheduler"]
    del scheduler["use"]  # serial; llama-swap knows only fifo
    del scheduler["settings"]["serial"]
    return data
