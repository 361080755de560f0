"""What compat/ checks against: llama-swap's own reference files and binary, outside the repo.

`make compat` points LLAMASWAP_REFERENCE at llama-swap's example config and JSON schema
(../shared/reference beside the checkout) and LLAMASWAP_BIN at its binary. A missing one fails
the check with the path it looked at; it is never skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite's own fixtures: a test database of this run's own, the pool closed at the end,
# `gpuproxy serve` subprocesses, free ports.
from tests.conftest import (  # noqa: F401
    _close_db_pool_at_end,
    django_db_modify_db_settings,
    port,
    serve,
    serve_workers,
)


def _required(variable: str, default: str, what: str) -> Path:
    path = Path(os.environ.get(variable) or default).resolve()
    if not path.exists():
        pytest.fail(f"{what} is missing: expected it at {path} (set {variable}; `make compat` "
                    "defaults to llama-swap's files in ../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def reference() -> Path:
    return _required("LLAMASWAP_REFERENCE", "../shared/reference",
                     "llama-swap's reference folder (example config and JSON schema)")


@pytest.fixture(scope="session")
def llamaswap_bin() -> Path:
    return _required("LLAMASWAP_BIN", "../shared/peers/llama-swap/llama-swap",
                     "the llama-swap binary")
