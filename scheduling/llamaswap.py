"""Read a llama-swap `config.yaml` into plain, frozen data: the pure half of `import_config`.

No Django here (tests/test_purity.py checks it), so every rule can be tested without a database
and the importer only has to copy fields. The rules follow llama-swap's own loader
(`internal/config/load.go`) in the order it applies them:

1. `${env.NAME}` is replaced in the raw text, except inside YAML comments; an unset variable is
   an error, because llama-swap refuses such a file too.
2. Global `macros`, then each model's `macros` (overriding), are expanded in every model value.
   A macro may use macros defined above it. `${MODEL_ID}` is the model's id.
3. `${PORT}` is handed out from `startPort` in sorted model-id order, only to models whose `cmd`
   uses it. `${PID}` stays literal in `cmdStop` for the process manager.
4. Anything still written `${...}` is an error that names the key and what to do.

Where gpuproxy cannot honour a section (matrix, peers, profiles, ...) it says so in a warning
instead of dropping it silently; `docs/configuration.md` lists the differences.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from fractions import Fraction
from typing import Any

import yaml

from scheduling.spec import split_command, strip_comments

# Defaults, kept equal to the model defaults in scheduling/models.py (which this module may not
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

_MACRO_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
_MACRO_REF = re.compile(r"\$\{([a-zA-Z0-9_-]+)\}")
_ANY_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_REF = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")
_ENV_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
_MODALITIES = ("text", "audio", "image")

Scalar = str | int | float | bool


class ConfigError(ValueError):
    """A config the importer must refuse. `path` is the YAML key path, e.g. `models.x.cmd`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class ParsedSettings:
    """Everything that becomes the `ProxySettings` row; missing keys keep these defaults."""

    scheduler: str = DEFAULT_SCHEDULER
    aging_divisor: float = DEFAULT_AGING_DIVISOR
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS
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
    group: str | None = None


@dataclass(frozen=True)
class ParsedGroup:
    group_id: str
    swap: bool = True
    exclusive: bool = True
    persistent: bool = False
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParsedApiKey:
    """An `apiKeyHashes` entry: a key known only by its SHA-256 (what export writes)."""

    name: str
    sha256: str
    prefix: str | None = None  # None = keep what the database has
    admin: bool | None = None  # `admin:` (gpuproxy); None = keep what the database has


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
    warnings: list[str] = field(default_factory=list)


def api_key_name(key: str) -> str:
    """The row name for a plain `apiKeys` entry: stable, so re-imports update in place."""
    return "config-" + hashlib.sha256(key.encode()).hexdigest()[:8]


# --------------------------------------------------------------------------------------------
# YAML dialect: Go's yaml.v3 (YAML 1.2 core schema), which llama-swap uses. PyYAML defaults to
# YAML 1.1, where `on` is true, `010` is 8, `1:30` is 90 and `2024-01-01` is a date; a config
# must mean the same here as in llama-swap.

_RESOLVERS: list[tuple[str, re.Pattern[str], list[str]]] = [
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
     list("tTfF")),
    ("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
     list("-+0123456789")),
    ("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"]),
]


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars."""


_Loader.yaml_implicit_resolvers = {}
for _tag, _regexp, _first in _RESOLVERS:
    _Loader.add_implicit_resolver(_tag, _regexp, _first)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = node.value
    try:
        if text.startswith("0x"):
            return int(text[2:], 16)
        if text.startswith("0o"):
            return int(text[2:], 8)
        return int(text, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer", node.start_mark) from None


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = node.value.lower()
    if text in (".inf", "+.inf"):
        return math.inf
    if text == "-.inf":
        return -math.inf
    if text == ".nan":
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{node.value!r} is not a number", node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or 1.2 would read as something else."""


for _tag, _regexp, _first in _RESOLVERS:
    _Dumper.add_implicit_resolver(_tag, _regexp, _first)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Mapping[str, Any]) -> str:
    """YAML that `parse_config` reads back to the same values (no line wrapping)."""
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                     default_flow_style=False, width=1_000_000)


# --------------------------------------------------------------------------------------------
# Small helpers


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _go_float(value: float) -> str:
    """A float as Go's `%v` prints it, which is how llama-swap puts a macro into a string."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)
    digits = list(digit_tuple)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exponent += 1
    text = "".join(map(str, digits))
    count = len(digits)
    point = count + exponent
    exp = point - 1
    minus = "-" if sign else ""
    if exp < -4 or exp >= 6:  # strconv 'g' with the shortest precision switches at 1e6
        mantissa = text[0] + ("." + text[1:] if count > 1 else "")
        return f"{minus}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{minus}0.{'0' * -point}{text}"
    if point >= count:
        return f"{minus}{text}{'0' * (point - count)}"
    return f"{minus}{text[:point]}.{text[point:]}"


def _go_str(value: Any) -> str:
    """How llama-swap writes a macro value into a string (`fmt.Sprintf("%v")`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    return str(value)


_MICRO = Fraction(1, 10**6)
_DURATION_UNITS = {"ns": Fraction(1, 10**9), "us": _MICRO, "\u00b5s": _MICRO, "\u03bcs": _MICRO,
                   "ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60),
                   "h": Fraction(3600)}
_DURATION_PART = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h)"
_DURATION = re.compile(rf"[-+]?(?:0|(?:{_DURATION_PART})+)")
_DURATION_SPLIT = re.compile(r"([0-9.]+)([^0-9.]+)")
_DURATION_MAX = Fraction(2**63 - 1, 10**9)  # Go's time.Duration is int64 nanoseconds


def parse_go_duration(text: str) -> float:
    """Seconds in a Go duration string ("15s", "1m30s", "1.5h"), read as Go's
    `time.ParseDuration` reads it, since that is what llama-swap accepts for `performance.every`.

    Summed exactly (not in float steps) so that `format_go_duration`'s output reads back as the
    very same float, which is what keeps export → import free of spurious changes.
    """
    if not _DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a duration")
    total = sum((Fraction(number if not number.endswith(".") else number[:-1] or "0")
                 * _DURATION_UNITS[unit]
                 for number, unit in _DURATION_SPLIT.findall(text)), Fraction(0))
    if total > _DURATION_MAX:
        raise ValueError(f"{text!r} is longer than a Go duration can be")
    return float(-total if text.startswith("-") else total)


def format_go_duration(seconds: float) -> str:
    """Seconds as a duration string that Go (and `parse_go_duration`) reads back unchanged."""
    if not math.isfinite(seconds):
        raise ValueError(f"{seconds} seconds is not a duration")
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    # repr is the shortest text that reads back as this float, with no exponent in 1e-4..1e16.
    return f"{seconds!r}s"


def _subst(value: Any, macros: Mapping[str, Any], typed: bool) -> Any:
    """Expand `${name}` for every name in `macros`, recursively through lists and mappings.

    With `typed`, a string that is exactly one macro becomes the macro's value with its type,
    as llama-swap does for metadata (`port: ${PORT}` stays an integer). Mapping keys are always
    strings.
    """
    if isinstance(value, str):
        if "${" not in value:
            return value
        whole = _MACRO_REF.fullmatch(value)
        if typed and whole and whole.group(1) in macros:
            return macros[whole.group(1)]
        return _MACRO_REF.sub(
            lambda m: _go_str(macros[m.group(1)]) if m.group(1) in macros else m.group(0), value)
    if isinstance(value, list):
        return [_subst(item, macros, typed) for item in value]
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            new_key = _subst(key, macros, False) if isinstance(key, str) else key
            if new_key in out:
                raise _DuplicateKey(str(new_key))
            out[new_key] = _subst(item, macros, typed)
        return out
    return value


class _DuplicateKey(Exception):
    """Two mapping keys became the same string after macro expansion."""


def _walk_strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string (mapping keys included) inside value, with its key path."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk_strings(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield _join(path, key), key
            yield from _walk_strings(item, _join(path, key))


def _check_json(value: Any, path: str) -> None:
    """JSONField (PostgreSQL jsonb) takes only JSON: no NaN, dates, sets or non-string keys."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(path, f"{_go_float(value)} cannot be stored; use a finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(_join(path, key), f"keys must be strings; quote {key!r}")
            _check_json(item, _join(path, key))
        return
    raise ConfigError(path, f"{_describe(value)} cannot be stored; use a string, number, "
                            "boolean, list or mapping")


# --------------------------------------------------------------------------------------------
# Step 1: YAML text -> data, with ${env.NAME} substituted


def _yaml_error(exc: yaml.YAMLError, substituted: bool) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    detail = f"{context}, {problem}" if context else problem
    after = " after ${env.…} substitution (check the variables' values)" if substituted else ""
    return ConfigError(where, f"not valid YAML{after}: {detail}; fix the syntax (quote values "
                              "that contain ': ' or ' #', or start with a special character)")


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    style: str | None
    path: str


def _scalar_spans(node: yaml.Node | None, path: str, seen: set[int]) -> Iterator[_Span]:
    if node is None or id(node) in seen:  # anchors: an aliased node appears more than once
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        yield _Span(node.start_mark.index, node.end_mark.index, node.style, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _scalar_spans(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        for key, item in node.value:
            key_text = key.value if isinstance(key, yaml.ScalarNode) else "?"
            yield from _scalar_spans(key, _join(path, key_text), seen)
            yield from _scalar_spans(item, _join(path, key_text), seen)


def _escape(value: str, style: str | None) -> str:
    if style == '"':
        return value.replace("\\", "\\\\").replace('"', '\\"')
    if style == "'":
        return value.replace("'", "''")
    return value


def _substitute_env(text: str, env: Mapping[str, str]) -> str:
    """Replace `${env.NAME}` in the raw text, as llama-swap does before it reads the YAML.

    Only references inside YAML values (or keys) count: the same text inside a comment is
    left alone, so a commented-out line never demands a variable. The value is escaped for
    the quoting style of the scalar it lands in.
    """
    if "${env." not in text:
        return text
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, substituted=False) from None
    spans = sorted(_scalar_spans(root, "", set()), key=lambda s: s.start)
    pieces: list[str] = []
    last = 0
    for match in _ENV_REF.finditer(text):
        span = next((s for s in spans if s.start <= match.start() and match.end() <= s.end),
                    None)
        if span is None:
            continue  # inside a comment
        name = match.group(1)
        where = span.path or "(top level)"
        if name not in env:
            raise ConfigError(where, f"environment variable {name} is not set; set it in the "
                                     f"environment of the import, or replace ${{env.{name}}} "
                                     "with the value")
        value = env[name]
        if any(c in value for c in "\n\r\0"):
            raise ConfigError(where, f"environment variable {name} contains a line break or "
                                     "NUL, which cannot be placed into YAML; put it in a "
                                     "one-line value")
        pieces.append(text[last:match.start()])
        pieces.append(_escape(value, span.style))
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces)


def _check_duplicate_keys(node: yaml.Node | None, path: str, seen: set[int]) -> None:
    """yaml.v3 refuses a key given twice; PyYAML would keep the last one without a word."""
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, item in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in lines:
                raise ConfigError(_join(path, key.value),
                                  f"given twice (lines {lines[key.value]} and {line}); "
                                  "keep one of them")
            lines[key.value] = line
            _check_duplicate_keys(item, _join(path, key.value), seen)


def _load_yaml(text: str, env: Mapping[str, str]) -> dict[str, Any]:
    substituted = _substitute_env(text, env)
    loader = _Loader(substituted)
    try:
        node = loader.get_single_node()
        _check_duplicate_keys(node, "", set())
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, substituted=substituted != text) from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError("", "the file is empty; a llama-swap config needs at least `models:`")
    if not isinstance(data, dict):
        raise ConfigError("", f"the file holds {_describe(data)}, not a mapping of settings; "
                              "a llama-swap config starts with keys such as `models:`")
    return data


# --------------------------------------------------------------------------------------------
# Step 2..4: data -> ParsedConfig

_TOP_UNSUPPORTED = {
    "logLevel": "not supported by gpuproxy; ignored (set GPUPROXY_LOG_LEVEL instead)",
    "logTimeFormat": "not supported by gpuproxy; ignored (gpuproxy's log lines have their own "
                     "format)",
    "logToStdout": "not supported by gpuproxy; ignored (gpuproxy logs to stdout; model output "
                   "is under /logs)",
    "logRequests": "not supported by gpuproxy; ignored (llama-swap does not use it either)",
    "metricsMaxInMemory": "not supported by gpuproxy; ignored (the activity log is kept in "
                          "the database)",
    "captureBuffer": "not supported by gpuproxy; ignored (no request/response captures are "
                     "kept)",
    "store": "not supported by gpuproxy; ignored (activity is stored in gpuproxy's database)",
    "ui": "not supported by gpuproxy; ignored (gpuproxy has its own admin pages)",
    "profiles": "not supported by gpuproxy; ignored (requested model ids are never rewritten)",
    "peers": "not supported by gpuproxy; ignored (the models it lists are not reachable)",
    "matrix": "not supported by gpuproxy; ignored (models use groups; models in no group run "
              "one at a time)",
}

_MODEL_UNSUPPORTED = {
    "timeouts": "not supported by gpuproxy; ignored (gpuproxy's upstream client uses its own "
                "timeouts)",
    "compat": "not supported by gpuproxy; ignored (websocket upgrades get no special "
              "treatment)",
    "healthCheckTimeout": "not supported per model (llama-swap ignores it too); the global "
                          "healthCheckTimeout applies",
}

_MODEL_KEYS = frozenset({
    "cmd", "cmdStop", "proxy", "checkEndpoint", "ttl", "unloadTimeout", "aliases", "env", "name",
    "description", "unlisted", "useModelName", "concurrencyLimit", "sendLoadingState", "filters",
    "macros", "metadata", "capabilities", "parallel", "enabled", "vllmPriority",
    "streamIdleTimeout"})
# Values that are always strings: macros are written into them as text, never with a type.
_MODEL_TEXT_KEYS = frozenset({
    "cmd", "cmdStop", "proxy", "checkEndpoint", "name", "description", "useModelName", "aliases",
    "env"})


class _Parser:
    """One parse: holds the data, the env and the warnings collected on the way."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.warnings: list[str] = []

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(f"{path}: {message}")

    # typed readers: each names the path and what was expected ---------------------------

    def mapping(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping (key: value lines), got "
                                    f"{_describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(path, f"keys must be strings; quote {key!r}")
        return value

    def seq(self, value: Any, path: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {_describe(value)}")
        return value

    def text(self, value: Any, path: str, default: str = "") -> str:
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_describe(value)}; quote it")
        return value

    def boolean(self, value: Any, path: str, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {_describe(value)}")
        return value

    def integer(self, value: Any, path: str, default: int, minimum: int | None = None) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {_describe(value)}")
        if minimum is not None and value < minimum:
            raise ConfigError(path, f"must be at least {minimum}, got {value}")
        return value

    def duration(self, value: Any, path: str, default: float) -> float:
        """Seconds from a Go duration string; a bare number is refused, as llama-swap refuses it
        (Go would read `every: 15` as 15 nanoseconds, so guessing a unit would mislead)."""
        if value is None:
            return default
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a duration such as 15s or 1m30s, got "
                                    f"{_describe(value)}; add the unit")
        try:
            return parse_go_duration(value)
        except ValueError:
            raise ConfigError(path, f"expected a duration such as 15s or 1m30s (units ns, us, "
                                    f"ms, s, m, h), got {_describe(value)}") from None

    def strings(self, value: Any, path: str) -> list[str]:
        return [self.text(item, f"{path}[{i}]") for i, item in enumerate(self.seq(value, path))]

    def no_macros(self, value: str, path: str) -> None:
        if m := _ANY_REF.search(value):
            raise ConfigError(path, f"unresolved macro {m.group(0)}; macros are expanded only "
                                    "inside models.*, and ${env.NAME} everywhere")

    def not_a_model(self, name: str) -> str:
        """Why a name in groups/preload/priority matches nothing, for its warning."""
        selectors = self.data.get("selectors")
        if isinstance(selectors, dict) and name in selectors:
            return f"{name!r} is a selector, which gpuproxy does not support"
        return f"{name!r} is not a model id or alias"

    def known_keys(self, mapping: Mapping[str, Any], path: str, known: frozenset[str]) -> None:
        for key in mapping:
            if key not in known:
                self.warn(_join(path, key), "unknown key; ignored (check its spelling; "
                                            "docs/configuration.md lists the supported keys)")

    # the whole file ---------------------------------------------------------------------

    def parse(self) -> ParsedConfig:
        data = self.data
        known_top = {"healthCheckTimeout", "startPort", "sendLoadingState",
                     "includeAliasesInList", "globalTTL", "unloadTimeout", "macros", "apiKeys",
                     "apiKeyHashes", "models", "groups", "routing", "hooks", "performance",
                     "upstream", "selectors", "queue"}
        for key in data:
            if key in _TOP_UNSUPPORTED:
                self.warn(key, _TOP_UNSUPPORTED[key])
            elif key not in known_top:
                self.known_keys({key: None}, "", frozenset())
        if "selectors" in data:
            names = ", ".join(repr(s) for s in self.mapping(data["selectors"], "selectors"))
            self.warn("selectors", "not supported by gpuproxy; ignored (requests for "
                                   f"{names or 'them'} find no model)")
        self.upstream()
        if "models" not in data:
            raise ConfigError("models", "required: add `models:` with at least one "
                                        "`<id>: {cmd: ...}` entry (or `models: {}` to remove "
                                        "every model)")
        settings = self.settings()
        global_macros = self.macro_table(data.get("macros"), "macros")
        models = self.models(global_macros, settings.start_port)
        models, alias_owner = self.check_aliases(models)
        ids = {m.model_id for m in models}

        def real_id(name: str) -> str | None:
            return name if name in ids else alias_owner.get(name)

        groups, group_of = self.groups(real_id)
        scheduler, aging, bonus, priority = self.routing_scheduler(real_id)
        preload = self.preload(real_id)
        settings = replace(settings, scheduler=scheduler, aging_divisor=aging,
                           swap_affinity_bonus=bonus, preload=preload)
        models = tuple(replace(m, group=group_of.get(m.model_id),
                               fifo_priority=priority.get(m.model_id, 0)) for m in models)
        api_keys, api_key_hashes, plain_key_admin = self.api_keys()
        return ParsedConfig(settings=settings, models=models, groups=groups, api_keys=api_keys,
                            api_key_hashes=api_key_hashes, plain_key_admin=plain_key_admin,
                            warnings=self.warnings)

    def upstream(self) -> None:
        if "upstream" not in self.data:
            return
        upstream = self.mapping(self.data["upstream"], "upstream")
        for key in upstream:
            if key == "ignorePaths":
                self.warn("upstream.ignorePaths", "not supported by gpuproxy; ignored (every "
                                                  "/upstream/<model>/ path may load its model)")
            else:
                self.known_keys({key: None}, "upstream", frozenset())

    def settings(self) -> ParsedSettings:
        data = self.data
        health = self.integer(data.get("healthCheckTimeout"), "healthCheckTimeout",
                              DEFAULT_HEALTH_CHECK_TIMEOUT)
        if health < MIN_HEALTH_CHECK_TIMEOUT:
            self.warn("healthCheckTimeout", f"{health} is below the minimum of "
                                            f"{MIN_HEALTH_CHECK_TIMEOUT} seconds; using "
                                            f"{MIN_HEALTH_CHECK_TIMEOUT}")
            health = MIN_HEALTH_CHECK_TIMEOUT
        global_ttl = self.integer(data.get("globalTTL"), "globalTTL", 0, minimum=0)
        unload = self.integer(data.get("unloadTimeout"), "unloadTimeout",
                              DEFAULT_UNLOAD_TIMEOUT, minimum=0) or DEFAULT_UNLOAD_TIMEOUT
        start_port = self.integer(data.get("startPort"), "startPort", DEFAULT_START_PORT,
                                  minimum=1)
        if start_port > 65535:
            raise ConfigError("startPort", f"must be a port number 1..65535, got {start_port}")
        performance = self.mapping(data.get("performance"), "performance")
        disabled = self.boolean(performance.get("disabled"), "performance.disabled", False)
        interval = self.duration(performance.get("every"), "performance.every",
                                 DEFAULT_PERFORMANCE_INTERVAL)
        if interval < MIN_PERFORMANCE_INTERVAL:
            raise ConfigError("performance.every", f"must be at least 1s, got "
                                                   f"{performance['every']}; every sample runs "
                                                   "nvidia-smi or rocm-smi, so faster only "
                                                   "costs CPU")
        self.known_keys({k: None for k in performance if k not in ("disabled", "every")},
                        "performance", frozenset())
        queue = self.mapping(data.get("queue"), "queue")
        self.known_keys(queue, "queue", frozenset({"maxWaiting", "maxWaitingPerBand",
                                                   "timeout"}))
        per_band_raw = self.mapping(queue.get("maxWaitingPerBand"), "queue.maxWaitingPerBand")
        self.known_keys(per_band_raw, "queue.maxWaitingPerBand",
                        frozenset({"interactive", "normal", "batch"}))
        per_band = {b: self.integer(per_band_raw.get(b), f"queue.maxWaitingPerBand.{b}", 0,
                                    minimum=0)
                    for b in ("interactive", "normal", "batch") if b in per_band_raw}
        return ParsedSettings(
            health_check_timeout=health,
            global_ttl=global_ttl,
            unload_timeout=unload,
            start_port=start_port,
            send_loading_state=self.boolean(data.get("sendLoadingState"), "sendLoadingState",
                                            False),
            include_aliases_in_list=self.boolean(data.get("includeAliasesInList"),
                                                 "includeAliasesInList", False),
            performance_monitoring=not disabled,
            performance_interval=interval,
            max_waiting=self.integer(queue.get("maxWaiting"), "queue.maxWaiting", 20_000,
                                     minimum=0),
            max_waiting_per_band=per_band,
            queue_timeout=self.integer(queue.get("timeout"), "queue.timeout", 0, minimum=0),
        )

    # macros ------------------------------------------------------------------------------

    def macro_table(self, value: Any, path: str) -> dict[str, Scalar]:
        table = self.mapping(value, path)
        for name, macro in table.items():
            where = _join(path, name)
            if len(name) >= 64:
                raise ConfigError(where, "macro names must be shorter than 64 characters")
            if not _MACRO_NAME.match(name):
                raise ConfigError(where, "macro names may contain only letters, digits, _ "
                                         "and - (^[a-zA-Z0-9_-]+$)")
            if name in RESERVED_MACROS:
                raise ConfigError(where, f"{name} is reserved (gpuproxy fills in ${{{name}}} "
                                         "itself); rename the macro")
            if macro is None or not isinstance(macro, str | int | float):
                raise ConfigError(where, f"a macro value must be a string, number or "
                                         f"boolean, got {_describe(macro)}")
            if isinstance(macro, float) and not math.isfinite(macro):
                raise ConfigError(where, "a macro value must be a finite number")
            if isinstance(macro, str) and f"${{{name}}}" in macro:
                raise ConfigError(where, f"refers to itself (${{{name}}}); a macro may only "
                                         "use macros defined above it")
        return dict(table)

    @staticmethod
    def resolve_macros(model_id: str, global_macros: Mapping[str, Scalar],
                       model_macros: Mapping[str, Scalar]) -> dict[str, Scalar]:
        """The macros one model sees, each expanded with those above it (llama-swap order).

        `MODEL_ID` comes first, then the global macros (a model macro of the same name takes
        the global one's place), then the model's own new macros.
        """
        merged: dict[str, Scalar] = {"MODEL_ID": model_id}
        for name, value in global_macros.items():
            merged[name] = model_macros.get(name, value)
        for name, value in model_macros.items():
            merged.setdefault(name, value)
        resolved: dict[str, Scalar] = {}
        for name, value in merged.items():
            resolved[name] = _subst(value, resolved, typed=True)
        return resolved

    # models ------------------------------------------------------------------------------

    def models(self, global_macros: Mapping[str, Scalar],
               start_port: int) -> tuple[ParsedModel, ...]:
        raw_models = self.mapping(self.data.get("models"), "models")
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
            raw = self.mapping(raw, path)
            for key in raw:
                if key in _MODEL_UNSUPPORTED:
                    self.warn(f"{path}.{key}", _MODEL_UNSUPPORTED[key])
                elif key not in _MODEL_KEYS:
                    self.known_keys({key: None}, path, frozenset())
            if model_id == "comfyui_auto":
                self.warn(path, "llama-swap's ComfyUI special case (/comfyui passthrough, "
                                "concurrency of at least 50) is not supported by gpuproxy; "
                                "imported as an ordinary model")
            own_macros = self.macro_table(raw.get("macros"), f"{path}.macros")
            macro_names[model_id] = set(global_macros) | set(own_macros)
            macros = self.resolve_macros(model_id, global_macros, own_macros)
            values: dict[str, Any] = {}
            for key, value in raw.items():
                if key not in _MODEL_KEYS or key == "macros":
                    continue
                if key in ("cmd", "cmdStop") and isinstance(value, str):
                    # Comment lines go before expansion, so a macro named only in a comment
                    # is not required (llama-swap strips them first too).
                    value = strip_comments(value)
                try:
                    values[key] = _subst(value, macros, typed=key not in _MODEL_TEXT_KEYS)
                except _DuplicateKey as dup:
                    raise ConfigError(f"{path}.{key}", f"two keys both become {dup} after "
                                                       "macro expansion; keep one") from None
            if values.get("proxy") is None:
                values["proxy"] = DEFAULT_PROXY
                defaulted_proxy.add(model_id)
            if values.get("cmd") is None:
                raise ConfigError(f"{path}.cmd", "required: the command that starts the "
                                                 "model's server")
            self.text(values["cmd"], f"{path}.cmd")
            expanded[model_id] = values

        # ${PORT}: sorted model-id order, only for models whose cmd uses it (llama-swap).
        ports: dict[str, int] = {}
        next_port = start_port
        for model_id in sorted(expanded):
            if "${PORT}" in expanded[model_id]["cmd"]:
                if next_port > 65535:
                    raise ConfigError(f"models.{model_id}.cmd",
                                      f"no port left for ${{PORT}}: startPort {start_port} "
                                      "plus one port per model passes 65535; lower startPort")
                ports[model_id] = next_port
                next_port += 1

        parsed = []
        for model_id, values in expanded.items():
            port = ports.get(model_id)
            if port is not None:
                values = {key: _subst(value, {"PORT": port}, typed=key not in _MODEL_TEXT_KEYS)
                          for key, value in values.items()}
            elif model_id in defaulted_proxy:
                self.warn(f"models.{model_id}.proxy",
                          "not set, and cmd does not use ${PORT}, so the default "
                          "http://localhost:${PORT} points at a port the server is never told; "
                          "add `--port ${PORT}` to cmd, or set proxy to the server's address")
            self.check_unresolved(model_id, values, macro_names[model_id],
                                  skip_proxy=model_id in defaulted_proxy and port is None)
            parsed.append(self.model(model_id, values, port))
        return tuple(parsed)

    def check_unresolved(self, model_id: str, values: Mapping[str, Any], macro_names: set[str],
                         skip_proxy: bool) -> None:
        for key, value in values.items():
            if key == "proxy" and skip_proxy:
                continue
            for path, text in _walk_strings(value, f"models.{model_id}.{key}"):
                for match in _ANY_REF.finditer(text):
                    name = match.group(1)
                    if name == "PID" and key == "cmdStop":
                        continue
                    if name == "PID":
                        raise ConfigError(path, "${PID} is only available in cmdStop (the "
                                                "process id to stop)")
                    if name == "PORT":
                        raise ConfigError(path, "${PORT} is only available when cmd uses "
                                                "${PORT}; add `--port ${PORT}` (or similar) "
                                                "to cmd, or write the port number")
                    if name in macro_names:
                        raise ConfigError(path, f"{match.group(0)} is left unresolved: a macro "
                                                f"may only use macros defined above it; move "
                                                f"`{name}` above the macro that uses it")
                    raise ConfigError(path, f"unresolved macro {match.group(0)}; define it "
                                            f"under macros: or models.{model_id}.macros:")

    def model(self, model_id: str, values: dict[str, Any], port: int | None) -> ParsedModel:
        path = f"models.{model_id}"

        def at(key: str) -> str:
            return f"{path}.{key}"

        cmd = _one_line(self.text(values["cmd"], at("cmd")))
        if not cmd:
            raise ConfigError(at("cmd"), "empty once comment lines are removed; write the "
                                         "command that starts the model's server")
        try:
            split_command(cmd)
        except ValueError as exc:
            raise ConfigError(at("cmd"), f"cannot be split into arguments: {exc}; check the "
                                         "quotes") from None
        cmd_stop = _one_line(self.text(values.get("cmdStop"), at("cmdStop")))
        if cmd_stop:
            try:
                split_command(cmd_stop.replace("${PID}", "0"))
            except ValueError as exc:
                raise ConfigError(at("cmdStop"), f"cannot be split into arguments: {exc}; "
                                                 "check the quotes") from None
        proxy = self.text(values["proxy"], at("proxy"))
        if not proxy.startswith(("http://", "https://")):
            raise ConfigError(at("proxy"), f"must be an http:// or https:// URL, got {proxy!r}")
        env = self.strings(values.get("env"), at("env"))
        for i, entry in enumerate(env):
            if not _ENV_ENTRY.match(entry):
                raise ConfigError(f"{at('env')}[{i}]", f'expected "NAME=value", got {entry!r}')
        aliases = self.strings(values.get("aliases"), at("aliases"))
        for i, alias in enumerate(aliases):
            if not alias.strip():
                raise ConfigError(f"{at('aliases')}[{i}]", "an alias must not be empty")
        ttl = self.integer(values.get("ttl"), at("ttl"), -1)
        if ttl < -1:
            raise ConfigError(at("ttl"), f"must be -1 (use globalTTL), 0 (never unload) or a "
                                         f"number of seconds, got {ttl}")
        filters = self.filters(values.get("filters"), at("filters"))
        metadata = self.mapping(values.get("metadata"), at("metadata"))
        _check_json(metadata, at("metadata"))
        capabilities = self.capabilities(values.get("capabilities"), at("capabilities"))
        loading = values.get("sendLoadingState")
        return ParsedModel(
            model_id=model_id,
            cmd=cmd,
            proxy=proxy,
            name=self.text(values.get("name"), at("name")),
            description=self.text(values.get("description"), at("description")),
            cmd_stop=cmd_stop,
            port=port,
            check_endpoint=self.text(values.get("checkEndpoint"), at("checkEndpoint"),
                                     DEFAULT_CHECK_ENDPOINT),
            ttl=ttl,
            unload_timeout=self.integer(values.get("unloadTimeout"), at("unloadTimeout"), 0,
                                        minimum=0),
            aliases=tuple(aliases),
            env=tuple(env),
            unlisted=self.boolean(values.get("unlisted"), at("unlisted"), False),
            use_model_name=self.text(values.get("useModelName"), at("useModelName")),
            concurrency_limit=self.integer(values.get("concurrencyLimit"),
                                           at("concurrencyLimit"), 0, minimum=0),
            parallel=None if values.get("parallel") is None else self.integer(
                values["parallel"], at("parallel"), 1, minimum=1),
            strip_params=filters[0],
            set_params=filters[1],
            set_params_by_id=filters[2],
            metadata=metadata,
            capabilities=capabilities,
            send_loading_state=None if loading is None else self.boolean(
                loading, at("sendLoadingState"), False),
            enabled=self.boolean(values.get("enabled"), at("enabled"), True),
            vllm_priority=self.boolean(values.get("vllmPriority"), at("vllmPriority"), False),
            stream_idle_timeout=self.integer(values.get("streamIdleTimeout"),
                                             at("streamIdleTimeout"), 600, minimum=1),
        )

    def filters(self, value: Any, path: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        filters = self.mapping(value, path)
        self.known_keys(filters, path, frozenset({"stripParams", "strip_params", "setParams",
                                                  "setParamsByID"}))
        strip = self.text(filters.get("stripParams"), f"{path}.stripParams")
        legacy = self.text(filters.get("strip_params"), f"{path}.strip_params")
        if legacy and strip:
            self.warn(f"{path}.strip_params", "ignored because stripParams is also set (the "
                                              "legacy spelling only counts on its own)")
        strip = strip or legacy
        set_params = self.mapping(filters.get("setParams"), f"{path}.setParams")
        _check_json(set_params, f"{path}.setParams")
        if "model" in set_params:
            self.warn(f"{path}.setParams.model", "ignored when requests are sent (model is "
                                                 "protected; use useModelName)")
        by_id = self.mapping(filters.get("setParamsByID"), f"{path}.setParamsByID")
        for key, params in by_id.items():
            if not key:
                raise ConfigError(f"{path}.setParamsByID", "a requested id must not be empty")
            if not isinstance(params, dict):
                raise ConfigError(f"{path}.setParamsByID.{key}",
                                  f"expected a mapping of parameters, got {_describe(params)}")
        _check_json(by_id, f"{path}.setParamsByID")
        return strip, set_params, by_id

    def capabilities(self, value: Any, path: str) -> dict[str, Any]:
        caps = self.mapping(value, path)
        self.known_keys(caps, path, frozenset({"in", "out", "tools", "reranker", "context"}))
        for key in ("in", "out"):
            for i, modality in enumerate(self.strings(caps.get(key), f"{path}.{key}")):
                if modality not in _MODALITIES:
                    raise ConfigError(f"{path}.{key}[{i}]", f"unknown modality {modality!r}; "
                                                            "use text, audio or image")
        for key in ("tools", "reranker"):
            self.boolean(caps.get(key), f"{path}.{key}", False)
        self.integer(caps.get("context"), f"{path}.context", 0, minimum=0)
        _check_json(caps, path)
        return caps

    def check_aliases(self, models: tuple[ParsedModel, ...]
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
                    self.warn(where, "the model's own id; dropped")
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

    # groups and routing -----------------------------------------------------------------

    def groups(self, real_id: Callable[[str], str | None]
               ) -> tuple[tuple[ParsedGroup, ...], dict[str, str]]:
        """Top-level `groups:` or `routing.router.settings.groups`; returns model -> group."""
        data = self.data
        routing = self.mapping(data.get("routing"), "routing")
        self.known_keys(routing, "routing", frozenset({"router", "scheduler"}))
        router = self.mapping(routing.get("router"), "routing.router")
        self.known_keys(router, "routing.router", frozenset({"use", "settings"}))
        settings = self.mapping(router.get("settings"), "routing.router.settings")
        self.known_keys(settings, "routing.router.settings", frozenset({"groups", "matrix"}))
        top_level = [key for key in ("groups", "matrix") if data.get(key)]
        in_routing = bool(router.get("use") or settings.get("groups") or settings.get("matrix"))
        if top_level and in_routing:
            raise ConfigError(top_level[0], "the top-level groups:/matrix: keys cannot be "
                                            "combined with routing.router; move them under "
                                            "routing.router.settings and remove the top-level "
                                            "key")
        use = self.text(router.get("use"), "routing.router.use", "group")
        if use not in ("group", "matrix"):
            raise ConfigError("routing.router.use", f"unknown router {use!r}; use group "
                                                    "(matrix is not supported by gpuproxy)")
        if use == "matrix":
            self.warn("routing.router.use", "matrix is not supported by gpuproxy; using the "
                                            "group router instead (groups under "
                                            "routing.router.settings.groups apply; models in "
                                            "no group run one at a time)")
        if "matrix" in settings:
            self.warn("routing.router.settings.matrix", _TOP_UNSUPPORTED["matrix"])
        if data.get("groups"):
            raw_groups, base = self.mapping(data["groups"], "groups"), "groups"
        else:
            raw_groups = self.mapping(settings.get("groups"), "routing.router.settings.groups")
            base = "routing.router.settings.groups"
        groups: list[ParsedGroup] = []
        group_of: dict[str, str] = {}
        for group_id, raw in raw_groups.items():
            path = f"{base}.{group_id}"
            if not group_id or group_id != group_id.strip() or len(group_id) > MODEL_ID_MAX:
                raise ConfigError(path, "a group id must be 1..255 characters without "
                                        "surrounding spaces")
            if group_id == IMPLICIT_GROUP:
                raise ConfigError(path, f"{IMPLICIT_GROUP} is the name of the implicit group of "
                                        "models in no group; rename this group")
            raw = self.mapping(raw, path)
            self.known_keys(raw, path, frozenset({"swap", "exclusive", "persistent",
                                                  "members"}))
            if "members" not in raw:
                raise ConfigError(f"{path}.members", "required: the model ids in this group")
            members: list[str] = []
            for i, name in enumerate(self.strings(raw["members"], f"{path}.members")):
                where = f"{path}.members[{i}]"
                self.no_macros(name, where)
                model_id = real_id(name)
                if model_id is None:
                    self.warn(where, f"{self.not_a_model(name)}; skipped (define the model "
                                     "under models:, or remove it from the group)")
                    continue
                if model_id != name:
                    self.warn(where, f"{name!r} is an alias; using its model {model_id!r} "
                                     "(group members should be model ids)")
                if model_id in members:
                    raise ConfigError(where, f"{model_id!r} is listed twice in this group")
                if model_id in group_of:
                    raise ConfigError(where, f"{model_id!r} is already a member of group "
                                             f"{group_of[model_id]!r}; a model may belong to "
                                             "only one group")
                members.append(model_id)
                group_of[model_id] = group_id
            groups.append(ParsedGroup(
                group_id=group_id,
                swap=self.boolean(raw.get("swap"), f"{path}.swap", True),
                exclusive=self.boolean(raw.get("exclusive"), f"{path}.exclusive", True),
                persistent=self.boolean(raw.get("persistent"), f"{path}.persistent", False),
                members=tuple(members),
            ))
        return tuple(groups), group_of

    def routing_scheduler(self, real_id: Callable[[str], str | None]
                          ) -> tuple[str, float, int, dict[str, int]]:
        """`routing.scheduler`: (use, agingDivisor, swapAffinityBonus, {model: fifo priority})."""
        base = "routing.scheduler"
        routing = self.mapping(self.data.get("routing"), "routing")
        scheduler = self.mapping(routing.get("scheduler"), base)
        self.known_keys(scheduler, base, frozenset({"use", "settings"}))
        use = self.text(scheduler.get("use"), f"{base}.use", DEFAULT_SCHEDULER)
        if use not in SCHEDULERS:
            raise ConfigError(f"{base}.use", f"unknown scheduler {use!r}; use serial "
                                             "(gpuproxy's default) or fifo")
        settings = self.mapping(scheduler.get("settings"), f"{base}.settings")
        self.known_keys(settings, f"{base}.settings", frozenset({"fifo", "serial"}))

        fifo_path = f"{base}.settings.fifo"
        fifo = self.mapping(settings.get("fifo"), fifo_path)
        self.known_keys(fifo, fifo_path, frozenset({"priority"}))
        priority: dict[str, int] = {}
        given_as: dict[str, str] = {}
        for name, value in self.mapping(fifo.get("priority"), f"{fifo_path}.priority").items():
            where = f"{fifo_path}.priority.{name}"
            level = self.integer(value, where, 0)
            model_id = real_id(name)
            if model_id is None:
                self.warn(where, f"{self.not_a_model(name)}; ignored (define the model, or "
                                 "remove the entry)")
                continue
            if model_id in priority:
                raise ConfigError(where, f"model {model_id!r} already has a priority (given as "
                                         f"{given_as[model_id]!r}); give it once")
            priority[model_id] = level
            given_as[model_id] = name

        serial_path = f"{base}.settings.serial"
        serial = self.mapping(settings.get("serial"), serial_path)
        self.known_keys(serial, serial_path, frozenset({"agingDivisor", "swapAffinityBonus"}))
        aging = serial.get("agingDivisor", DEFAULT_AGING_DIVISOR)
        if aging is None:
            aging = DEFAULT_AGING_DIVISOR
        if isinstance(aging, bool) or not isinstance(aging, int | float):
            raise ConfigError(f"{serial_path}.agingDivisor",
                              f"expected a number of seconds, got {_describe(aging)}")
        if not math.isfinite(aging) or aging <= 0:
            raise ConfigError(f"{serial_path}.agingDivisor",
                              f"must be a positive number of seconds, got {aging}: at 0 or "
                              "below, waiting never raises a request's score and low "
                              "priorities could starve")
        bonus = self.integer(serial.get("swapAffinityBonus"), f"{serial_path}.swapAffinityBonus",
                             DEFAULT_SWAP_AFFINITY_BONUS, minimum=0)
        if bonus > MAX_SWAP_AFFINITY_BONUS:
            self.warn(f"{serial_path}.swapAffinityBonus",
                      f"{bonus} is above the maximum of {MAX_SWAP_AFFINITY_BONUS}; using "
                      f"{MAX_SWAP_AFFINITY_BONUS} (100 or more would lift a request into the "
                      "next priority band)")
            bonus = MAX_SWAP_AFFINITY_BONUS
        return use, float(aging), bonus, priority

    def preload(self, real_id: Callable[[str], str | None]) -> tuple[str, ...]:
        hooks = self.mapping(self.data.get("hooks"), "hooks")
        self.known_keys(hooks, "hooks", frozenset({"on_startup"}))
        startup = self.mapping(hooks.get("on_startup"), "hooks.on_startup")
        self.known_keys(startup, "hooks.on_startup", frozenset({"preload"}))
        path = "hooks.on_startup.preload"
        preload: list[str] = []
        for i, name in enumerate(self.strings(startup.get("preload"), path)):
            name = name.strip()
            if not name:
                continue
            self.no_macros(name, f"{path}[{i}]")
            model_id = real_id(name)
            if model_id is None:
                self.warn(f"{path}[{i}]", f"{self.not_a_model(name)}; skipped (define the "
                                          "model, or remove it from preload)")
                continue
            preload.append(model_id)
        return tuple(preload)

    # api keys ----------------------------------------------------------------------------

    def api_keys(self) -> tuple[tuple[str, ...], tuple[ParsedApiKey, ...], dict[str, bool]]:
        plain: list[str] = []
        first_at: dict[str, int] = {}  # sha256 -> index in apiKeys
        names: dict[str, str] = {}  # name -> where it was given
        for i, key in enumerate(self.strings(self.data.get("apiKeys"), "apiKeys")):
            where = f"apiKeys[{i}]"
            if not key or any(c.isspace() for c in key):
                raise ConfigError(where, "an API key must be non-empty and contain no spaces")
            self.no_macros(key, where)
            digest = hashlib.sha256(key.encode()).hexdigest()
            if digest in first_at:
                self.warn(where, f"the same key as apiKeys[{first_at[digest]}]; kept once")
                continue
            name = api_key_name(key)
            if name in names:
                raise ConfigError(where, f"two keys share the name {name}; list one of them "
                                         "under apiKeyHashes with its own name")
            first_at[digest] = i
            names[name] = where
            plain.append(key)
        hashed: list[ParsedApiKey] = []
        plain_admin: dict[str, bool] = {}
        plain_names = {api_key_name(k): h for k, h in zip(plain, first_at, strict=True)}
        seen_hashes = set(first_at)
        for i, raw in enumerate(self.seq(self.data.get("apiKeyHashes"), "apiKeyHashes")):
            where = f"apiKeyHashes[{i}]"
            raw = self.mapping(raw, where)
            self.known_keys(raw, where, frozenset({"name", "sha256", "prefix", "admin"}))
            admin = (None if raw.get("admin") is None
                     else self.boolean(raw.get("admin"), f"{where}.admin", False))
            name = self.text(raw.get("name"), f"{where}.name")
            digest = self.text(raw.get("sha256"), f"{where}.sha256").lower()
            if not name or name != name.strip() or len(name) > API_KEY_NAME_MAX:
                raise ConfigError(f"{where}.name", f"required: who uses this key, 1.."
                                                   f"{API_KEY_NAME_MAX} characters")
            if not _SHA256.match(digest):
                raise ConfigError(f"{where}.sha256", "required: the key's SHA-256 as 64 hex "
                                                     "digits (printf %s KEY | sha256sum)")
            prefix = raw.get("prefix")
            if prefix is not None:
                prefix = self.text(prefix, f"{where}.prefix")
                if len(prefix) > 12:
                    raise ConfigError(f"{where}.prefix", "at most 12 characters")
            if plain_names.get(name) == digest:
                # an export of a plain key listed next to the key itself: only its rank counts
                if admin is not None:
                    plain_admin[digest] = admin
                continue
            if digest in seen_hashes:
                raise ConfigError(f"{where}.sha256", "the same key is already listed (under "
                                                     "apiKeys or apiKeyHashes); list it once")
            if name in names:
                raise ConfigError(f"{where}.name", f"{name!r} is already used by {names[name]}; "
                                                   "key names must be unique")
            seen_hashes.add(digest)
            names[name] = where
            hashed.append(ParsedApiKey(name=name, sha256=digest, prefix=prefix, admin=admin))
        return tuple(plain), tuple(hashed), plain_admin


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


def parse_config(text: str, env: Mapping[str, str]) -> ParsedConfig:
    """Parse llama-swap YAML into a ParsedConfig, or raise ConfigError naming the key path.

    `env` supplies `${env.NAME}` (the process environment for a real import; tests pass a
    dict). Warnings for everything gpuproxy does not honour are in `.warnings`.
    """
    return _Parser(_load_yaml(text, env)).parse()
