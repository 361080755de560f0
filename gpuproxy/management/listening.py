"""How `serve` listens: the address given, Daphne's endpoint strings (plus an inherited
socket for `--workers N` and TLS in front of either), Daphne's server keeping why it could not
listen, and the per-request work Twisted does that nobody here reads, turned off.
"""

from __future__ import annotations

import logging
from typing import Any

# Daphne installs Twisted's asyncio reactor on import; it must come before anything else
# imports twisted.internet.reactor.
import daphne.server  # isort:skip
from django.core.management.base import CommandError

logger = logging.getLogger("gpuproxy.serve")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise CommandError(f"--listen {value!r}: the port must be a number, "
                           "e.g. 127.0.0.1:8080") from None
    if not 0 < number < 65536:
        raise CommandError(f"--listen {value!r}: the port must be 1..65535")
    return host, number


def endpoint_for(host: str, port: int) -> str:
    interface = host.replace(":", r"\:")
    # Twisted's default listen backlog of 50 drops SYNs when a thousand clients connect at
    # once (they retry after 1 s); the scheduler, not the kernel, decides who waits.
    return f"tcp:port={port}:interface={interface}:backlog=1024"


def quiet_twisted_http() -> None:
    """Two things Twisted does per request that nobody here reads: it parses every
    form-encoded or multipart body on the event loop (a 10 MiB upload blocked it for 241 ms;
    the proxy relays bodies raw and Django parses its own forms), and it formats an access
    log line. Off, for 40-70 µs a request (BENCHMARKS.md)."""
    from daphne.http_protocol import HTTPFactory, WebRequest

    if getattr(WebRequest, "_gpuproxy_quiet", False):
        return
    original = WebRequest.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = init
    WebRequest._gpuproxy_quiet = True
    HTTPFactory.log = lambda self, request: None


def tls_context(cert_file: str, key_file: str) -> Any:
    """The TLS context for `-tls-cert-file`/`-tls-key-file`, loaded at start so that a bad
    file stops the start with its name rather than failing every handshake. The certificate
    file may hold the chain after the leaf, as llama-swap (Go's LoadX509KeyPair) reads it."""
    from OpenSSL import SSL

    ctx = SSL.Context(SSL.TLS_SERVER_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_2_VERSION)
    ctx.set_options(SSL.OP_NO_COMPRESSION | SSL.OP_CIPHER_SERVER_PREFERENCE)
    try:
        ctx.use_certificate_chain_file(cert_file)
    except (OSError, SSL.Error) as exc:
        raise CommandError(f"-tls-cert-file {cert_file}: not a readable PEM certificate "
                           f"({_ssl_reason(exc)})") from None
    try:
        ctx.use_privatekey_file(key_file)
        ctx.check_privatekey()
    except (OSError, SSL.Error) as exc:
        raise CommandError(f"-tls-key-file {key_file}: not a readable PEM private key for the "
                           f"certificate in -tls-cert-file {cert_file} ({_ssl_reason(exc)})"
                           ) from None
    return ctx


def _ssl_reason(exc: Exception) -> str:
    """OpenSSL's errors are a list of (library, function, reason) tuples; the reasons say it."""
    details = exc.args[0] if exc.args else None
    if isinstance(details, list) and details and isinstance(details[0], tuple):
        return "; ".join(str(item[-1]) for item in details)
    return str(exc)


class _TLSContextFactory:
    """A loaded context as Twisted's old-style context factory (`getContext`)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def getContext(self) -> Any:  # Twisted's name
        return self._ctx


class _TLSServerEndpoint:
    """Another server endpoint with TLS in front of whatever listens on it: Twisted's `ssl:`
    string cannot adopt an inherited socket, so the request processes of `--workers N` wrap
    their factory themselves; one process uses the same path."""

    def __init__(self, inner: Any, ctx: Any) -> None:
        self._inner = inner
        self._ctx = ctx

    def listen(self, factory: Any) -> Any:
        from twisted.protocols.tls import TLSMemoryBIOFactory

        # A plain getContext() object is what Twisted's zope interface asks; mypy sees none.
        contexts: Any = _TLSContextFactory(self._ctx)
        return self._inner.listen(TLSMemoryBIOFactory(contexts, False, factory))


# The TLS context of this process's `tls:` endpoints: Daphne takes its endpoints as strings only.
_tls: list[Any] = []


def use_tls(context: Any) -> None:
    """The TLS context this process's `tls:` endpoints serve with (set before Daphne starts)."""
    _tls.append(context)


def _endpoint(reactor: Any, description: str) -> Any:
    """Daphne's endpoint parser, plus `adopt:FILENO:FAMILY`: a listening socket inherited from
    the supervisor (`--workers N`; Twisted has an endpoint for it but no string syntax, and
    Daphne reads its endpoints only as strings), and `tls:` before either, for the context
    serve loaded (`-tls-cert-file`)."""
    import socket

    from twisted.internet.endpoints import AdoptedStreamServerEndpoint, serverFromString

    if description.startswith("tls:"):
        return _TLSServerEndpoint(_endpoint(reactor, description[len("tls:"):]), _tls[-1])
    if description.startswith("adopt:"):
        _, fileno, family = description.split(":")
        return AdoptedStreamServerEndpoint(reactor, int(fileno), getattr(socket, "AF_" + family))
    return serverFromString(reactor, description)


daphne.server.serverFromString = _endpoint  # type: ignore[attr-defined]


class ProxyServer(daphne.server.Server):
    """Daphne's server, keeping why it could not listen (Daphne logs it and stops, and the
    process would exit 0)."""

    listen_failure: str | None = None

    def listen_error(self, failure: Any) -> None:
        # CannotListenError's own message repeats the address; the OS error is the news.
        self.listen_failure = str(getattr(failure.value, "socketError", None)
                                  or failure.getErrorMessage())
        super().listen_error(failure)
