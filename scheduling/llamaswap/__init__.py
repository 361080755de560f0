"""Read a llama-swap `config.yaml` into plain, frozen data: the pure half of `import_config`.

No Django here (tests/test_purity.py checks it), so every rule can be tested without a database
and the importer only has to copy fields. The rules follow llama-swap's own loader
(`internal/config/load.go`) in the order it applies them:

1. `${env.NAME}` is replaced in the raw text, except inside YAML comments; an unset variable is
   an error, because llama-swap refuses such a file too (loading.py, in the YAML 1.2 dialect
   of dialect.py).
2. Global `macros`, then each model's `macros` (overriding), are expanded in every model value.
   A macro may use macros defined above it. `${MODEL_ID}` is the model's id (macros.py).
3. `${PORT}` is handed out from `startPort` in sorted model-id order, only to models whose `cmd`
   uses it (model_entries.py, by scheduling/ports.py's rule). `${PID}` stays literal in
   `cmdStop` for the process manager.
4. Anything still written `${...}` is an error that names the key and what to do.

Where gpuproxy cannot honour a section or key (logLevel, store, ui, ...) it says so in a
warning instead of dropping it silently (errors.py); `docs/configuration.md` lists the
differences.

The modules, by job: parser.py (the whole file, `parse_config`), reader.py (typed reading),
model_entries.py, routing.py (groups, the matrix, the scheduler, preload), peers.py,
selectors.py (selectors and profiles) and api_keys.py (the sections), parsed.py (the result and its
defaults), values.py (messages, Go's formatting, the JSON check). This package re-exports what
the rest of gpuproxy imports, so importers name only `scheduling.llamaswap`.
"""

from scheduling.llamaswap.dialect import dump_yaml
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import (
    API_KEY_NAME_MAX,
    DEFAULT_AGING_DIVISOR,
    DEFAULT_CHECK_ENDPOINT,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_PERFORMANCE_INTERVAL,
    DEFAULT_PROXY,
    DEFAULT_SCHEDULER,
    DEFAULT_START_PORT,
    DEFAULT_SWAP_AFFINITY_BONUS,
    DEFAULT_UNLOAD_TIMEOUT,
    IMPLICIT_GROUP,
    MAX_SWAP_AFFINITY_BONUS,
    MIN_HEALTH_CHECK_TIMEOUT,
    MIN_PERFORMANCE_INTERVAL,
    MODEL_ID_MAX,
    RESERVED_MACROS,
    SCHEDULERS,
    ParsedApiKey,
    ParsedConfig,
    ParsedGroup,
    ParsedModel,
    ParsedPeer,
    ParsedProfile,
    ParsedSelector,
    ParsedSettings,
    Scalar,
    api_key_name,
)
from scheduling.llamaswap.parser import parse_config
from scheduling.llamaswap.values import format_go_duration, parse_go_duration

__all__ = [
    "API_KEY_NAME_MAX",
    "DEFAULT_AGING_DIVISOR",
    "DEFAULT_CHECK_ENDPOINT",
    "DEFAULT_HEALTH_CHECK_TIMEOUT",
    "DEFAULT_PERFORMANCE_INTERVAL",
    "DEFAULT_PROXY",
    "DEFAULT_SCHEDULER",
    "DEFAULT_START_PORT",
    "DEFAULT_SWAP_AFFINITY_BONUS",
    "DEFAULT_UNLOAD_TIMEOUT",
    "IMPLICIT_GROUP",
    "MAX_SWAP_AFFINITY_BONUS",
    "MIN_HEALTH_CHECK_TIMEOUT",
    "MIN_PERFORMANCE_INTERVAL",
    "MODEL_ID_MAX",
    "RESERVED_MACROS",
    "SCHEDULERS",
    "ConfigError",
    "ParsedApiKey",
    "ParsedConfig",
    "ParsedGroup",
    "ParsedModel",
    "ParsedPeer",
    "ParsedProfile",
    "ParsedSelector",
    "ParsedSettings",
    "Scalar",
    "api_key_name",
    "dump_yaml",
    "format_go_duration",
    "parse_config",
    "parse_go_duration",
]
