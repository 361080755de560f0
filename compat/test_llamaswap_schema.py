"""llama-swap's JSON schema (its repository's config-schema.json) accepts our fixture once
gpuproxy's extensions are removed, and refuses it with them: the fixture is a real llama-swap
config, and the extensions are really ours (docs/configuration.md, "gpuproxy extensions").

The schema is stricter than llama-swap's code in two places the fixture uses on purpose, and
llama-swap's code is what runs (test_llamaswap_binary.py loads the same file):
- `healthCheckTimeout` below 15: the schema's minimum; the code raises it to 15
  (internal/config/load.go), as gpuproxy does, with a warning;
- the legacy `filters.strip_params`: not in the schema; the code reads it
  (internal/config/model_config.go, ModelFilters), as gpuproxy does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.llamaswap_fixture import as_llamaswap, fixture_text


@pytest.fixture(scope="module")
def validator(reference: Path) -> jsonschema.Draft7Validator:
    schema = json.loads((reference / "llama-swap-config-schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(validator: jsonschema.Draft7Validator, data: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in validator.iter_errors(data)]


def test_llamaswaps_own_example_is_valid(validator, reference):
    """The validator is used the way llama-swap's own CI uses the schema."""
    example = yaml.safe_load((reference / "llama-swap-config.example.yaml").read_text())
    assert errors(validator, example) == []


SCHEMA_STRICTER_THAN_CODE = {"healthCheckTimeout", "models.qwen-coder.filters"}


def paths(found: list[str]) -> set[str]:
    return {e.split(": ", 1)[0] for e in found}


def test_the_fixture_without_gpuproxys_extensions_is_valid(validator):
    found = errors(validator, as_llamaswap())
    assert paths(found) == SCHEMA_STRICTER_THAN_CODE, found


def test_with_them_only_the_serial_scheduler_is_refused(validator):
    """docs/configuration.md: llama-swap ignores unknown keys, so `parallel`, `enabled`,
    `apiKeyHashes`... do not stop a file from working there; `routing.scheduler.use: serial`
    (and its settings) does."""
    found = errors(validator, yaml.safe_load(fixture_text()))
    assert paths(found) == SCHEMA_STRICTER_THAN_CODE | {"routing.scheduler.use",
                                                        "routing.scheduler.settings"}, found
