"""The whole file: top-level keys and settings, then each section in llama-swap's order
(models, aliases, groups and the matrix, scheduler, preload, API keys, peers, selectors,
profiles), into one `ParsedConfig`. What selectors, profiles and the matrix name is checked
against the models by scheduling/routing_checks.py when the config is imported.

`parse_config` is the entry point (re-exported by the package).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from scheduling.llamaswap.api_keys import read_api_keys, read_priority_range
from scheduling.llamaswap.errors import TOP_UNSUPPORTED, ConfigError
from scheduling.llamaswap.loading import load_yaml
from scheduling.llamaswap.macros import macro_table
from scheduling.llamaswap.model_entries import check_aliases, read_models
from scheduling.llamaswap.parsed import (
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_PERFORMANCE_INTERVAL,
    DEFAULT_START_PORT,
    DEFAULT_UNLOAD_TIMEOUT,
    MIN_HEALTH_CHECK_TIMEOUT,
    MIN_PERFORMANCE_INTERVAL,
    ParsedConfig,
    ParsedSettings,
)
from scheduling.llamaswap.peers import read_peers
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.routing import (
    read_groups,
    read_matrix,
    read_preload,
    read_routing_scheduler,
)
from scheduling.llamaswap.selectors import read_profiles, read_selectors
from scheduling.ports import MAX_PORT


def _parse(r: Reader) -> ParsedConfig:
    data = r.data
    known_top = {"healthCheckTimeout", "startPort", "sendLoadingState",
                 "includeAliasesInList", "globalTTL", "unloadTimeout", "macros", "apiKeys",
                 "apiKeyHashes", "models", "groups", "routing", "hooks", "performance",
                 "upstream", "selectors", "queue", "captureBuffer", "peers", "profiles",
                 "matrix"}
    for key in data:
        if key in TOP_UNSUPPORTED:
            r.warn(key, TOP_UNSUPPORTED[key])
        elif key not in known_top:
            r.known_keys({key: None}, "", frozenset())
    _upstream(r)
    if "models" not in data:
        raise ConfigError("models", "required: add `models:` with at least one "
                                    "`<id>: {cmd: ...}` entry (or `models: {}` to remove "
                                    "every model)")
    settings = _settings(r)
    global_macros = macro_table(r.mapping(data.get("macros"), "macros"), "macros")
    models = read_models(r, global_macros, settings.start_port)
    models, alias_owner = check_aliases(r, models)
    ids = {m.model_id for m in models}

    def real_id(name: str) -> str | None:
        return name if name in ids else alias_owner.get(name)

    groups, group_of = read_groups(r, real_id)
    router, matrix_vars, matrix_costs, matrix_sets = read_matrix(r)
    scheduler, aging, bonus, priority, budget = read_routing_scheduler(r, real_id)
    preload = read_preload(r, real_id)
    settings = replace(settings, scheduler=scheduler, aging_divisor=aging,
                       swap_affinity_bonus=bonus, affinity_budget=budget, preload=preload,
                       router=router,
                       matrix_vars=matrix_vars, matrix_evict_costs=matrix_costs)
    models = tuple(replace(m, group=group_of.get(m.model_id),
                           fifo_priority=priority.get(m.model_id, 0)) for m in models)
    api_keys, api_key_hashes, plain_key_admin, plain_key_peer, plain_key_priority = (
        read_api_keys(r))
    return ParsedConfig(settings=settings, models=models, groups=groups, api_keys=api_keys,
                        api_key_hashes=api_key_hashes, plain_key_admin=plain_key_admin,
                        plain_key_peer=plain_key_peer, plain_key_priority=plain_key_priority,
                        matrix_sets=matrix_sets,
                        peers=read_peers(r), selectors=read_selectors(r),
                        profiles=read_profiles(r), warnings=r.warnings)


def _upstream(r: Reader) -> None:
    if "upstream" not in r.data:
        return
    upstream = r.mapping(r.data["upstream"], "upstream")
    for key in upstream:
        if key == "ignorePaths":
            r.warn("upstream.ignorePaths", "not supported by gpuproxy; ignored (every "
                                           "/upstream/<model>/ path may load its model)")
        else:
            r.known_keys({key: None}, "upstream", frozenset())


def _settings(r: Reader) -> ParsedSettings:
    data = r.data
    health = r.integer(data.get("healthCheckTimeout"), "healthCheckTimeout",
                       DEFAULT_HEALTH_CHECK_TIMEOUT)
    if health < MIN_HEALTH_CHECK_TIMEOUT:
        r.warn("healthCheckTimeout", f"{health} is below the minimum of "
                                     f"{MIN_HEALTH_CHECK_TIMEOUT} seconds; using "
                                     f"{MIN_HEALTH_CHECK_TIMEOUT}")
        health = MIN_HEALTH_CHECK_TIMEOUT
    global_ttl = r.integer(data.get("globalTTL"), "globalTTL", 0, minimum=0)
    unload = r.integer(data.get("unloadTimeout"), "unloadTimeout",
                       DEFAULT_UNLOAD_TIMEOUT, minimum=0) or DEFAULT_UNLOAD_TIMEOUT
    start_port = r.integer(data.get("startPort"), "startPort", DEFAULT_START_PORT,
                           minimum=1)
    if start_port > MAX_PORT:
        raise ConfigError("startPort", f"must be a port number 1..{MAX_PORT}, got {start_port}")
    performance = r.mapping(data.get("performance"), "performance")
    disabled = r.boolean(performance.get("disabled"), "performance.disabled", False)
    interval = r.duration(performance.get("every"), "performance.every",
                          DEFAULT_PERFORMANCE_INTERVAL)
    if interval < MIN_PERFORMANCE_INTERVAL:
        raise ConfigError("performance.every", f"must be at least 1s, got "
                                               f"{performance['every']}; every sample runs "
                                               "nvidia-smi or rocm-smi, so faster only "
                                               "costs CPU")
    r.known_keys({k: None for k in performance if k not in ("disabled", "every")},
                 "performance", frozenset())
    queue = r.mapping(data.get("queue"), "queue")
    r.known_keys(queue, "queue", frozenset({"maxWaiting", "maxWaitingPerBand",
                                            "timeout", "priority"}))
    per_band_raw = r.mapping(queue.get("maxWaitingPerBand"), "queue.maxWaitingPerBand")
    r.known_keys(per_band_raw, "queue.maxWaitingPerBand",
                 frozenset({"interactive", "normal", "batch"}))
    per_band: dict[str, int] = {
        b: r.integer(per_band_raw.get(b), f"queue.maxWaitingPerBand.{b}", 0, minimum=0)
        for b in ("interactive", "normal", "batch") if b in per_band_raw}
    return ParsedSettings(
        health_check_timeout=health,
        global_ttl=global_ttl,
        unload_timeout=unload,
        start_port=start_port,
        send_loading_state=r.boolean(data.get("sendLoadingState"), "sendLoadingState",
                                     False),
        include_aliases_in_list=r.boolean(data.get("includeAliasesInList"),
                                          "includeAliasesInList", False),
        performance_monitoring=not disabled,
        performance_interval=interval,
        max_waiting=r.integer(queue.get("maxWaiting"), "queue.maxWaiting", 20_000,
                              minimum=0),
        max_waiting_per_band=per_band,
        queue_timeout=r.integer(queue.get("timeout"), "queue.timeout", 0, minimum=0),
        priority_range=read_priority_range(r, queue.get("priority"), "queue.priority"),
        capture_buffer_mb=r.integer(data.get("captureBuffer"), "captureBuffer", 0, minimum=0),
    )


def parse_config(text: str, env: Mapping[str, str]) -> ParsedConfig:
    """Parse llama-swap YAML into a ParsedConfig, or raise ConfigError naming the key path.

    `env` supplies `${env.NAME}` (the process environment for a real import; tests pass a
    dict). Warnings for everything gpuproxy does not honour are in `.warnings`.
    """
    return _parse(Reader(load_yaml(text, env)))
