"""The `models:` section: each entry with its macros and `${PORT}` expanded, checked, and read
into a `ParsedModel`; then the aliases (explicit, and the `setParamsByID` keys) checked across
models.

`${PORT}` numbers come from scheduling/ports.py, the one owner of that rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from scheduling.llamaswap.errors import MODEL_UNSUPPORTED, ConfigError
from scheduling.llamaswap.macros import (
    DuplicateKey,
    check_unresolved,
    macro_table,
    resolve_macros,
    subst,
)
from scheduling.llamaswap.parsed import (
    DEFAULT_CHECK_ENDPOINT,
    DEFAULT_PROXY,
    MODEL_ID_MAX,
    ParsedModel,
    Scalar,
)
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.values import check_json, describe
from scheduling.nodes import bad_node_name
from scheduling.ports import MAX_PORT, NoPortLeft, allocate_ports
from scheduling.spec import split_command, strip_comments

_MODEL_KEYS = frozenset({
    "cmd", "cmdStop", "proxy", "checkEndpoint", "ttl", "unloadTimeout", "aliases", "env", "name",
    "description", "unlisted", "useModelName", "concurrencyLimit", "sendLoadingState", "filters",
    "macros", "metadata", "capabilities", "parallel", "enabled", "vllmPriority",
    "streamIdleTimeout", "nodes"})
# Values that are always strings: macros are written into them as text, never with a type.
_MODEL_TEXT_KEYS = frozenset({
    "cmd", "cmdStop", "proxy", "checkEndpoint", "name", "description", "useModelName", "aliases",
    "env", "nodes"})
_ENV_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_MODALITIES = ("text", "audio", "image")


def read_models(r: Reader, global_macros: Mapping[str, Scalar],
                start_port: int) -> tuple[ParsedModel, ...]:
    raw_models = r.mapping(r.data.get("models"), "models")
    expanded: dict[str, dict[str, Any]] = {}
    defaulted_proxy: set[str] = set()
    macro_names: dict[str, set[str]] = {}
    for model_id, raw in raw_models.items():
        path = f"models.{model_id}"
        if not model_id or model_id != model_id.strip():
            raise ConfigError(path, "a model id must be non-empty, without surrounding "
                                    "spaces")
        if len(model_id) > MODEL_ID_MAX:
            raise ConfigError(path, f"a model id may have at most {MODEL_ID_MAX} "
                                    "characters")
        if raw is None:
            raise ConfigError(path, "empty; a model needs at least `cmd:`")
        raw = r.mapping(raw, path)
        for key in raw:
            if key in MODEL_UNSUPPORTED:
                r.warn(f"{path}.{key}", MODEL_UNSUPPORTED[key])
            elif key not in _MODEL_KEYS:
                r.known_keys({key: None}, path, frozenset())
        if model_id == "comfyui_auto":
            r.warn(path, "llama-swap's ComfyUI special case (/comfyui passthrough, "
                         "concurrency of at least 50) is not supported by gpuproxy; "
                         "imported as an ordinary model")
        own_macros = macro_table(r.mapping(raw.get("macros"), f"{path}.macros"),
                                 f"{path}.macros")
        macro_names[model_id] = set(global_macros) | set(own_macros)
        macros = resolve_macros(model_id, global_macros, own_macros)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in _MODEL_KEYS or key == "macros":
                continue
            if key in ("cmd", "cmdStop") and isinstance(value, str):
                # Comment lines go before expansion, so a macro named only in a comment
                # is not required (llama-swap strips them first too).
                value = strip_comments(value)
            try:
                values[key] = subst(value, macros, typed=key not in _MODEL_TEXT_KEYS)
            except DuplicateKey as dup:
                raise ConfigError(f"{path}.{key}", f"two keys both become {dup} after "
                                                   "macro expansion; keep one") from None
        if values.get("proxy") is None:
            values["proxy"] = DEFAULT_PROXY
            defaulted_proxy.add(model_id)
        if values.get("cmd") is None:
            raise ConfigError(f"{path}.cmd", "required: the command that starts the "
                                             "model's server")
        r.text(values["cmd"], f"{path}.cmd")
        expanded[model_id] = values

    # ${PORT}: only for models whose cmd uses it (llama-swap); the order is ports.py's rule.
    try:
        ports = allocate_ports([model_id for model_id, values in expanded.items()
                                if "${PORT}" in values["cmd"]], start_port, last=MAX_PORT)
    except NoPortLeft as full:
        raise ConfigError(f"models.{full.model_id}.cmd",
                          f"no port left for ${{PORT}}: startPort {start_port} "
                          f"plus one port per model passes {MAX_PORT}; lower startPort"
                          ) from None

    parsed = []
    for model_id, values in expanded.items():
        port = ports.get(model_id)
        if port is not None:
            values = {key: subst(value, {"PORT": port}, typed=key not in _MODEL_TEXT_KEYS)
                      for key, value in values.items()}
        elif model_id in defaulted_proxy:
            r.warn(f"models.{model_id}.proxy",
                   "not set, and cmd does not use ${PORT}, so the default "
                   "http://localhost:${PORT} points at a port the server is never told; "
                   "add `--port ${PORT}` to cmd, or set proxy to the server's address")
        check_unresolved(model_id, values, macro_names[model_id],
                         skip_proxy=model_id in defaulted_proxy and port is None)
        parsed.append(read_model(r, model_id, values, port))
    return tuple(parsed)


def read_model(r: Reader, model_id: str, values: dict[str, Any], port: int | None) -> ParsedModel:
    path = f"models.{model_id}"

    def at(key: str) -> str:
        return f"{path}.{key}"

    cmd = _one_line(r.text(values["cmd"], at("cmd")))
    if not cmd:
        raise ConfigError(at("cmd"), "empty once comment lines are removed; write the "
                                     "command that starts the model's server")
    try:
        split_command(cmd)
    except ValueError as exc:
        raise ConfigError(at("cmd"), f"cannot be split into arguments: {exc}; check the "
                                     "quotes") from None
    cmd_stop = _one_line(r.text(values.get("cmdStop"), at("cmdStop")))
    if cmd_stop:
        try:
            split_command(cmd_stop.replace("${PID}", "0"))
        except ValueError as exc:
            raise ConfigError(at("cmdStop"), f"cannot be split into arguments: {exc}; "
                                             "check the quotes") from None
    proxy = r.text(values["proxy"], at("proxy"))
    if not proxy.startswith(("http://", "https://")):
        raise ConfigError(at("proxy"), f"must be an http:// or https:// URL, got {proxy!r}")
    env = r.strings(values.get("env"), at("env"))
    for i, entry in enumerate(env):
        if not _ENV_ENTRY.match(entry):
            raise ConfigError(f"{at('env')}[{i}]", f'expected "NAME=value", got {entry!r}')
    aliases = r.strings(values.get("aliases"), at("aliases"))
    for i, alias in enumerate(aliases):
        if not alias.strip():
            raise ConfigError(f"{at('aliases')}[{i}]", "an alias must not be empty")
    ttl = r.integer(values.get("ttl"), at("ttl"), -1)
    if ttl < -1:
        raise ConfigError(at("ttl"), f"must be -1 (use globalTTL), 0 (never unload) or a "
                                     f"number of seconds, got {ttl}")
    filters = _filters(r, values.get("filters"), at("filters"))
    metadata = r.mapping(values.get("metadata"), at("metadata"))
    check_json(metadata, at("metadata"))
    capabilities = _capabilities(r, values.get("capabilities"), at("capabilities"))
    loading = values.get("sendLoadingState")
    return ParsedModel(
        model_id=model_id,
        cmd=cmd,
        proxy=proxy,
        name=r.text(values.get("name"), at("name")),
        description=r.text(values.get("description"), at("description")),
        cmd_stop=cmd_stop,
        port=port,
        check_endpoint=r.text(values.get("checkEndpoint"), at("checkEndpoint"),
                              DEFAULT_CHECK_ENDPOINT),
        ttl=ttl,
        unload_timeout=r.integer(values.get("unloadTimeout"), at("unloadTimeout"), 0,
                                 minimum=0),
        aliases=tuple(aliases),
        env=tuple(env),
        unlisted=r.boolean(values.get("unlisted"), at("unlisted"), False),
        use_model_name=r.text(values.get("useModelName"), at("useModelName")),
        concurrency_limit=r.integer(values.get("concurrencyLimit"),
                                    at("concurrencyLimit"), 0, minimum=0),
        parallel=None if values.get("parallel") is None else r.integer(
            values["parallel"], at("parallel"), 1, minimum=1),
        strip_params=filters[0],
        set_params=filters[1],
        set_params_by_id=filters[2],
        metadata=metadata,
        capabilities=capabilities,
        send_loading_state=None if loading is None else r.boolean(
            loading, at("sendLoadingState"), False),
        enabled=r.boolean(values.get("enabled"), at("enabled"), True),
        vllm_priority=r.boolean(values.get("vllmPriority"), at("vllmPriority"), False),
        stream_idle_timeout=r.integer(values.get("streamIdleTimeout"),
                                      at("streamIdleTimeout"), 600, minimum=1),
        nodes=_nodes(r, values.get("nodes"), at("nodes")),
    )


def _nodes(r: Reader, value: Any, path: str) -> tuple[str, ...]:
    """`nodes` (gpuproxy extension): the fleet's nodes that run the model, by their
    GPUPROXY_NODE names; absent or empty = every node."""
    names = r.strings(value, path)
    for i, name in enumerate(names):
        why = bad_node_name(name)
        if why is None and name in names[:i]:
            why = f"node {name!r} is listed twice"
        if why:
            raise ConfigError(f"{path}[{i}]", why)
    return tuple(names)


def _filters(r: Reader, value: Any, path: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    filters = r.mapping(value, path)
    r.known_keys(filters, path, frozenset({"stripParams", "strip_params", "setParams",
                                           "setParamsByID"}))
    strip = r.text(filters.get("stripParams"), f"{path}.stripParams")
    legacy = r.text(filters.get("strip_params"), f"{path}.strip_params")
    if legacy and strip:
        r.warn(f"{path}.strip_params", "ignored because stripParams is also set (the "
                                       "legacy spelling only counts on its own)")
    strip = strip or legacy
    set_params = r.mapping(filters.get("setParams"), f"{path}.setParams")
    check_json(set_params, f"{path}.setParams")
    if "model" in set_params:
        r.warn(f"{path}.setParams.model", "ignored when requests are sent (model is "
                                          "protected; use useModelName)")
    by_id = r.mapping(filters.get("setParamsByID"), f"{path}.setParamsByID")
    for key, params in by_id.items():
        if not key:
            raise ConfigError(f"{path}.setParamsByID", "a requested id must not be empty")
        if not isinstance(params, dict):
            raise ConfigError(f"{path}.setParamsByID.{key}",
                              f"expected a mapping of parameters, got {describe(params)}")
    check_json(by_id, f"{path}.setParamsByID")
    return strip, set_params, by_id


def _capabilities(r: Reader, value: Any, path: str) -> dict[str, Any]:
    caps = r.mapping(value, path)
    r.known_keys(caps, path, frozenset({"in", "out", "tools", "reranker", "context"}))
    for key in ("in", "out"):
        for i, modality in enumerate(r.strings(caps.get(key), f"{path}.{key}")):
            if modality not in _MODALITIES:
                raise ConfigError(f"{path}.{key}[{i}]", f"unknown modality {modality!r}; "
                                                        "use text, audio or image")
    for key in ("tools", "reranker"):
        r.boolean(caps.get(key), f"{path}.{key}", False)
    r.integer(caps.get("context"), f"{path}.context", 0, minimum=0)
    check_json(caps, path)
    return caps


def check_aliases(r: Reader, models: tuple[ParsedModel, ...]
                  ) -> tuple[tuple[ParsedModel, ...], dict[str, str]]:
    """Aliases name one model each and never shadow a model id.

    Every `setParamsByID` key becomes an alias of its model (llama-swap does the same):
    the returned models' `aliases` hold the explicit ones followed by those, sorted. Also
    returns alias -> model id.
    """
    ids = {m.model_id for m in models}
    owner: dict[str, str] = {}
    updated: list[ParsedModel] = []
    for m in models:
        path = f"models.{m.model_id}"
        explicit: list[str] = []
        for i, alias in enumerate(m.aliases):
            where = f"{path}.aliases[{i}]"
            if alias == m.model_id:
                r.warn(where, "the model's own id; dropped")
                continue
            if alias in ids:
                raise ConfigError(where, f"{alias!r} is already a model id; an alias must "
                                         "not shadow a model")
            if alias in owner:
                raise ConfigError(where, _alias_taken(alias, owner[alias], m.model_id))
            owner[alias] = m.model_id
            explicit.append(alias)
        auto: list[str] = []
        for key in m.set_params_by_id:
            where = f"{path}.filters.setParamsByID.{key}"
            if key == m.model_id:
                continue
            if key in ids:
                raise ConfigError(where, f"{key!r} is already a model id; a setParamsByID "
                                         "key becomes an alias and must not shadow a model")
            if key in owner:
                if owner[key] == m.model_id:
                    continue
                raise ConfigError(where, _alias_taken(key, owner[key], m.model_id))
            owner[key] = m.model_id
            auto.append(key)
        # Sorted: the database (jsonb) does not keep the key order of setParamsByID, and
        # export must be able to tell these apart from the explicit aliases.
        updated.append(replace(m, aliases=tuple(explicit + sorted(auto))))
    return tuple(updated), owner


def _alias_taken(alias: str, owner: str, model_id: str) -> str:
    if owner == model_id:
        return f"{alias!r} is listed twice for this model"
    return f"{alias!r} is already an alias of model {owner!r}; aliases must be unique"


def _one_line(cmd: str) -> str:
    """A multi-line `cmd` as the one command line it stands for.

    `#` lines are comments; a trailing `\\` and a plain line break both just separate
    arguments, as llama-swap's own splitting treats them.
    """
    parts = []
    for line in strip_comments(cmd).splitlines():
        line = line.strip()
        if line.endswith("\\"):
            line = line[:-1].rstrip()
        if line:
            parts.append(line)
    return " ".join(parts)
