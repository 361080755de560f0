"""The parser's result: plain frozen data (`ParsedConfig` and its parts) that the importer
copies into rows, with the defaults for every key a file leaves out.

Its own module so that the shape of a parsed config, and its defaults, have one owner that
both the parser and scheduling/importer.py read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

# Defaults, kept equal to the model defaults in scheduling/models.py (which this package may not
# import); tests/test_config_import.py checks that an empty config imports to those defaults.
DEFAULT_SCHEDULER = "serial"
SCHEDULERS = ("serial", "fifo")
DEFAULT_AGING_DIVISOR = 60.0
DEFAULT_SWAP_AFFINITY_BONUS = 10
MAX_SWAP_AFFINITY_BONUS = 99
DEFAULT_HEALTH_CHECK_TIMEOUT = 120
MIN_HEALTH_CHECK_TIMEOUT = 15
DEFAULT_UNLOAD_TIMEOUT = 10
DEFAULT_START_PORT = 5800
DEFAULT_PERFORMANCE_INTERVAL = 5.0  # llama-swap's code default (its schema says 15s)
MIN_PERFORMANCE_INTERVAL = 1.0
DEFAULT_PROXY = "http://localhost:${PORT}"
DEFAULT_CHECK_ENDPOINT = "/health"
RESERVED_MACROS = ("PID", "PORT", "MODEL_ID")
IMPLICIT_GROUP = "(default)"  # scheduling/swapper.py's name for "in no group"
MODEL_ID_MAX = 255
API_KEY_NAME_MAX = 100

Scalar = str | int | float | bool


@dataclass(frozen=True)
class ParsedSettings:
    """Everything that becomes the `ProxySettings` row; missing keys keep these defaults."""

    scheduler: str = DEFAULT_SCHEDULER
    aging_divisor: float = DEFAULT_AGING_DIVISOR
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS
    affinity_budget: str = ""  # "", "auto" or seconds (scheduling/affinity_budget.py)
    health_check_timeout: int = DEFAULT_HEALTH_CHECK_TIMEOUT
    global_ttl: int = 0
    unload_timeout: int = DEFAULT_UNLOAD_TIMEOUT
    start_port: int = DEFAULT_START_PORT
    send_loading_state: bool = False
    include_aliases_in_list: bool = False
    performance_monitoring: bool = True
    performance_interval: float = DEFAULT_PERFORMANCE_INTERVAL
    preload: tuple[str, ...] = ()
    max_waiting: int = 20_000
    max_waiting_per_band: dict[str, int] = field(default_factory=dict)
    queue_timeout: int = 0
    # `queue.priority: {min, max, default}` (gpuproxy): keys without their own; unset = none
    priority_range: tuple[int | None, int | None, int | None] = (None, None, None)
    capture_buffer_mb: int = 0
    router: str = "group"  # `routing.router.use` (or "matrix" for a top-level `matrix:`)
    matrix_vars: dict[str, str] = field(default_factory=dict)
    matrix_evict_costs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedModel:
    """One `models.<id>` entry with every macro expanded; field names follow ModelDefinition.

    The dict fields are plain JSON-able data for JSONField; treat them as read-only.
    """

    model_id: str
    cmd: str
    proxy: str
    name: str = ""
    description: str = ""
    cmd_stop: str = ""
    port: int | None = None
    check_endpoint: str = DEFAULT_CHECK_ENDPOINT
    ttl: int = -1
    unload_timeout: int = 0
    aliases: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    unlisted: bool = False
    use_model_name: str = ""
    concurrency_limit: int = 0
    parallel: int | None = None  # not written: the importer reads it from cmd (slots.py)
    strip_params: str = ""
    set_params: dict[str, Any] = field(default_factory=dict)
    set_params_by_id: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)
    send_loading_state: bool | None = None
    fifo_priority: int = 0
    enabled: bool = True
    vllm_priority: bool = False
    stream_idle_timeout: int = 600
    nodes: tuple[str, ...] = ()  # `nodes` (gpuproxy): where it runs; () = every node
    group: str | None = None


@dataclass(frozen=True)
class ParsedGroup:
    group_id: str
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False
    members: tuple[str, ...] = ()


PEER_TIMEOUTS = {"connect": 30, "keepalive": 30, "responseHeader": 60, "tlsHandshake": 10,
                 "expectContinue": 1, "idleConn": 90}  # llama-swap's defaults for a peer
PRIORITY_FORWARD = ("header", "vllm", "service_tier", "none")
SELECTOR_STRATEGIES = ("warm", "pin", "spillover")


@dataclass(frozen=True)
class ParsedPeer:
    """`peers.<id>`; `timeouts` holds only what the file writes (the catalog adds defaults)."""

    peer_id: str
    proxy: str
    models: tuple[str, ...]
    api_key: str = field(default="", repr=False)
    strip_params: str = ""
    set_params: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)
    priority_forward: str = "header"


@dataclass(frozen=True)
class ParsedSelector:
    """`selectors.<id>`, targets as written (scheduling/routing_checks.py resolves them)."""

    selector_id: str
    strategy: str
    targets: tuple[str, ...]
    spillover: int = 1
    name: str = ""
    description: str = ""
    unlisted: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedProfile:
    """`profiles.<name>`; a pin to None (YAML null or "") disables the requested name."""

    name: str
    pins: dict[str, str | None]
    description: str = ""


@dataclass(frozen=True)
class ParsedApiKey:
    """An `apiKeyHashes` entry: a key known only by its SHA-256 (what export writes)."""

    name: str
    sha256: str
    prefix: str | None = None  # None = keep what the database has
    admin: bool | None = None  # `admin:` (gpuproxy); None = keep what the database has
    peer: bool | None = None  # `peer:` (gpuproxy): a trusted peer; None = keep the database's
    # `priority: {min, max, default}` (gpuproxy); None = keep the database's
    priority: tuple[int | None, int | None, int | None] | None = None


@dataclass(frozen=True)
class ParsedConfig:
    settings: ParsedSettings
    models: tuple[ParsedModel, ...]
    groups: tuple[ParsedGroup, ...]
    # Plain keys from `apiKeys`; kept out of repr so a logged config never shows a secret.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_hashes: tuple[ParsedApiKey, ...] = ()
    # `admin:` of an `apiKeyHashes` entry that is the export of a plain key listed beside it
    plain_key_admin: dict[str, bool] = field(default_factory=dict)  # sha256 -> admin
    plain_key_peer: dict[str, bool] = field(default_factory=dict)  # sha256 -> trusted peer
    plain_key_priority: dict[str, tuple[int | None, int | None, int | None]] = field(
        default_factory=dict)  # sha256 -> priority range
    # `routing.router.settings.matrix.sets` (or a top-level `matrix:`'s): (name, DSL) in order
    matrix_sets: tuple[tuple[str, str], ...] = ()
    peers: tuple[ParsedPeer, ...] = ()
    selectors: tuple[ParsedSelector, ...] = ()
    profiles: tuple[ParsedProfile, ...] = ()
    warnings: list[str] = field(default_factory=list)


def api_key_name(key: str) -> str:
    """The row name for a plain `apiKeys` entry: stable, so re-imports update in place."""
    return "config-" + hashlib.sha256(key.encode()).hexdigest()[:8]
