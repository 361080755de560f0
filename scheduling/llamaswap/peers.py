"""`peers.<id>`: other servers whose models are forwarded to, never scheduled here.

Read as llama-swap reads them (`internal/config/peer.go`): `proxy` and `models` are required,
`apiKey` may be an `${env.…}` reference (substituted at load like everywhere else),
`filters` takes `stripParams` and `setParams` only, `timeouts` are whole seconds. Only the
timeouts the file writes are kept, so an export writes back what was written; the catalog
fills in llama-swap's defaults (`PEER_TIMEOUTS`). `priorityForward` is gpuproxy's: how the
request's priority travels to the peer.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import PEER_TIMEOUTS, PRIORITY_FORWARD, ParsedPeer
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.values import check_json

_PEER_KEYS = frozenset({"proxy", "apiKey", "models", "filters", "timeouts", "priorityForward"})


def read_peers(r: Reader) -> tuple[ParsedPeer, ...]:
    peers: list[ParsedPeer] = []
    for peer_id, raw in r.mapping(r.data.get("peers"), "peers").items():
        path = f"peers.{peer_id}"
        if not peer_id.strip():
            raise ConfigError(path, "a peer id must not be blank")
        raw = r.mapping(raw, path)
        r.known_keys(raw, path, _PEER_KEYS)
        proxy = r.text(raw.get("proxy"), f"{path}.proxy").strip()
        if not proxy:
            raise ConfigError(f"{path}.proxy", "proxy is required: the peer's base URL, e.g. "
                                               "http://192.168.1.23:8080")
        r.no_macros(proxy, f"{path}.proxy")
        check_peer_url(proxy, f"{path}.proxy")
        api_key = r.text(raw.get("apiKey"), f"{path}.apiKey")
        if any(c.isspace() for c in api_key):
            # the value is a secret: the message must not show it
            raise ConfigError(f"{path}.apiKey", "the key contains a space or line break; "
                                                "check its ${env.…} variable")
        models = r.strings(raw.get("models"), f"{path}.models")
        if not models:
            raise ConfigError(f"{path}.models", "peer models can not be empty: list the model "
                                                "names the peer serves")
        for i, name in enumerate(models):
            if not name.strip():
                raise ConfigError(f"{path}.models[{i}]", "a model name must not be blank")
            r.no_macros(name, f"{path}.models[{i}]")
        filters = r.mapping(raw.get("filters"), f"{path}.filters")
        r.known_keys(filters, f"{path}.filters", frozenset({"stripParams", "setParams"}))
        set_params = r.mapping(filters.get("setParams"), f"{path}.filters.setParams")
        check_json(set_params, f"{path}.filters.setParams")
        if "model" in set_params:
            r.warn(f"{path}.filters.setParams.model", "ignored (model is protected: it is "
                                                      "always the peer's model name)")
            set_params = {k: v for k, v in set_params.items() if k != "model"}
        timeouts_raw = r.mapping(raw.get("timeouts"), f"{path}.timeouts")
        r.known_keys(timeouts_raw, f"{path}.timeouts", frozenset(PEER_TIMEOUTS))
        timeouts = {key: r.integer(value, f"{path}.timeouts.{key}", PEER_TIMEOUTS[key],
                                   minimum=0)
                    for key, value in timeouts_raw.items() if key in PEER_TIMEOUTS}
        forward = r.text(raw.get("priorityForward"), f"{path}.priorityForward", "header")
        if forward not in PRIORITY_FORWARD:
            raise ConfigError(f"{path}.priorityForward",
                              f"unknown value {forward!r} (valid: {', '.join(PRIORITY_FORWARD)})")
        peers.append(ParsedPeer(
            peer_id=peer_id, proxy=proxy, models=tuple(models), api_key=api_key,
            strip_params=r.text(filters.get("stripParams"), f"{path}.filters.stripParams"),
            set_params=set_params, timeouts=timeouts, priority_forward=forward))
    return tuple(peers)


def check_peer_url(url: str, path: str) -> None:
    """An http(s) URL with a host: stricter than Go's `url.Parse`, which takes almost any text
    and leaves the mistake to the first forwarded request."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ConfigError(path, f"invalid peer proxy URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, "invalid peer proxy URL: write it as http://HOST[:PORT][/PATH] "
                                "or https://…")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(path, "a peer proxy URL holds no user or password (it would show "
                                "wherever the URL does): put the peer's key in its apiKey, "
                                "which is sent as Bearer and x-api-key")
