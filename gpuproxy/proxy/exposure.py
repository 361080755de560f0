"""The exposure policy: which requests from where this proxy answers (docs/security.md,
"Exposure policy"; later features refer to it rather than deciding again).

`ExposureMiddleware` sits in front of the whole ASGI application (routing.build_application),
so every request and WebSocket handshake passes it before Django or the proxy consumer sees
it, under Daphne or any other ASGI server:

1. **Host allow-list**, against DNS rebinding (a page whose name now resolves to this machine
   reads our answers as its own): any IP address literal (a rebinding always carries the
   attacker's *name*), `localhost` and `*.localhost`, this machine's host names, the name
   `serve --listen` was given, and GPUPROXY_ALLOWED_HOSTS (`*` = any). Else 400
   `host_not_allowed`. Django's own ALLOWED_HOSTS is `*` for that reason: the check is here,
   once, for Django's paths and the consumer's alike.
2. **Origin**, checked by the server, since a text/plain POST (a form, `no-cors` fetch) skips
   the preflight: a request from a page of another origin, on a management path (any method)
   or with a state-changing method (any path), is refused with 403 `origin_not_allowed`
   unless the origin is this proxy's own (scheme://Host) or listed in GPUPROXY_CORS_ORIGINS.
   /v1/* is open to every origin as in llama-swap once API keys exist (the key is the
   credential, and a browser never adds it on its own); with no key at all (a local box) it
   answers only its own, the listed and the local origins (`is_local_origin`), because then
   nothing else tells a random web page from a client. A browser request with no Origin
   but `Sec-Fetch-Site: cross-site` or `same-site` (an `<img src=/unload>`) counts as
   foreign on the same terms. A Basic password (which a browser saves and sends with any
   page's request) is refused from a foreign page, even where a Bearer key would do.
3. **CORS**: any OPTIONS on /v1/* and the management paths is answered here with 204 and
   llama-swap's headers (never reaching a key check or an upstream), or 403 for a foreign
   origin; allowed cross-origin answers carry `Access-Control-Allow-Origin` (the request's
   origin, `Vary: Origin`), never `Access-Control-Allow-Credentials`; the upstream's own CORS
   headers are dropped (ProxyConsumer.send_headers) so they are never duplicated.

What a request may do once in (admin keys, other keys) is the endpoints' decision:
`decorators.api_view` (its `requires_api_key` / `requires_admin_key` marks, read by the edge
too) and the consumer's `route()`; `proxy_path_needs_admin` says which proxy paths are for
admin keys.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from gpuproxy.proxy.errors import error_body_for
from gpuproxy.proxy.inference import INFERENCE_PATHS

logger = logging.getLogger("gpuproxy.proxy.exposure")

INFERENCE = "inference"  # /v1/*, llama-swap's inference paths, /models: CORS like llama-swap
MANAGEMENT = "management"  # /api/*, /logs*, /running, /unload, /metrics, /upstream/*
OTHER = "other"  # the admin, the dashboard, /health, /static/...

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
FOREIGN_FETCH_SITES = frozenset({"cross-site", "same-site"})

# llama-swap's preflight answer (internal/server/auth.go, CreateCORSMiddleware)
ALLOW_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"Content-Type, Authorization, Accept, X-Requested-With"
MAX_AGE = b"86400"
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")

_MANAGEMENT_EXACT = frozenset({"/running", "/unload", "/metrics", "/upstream"})
_MANAGEMENT_PREFIXES = ("/api/", "/logs", "/upstream/")
_INFERENCE_EXTRA = frozenset({"/models"})


def path_class(path: str) -> str:
    if path.startswith(("/v1/", "/v/")) or path in INFERENCE_PATHS or path in _INFERENCE_EXTRA:
        return INFERENCE
    if path in _MANAGEMENT_EXACT or path.startswith(_MANAGEMENT_PREFIXES):
        return MANAGEMENT
    return OTHER


def proxy_path_needs_admin(path: str) -> bool:
    """`/upstream/{model}/...` reaches a model's own server with any method and path (its
    slots, its props, whatever else it exposes): admin keys only."""
    return path.startswith("/upstream/")


# ---- the Host allow-list ----------------------------------------------------------------------

_listen_names: set[str] = set()
_machine_names: tuple[str, ...] | None = None


def add_listen_host(host: str) -> None:
    """The host `serve --listen` listens on, when it is a name (an address is allowed anyway)."""
    global _patterns
    host = host.strip().strip("[]").lower().rstrip(".")
    if host and not _is_ip(host):
        _listen_names.add(host)
        _patterns = None


def machine_names() -> tuple[str, ...]:
    """This machine's names: host name, FQDN and its mDNS `.local` name. Read once (the FQDN
    may ask the resolver), at the first need, which `ExposureMiddleware` makes its start."""
    global _machine_names
    if _machine_names is None:
        names = set()
        try:
            short = socket.gethostname()
            names.update({short, socket.getfqdn(short)})
            if short and "." not in short:
                names.add(short + ".local")
        except OSError:
            pass
        _machine_names = tuple(sorted(n.lower().rstrip(".") for n in names if n))
    return _machine_names


# (the allowed hosts setting, the advertised URL, the patterns)
_patterns: tuple[Any, str, tuple[str, ...]] | None = None


def allowed_host_patterns() -> tuple[str, ...]:
    """Django's ALLOWED_HOSTS spelling: a name, `.example.com` for it and its subdomains, `*`.
    The name in GPUPROXY_ADVERTISE is this node's too: the other nodes send it as the Host of
    every request they forward here. Rebuilt when a setting is replaced (tests) or a listen
    name is added."""
    global _patterns
    extra = getattr(settings, "GPUPROXY_ALLOWED_HOSTS", ())
    advertised = getattr(settings, "GPUPROXY_ADVERTISE", "")
    if _patterns is None or _patterns[0] is not extra or _patterns[1] != advertised:
        name = (urlsplit(advertised).hostname or "").rstrip(".") if advertised else ""
        _patterns = (extra, advertised, (
            "localhost", ".localhost", *machine_names(), *sorted(_listen_names),
            *([name] if name and not _is_ip(name) else []), *extra))
    return _patterns[2]


def _is_ip(domain: str) -> bool:
    try:
        ipaddress.ip_address(domain[1:-1] if domain.startswith("[") else domain)
    except ValueError:
        return False
    return True


def host_refusal(host: str | None) -> tuple[str, str] | None:
    """(code, message) when this Host is refused; None when it is answered."""
    if host is None:
        return None  # no Host at all (HTTP/1.0, a test): no browser sends that
    return _host_refusal(host, allowed_host_patterns())


@functools.lru_cache(maxsize=512)  # a client sends the same few Hosts again and again
def _host_refusal(host: str, patterns: tuple[str, ...]) -> tuple[str, str] | None:
    domain, _ = split_domain_port(host)
    shown = json.dumps(host[:100])
    if not domain:
        return ("bad_request", f"malformed Host header {shown}: expected a name or an "
                               "address, with an optional :port (RFC 9110 7.2)")
    if _is_ip(domain) or validate_host(domain, patterns):
        return None
    return ("host_not_allowed",
            f"this proxy does not answer to the Host {shown} (a guard against DNS rebinding): "
            "use an IP address, localhost or this machine's name, or add the name to "
            "GPUPROXY_ALLOWED_HOSTS (comma-separated; .example.com for a domain and its "
            "subdomains)")


# ---- origins -----------------------------------------------------------------------------------

def normalize_origin(value: str) -> str | None:
    """scheme://host[:port] in lower case without the scheme's default port, or None when
    `value` is not an http(s) origin (`null` included)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https") or not host or parts.path not in ("", "/"):
        return None
    if ":" in host:
        host = f"[{host}]"
    default = 80 if scheme == "http" else 443
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


_listed_cache: tuple[tuple[str, ...], frozenset[str] | None] | None = None


def listed_origins() -> frozenset[str] | None:
    """GPUPROXY_CORS_ORIGINS, normalised; None when it holds `*` (any origin)."""
    global _listed_cache
    raw = tuple(getattr(settings, "GPUPROXY_CORS_ORIGINS", ()))
    if _listed_cache is None or _listed_cache[0] != raw:
        listed: frozenset[str] | None = None
        if "*" not in raw:
            listed = frozenset(o for o in (normalize_origin(v) for v in raw) if o)
        _listed_cache = (raw, listed)
    return _listed_cache[1]


def is_local_origin(origin: str) -> bool:
    """A page served from this machine (`localhost`, `*.localhost`, a loopback address): a
    local program (a web UI on localhost:3000), which could call us directly anyway, so the
    inference paths answer it with no key defined too. A rebinding page keeps its own name in
    its Origin, so this does not let one in."""
    host = urlsplit(origin).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Request(NamedTuple):
    """What the policy reads of a request (header values as sent, None when absent)."""

    method: str
    path: str
    scheme: str = "http"
    host: str | None = None
    origin: str | None = None
    fetch_site: str | None = None
    request_headers: str | None = None  # Access-Control-Request-Headers
    basic: bool = False  # credentials in `Authorization: Basic` (a browser may have saved them)


@dataclass(frozen=True)
class Verdict:
    status: int = 0  # 0: go on; else the refusal's status
    code: str = ""
    message: str = ""
    preflight: bool = False  # answer 204 with `headers` now
    headers: tuple[tuple[bytes, bytes], ...] = ()  # CORS headers for the answer


GO = Verdict()


def decide(req: Request, keys_exist: bool) -> Verdict:
    """The Origin rule and the CORS headers for one request (its Host already allowed).
    `keys_exist`: API keys are defined, so /v1/* is open to every origin."""
    klass = path_class(req.path)
    if klass == OTHER and req.method not in STATE_CHANGING:
        return GO
    if req.origin is None and req.fetch_site is None:  # a program, not a browser: no check
        if req.method != "OPTIONS" or klass == OTHER:
            return GO
        return _preflight(b"*", req.request_headers, echo=False)
    listed = listed_origins()
    origin = normalize_origin(req.origin) if req.origin is not None else None
    own = normalize_origin(f"{req.scheme}://{req.host}") if req.host else None
    open_to_all = listed is None or (klass == INFERENCE and keys_exist)
    if req.basic and klass != OTHER and (origin != own if req.origin is not None
                                         else req.fetch_site in FOREIGN_FETCH_SITES):
        # A password the browser saved (we answer 401 with a Basic challenge) goes with a
        # page's request of any origin on its own: from elsewhere, only a Bearer key counts.
        _note(req, klass)
        return Verdict(403, "origin_not_allowed",
                       "a browser's saved password (Authorization: Basic) is accepted only "
                       "from pages of this proxy; from another origin, send the key as "
                       "Authorization: Bearer <key>")
    if req.origin is None:
        allowed = not (req.fetch_site in FOREIGN_FETCH_SITES
                       and (klass == MANAGEMENT or req.method in STATE_CHANGING
                            or not open_to_all))
    else:
        allowed = open_to_all or (origin is not None and (
            origin == own or (listed is not None and origin in listed)
            or (klass == INFERENCE and is_local_origin(origin))))
    if not allowed:
        return _refusal(req, klass, own, keys_exist)
    if klass == OTHER:
        return GO
    if req.method == "OPTIONS":
        echo = req.origin is not None and not open_to_all
        return _preflight(req.origin.encode("latin-1") if echo and req.origin else b"*",
                          req.request_headers, echo)
    if req.origin is None:
        return GO
    return Verdict(headers=((b"access-control-allow-origin", req.origin.encode("latin-1")),
                            (b"vary", b"Origin")))


def _preflight(allow_origin: bytes, requested: str | None, echo: bool) -> Verdict:
    headers = [(b"access-control-allow-origin", allow_origin),
               (b"access-control-allow-methods", ALLOW_METHODS),
               (b"access-control-allow-headers", _allow_headers(requested)),
               (b"access-control-max-age", MAX_AGE)]
    if echo:
        headers.append((b"vary", b"Origin"))
    return Verdict(preflight=True, headers=tuple(headers))


def _allow_headers(requested: str | None) -> bytes:
    """The requested header names that are HTTP tokens, as llama-swap echoes them."""
    if not requested:
        return DEFAULT_ALLOW_HEADERS
    names = [n.strip() for n in requested.split(",")]
    return ", ".join(n for n in names if n and _TOKEN.match(n)).encode("latin-1")


def _refusal(req: Request, klass: str, own: str | None, keys_exist: bool) -> Verdict:
    path = req.path if len(req.path) <= 100 else req.path[:100] + "…"
    home = f"pages of this proxy ({own})" if own else "this proxy's own pages"
    if req.origin is None:
        message = (f"a {req.fetch_site} browser request without an Origin header is refused "
                   f"on {path}: open it from {home}, or call it from a program")
    else:
        shown = json.dumps(req.origin[:100])
        message = f"cross-origin request from {shown} refused: {path} answers only {home}"
        if klass == INFERENCE and not keys_exist:
            message += (" and the origins listed in GPUPROXY_CORS_ORIGINS while no API key is "
                        "defined; list this origin there, or define an API key (then any "
                        "origin may call /v1/* with it)")
        else:
            message += " and the origins listed in GPUPROXY_CORS_ORIGINS"
    _note(req, klass)
    return Verdict(403, "origin_not_allowed", message)


_noted: dict[tuple[str, str, str], float] = {}
NOTE_EVERY = 60.0  # seconds: one log line per origin and kind of path, however many refusals


def _note(req: Request, klass: str) -> None:
    key = (req.origin or f"Sec-Fetch-Site: {req.fetch_site}", klass, req.method)
    now = time.monotonic()
    if now - _noted.get(key, -NOTE_EVERY) >= NOTE_EVERY:
        if len(_noted) > 1000:
            _noted.clear()
        _noted[key] = now
        logger.warning("refused a cross-origin %s %s from %s (exposure policy: list the origin "
                       "in GPUPROXY_CORS_ORIGINS if it is yours)", req.method, req.path[:200],
                       key[0][:100])


_READ = frozenset({b"host", b"origin", b"sec-fetch-site", b"access-control-request-headers",
                   b"authorization"})


def request_from_headers(method: str, path: str, scheme: str,
                         headers: Iterable[tuple[bytes, bytes]],
                         default_host: str | None = None) -> Request:
    """A `Request` from raw (lower-case name, value) header pairs; the first of each wins.
    On every request's path: a plain loop (a few µs in all, with the checks)."""
    first: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in _READ and name not in first:
            first[name] = value
    host, origin, site = first.get(b"host"), first.get(b"origin"), first.get(b"sec-fetch-site")
    requested, authorization = (first.get(b"access-control-request-headers"),
                                first.get(b"authorization"))
    return Request(method, path, scheme,
                   host.decode("latin-1") if host is not None else default_host,
                   origin.decode("latin-1") if origin is not None else None,
                   site.decode("latin-1").strip().lower() if site is not None else None,
                   requested.decode("latin-1") if requested is not None else None,
                   authorization is not None and authorization[:6].lower() == b"basic ")


# ---- the ASGI middleware -----------------------------------------------------------------------

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

SCOPE_KEY = "gpuproxy.cors"  # the CORS headers the answer carries (set here, added below)


class ExposureMiddleware:
    def __init__(self, app: App) -> None:
        self.app = app
        machine_names()  # at start, not on a request (the FQDN may ask the resolver)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        server = scope.get("server")
        req = request_from_headers(scope.get("method", "GET"), scope.get("path", ""),
                                   "https" if scope.get("scheme") in ("https", "wss") else "http",
                                   scope.get("headers", ()),
                                   server[0] if server and server[0] else None)
        refused = host_refusal(req.host)
        if refused is not None:
            if kind == "websocket":  # before the handshake's accept: the server answers 403
                await receive()
                await send({"type": "websocket.close", "code": 4400})
                return
            await _answer(send, 400, refused[0], refused[1], "invalid_request_error",
                          scope.get("path", ""))
            return
        if kind == "websocket":  # the dashboard checks its Origin itself (same origin only)
            await self.app(scope, receive, send)
            return
        keys_exist = False
        if (req.origin is not None or req.fetch_site is not None) and (
                path_class(req.path) == INFERENCE):
            from gpuproxy.shell import runtime

            keys_exist = bool((await runtime.port()).catalog.api_keys)
        verdict = decide(req, keys_exist)
        if verdict.status:
            await _answer(send, verdict.status, verdict.code, verdict.message,
                          "permission_error", scope.get("path", ""))
            return
        if verdict.preflight:
            await send({"type": "http.response.start", "status": 204,
                        "headers": [*verdict.headers, (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if verdict.headers:
            scope = {**scope, SCOPE_KEY: verdict.headers}
        await self.app(scope, receive, send)


class CorsHeaders:
    """Adds the headers `ExposureMiddleware` decided to Django's answers. (The proxy consumer
    adds them itself, in `send_headers`, where it drops the upstream's: a wrapped `send`
    would hide the Daphne request it aborts a cut response through.)"""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = scope.get(SCOPE_KEY)
        if not extra:
            await self.app(scope, receive, send)
            return

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if not k.lower().startswith(b"access-control-")]
                message = {**message, "headers": [*headers, *extra]}
            await send(message)

        await self.app(scope, receive, sending)


async def _answer(send: Send, status: int, code: str, message: str, type_: str,
                  path: str = "") -> None:
    body = error_body_for(path, status, message, type_, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
