"""A logged-in staff member's browser on /v1/*, for the dashboard's playground, when API keys
are defined: the page must never hold a key, so the proxy accepts the person's Django session
instead, but only together with what a foreign page cannot produce.

A session cookie alone is never enough: the browser attaches it to a request any page makes
(other ports of this host are the same site, so SameSite does not stop them). Accepted is a
POST to a /v1/ path that is not for admin keys, carrying an `Origin` header, whose CSRF token
(`X-CSRFToken`) passes Django's own check (`CsrfViewMiddleware`: the token against the
`csrftoken` cookie, the Origin against this host), and whose session is an active staff
user's. The activity log's client is then `staff:<username>`. The session cookie and the token
are not sent upstream. Without keys the API is open anyway; such a request is still named and
its cookie still kept from the upstream.

The edge (gpuproxy/proxy/edge.py) refuses a keyless upload on its head, before the body is
read; it cannot look a session up there (that is a database read on Twisted's thread), so a
request that carries the three parts (`at_edge`) passes it and is judged by the consumer
(`authorize_proxy`) once its body is in: such a body is bounded by GPUPROXY_MAX_BODY_BYTES
like any other. docs/security.md, "The playground's session path".
"""

from __future__ import annotations

import io
from collections.abc import Collection, Mapping
from importlib import import_module
from typing import Any

from django.conf import settings
from django.http import HttpResponse

from gpuproxy.proxy.auth import Caller, KeyRefusal, authorize, credential_drop
from gpuproxy.upstream import relay

STAFF_PREFIX = "staff:"
# What the browser sent for the session path, kept from the upstream: its credentials here.
SESSION_DROP = relay.HOP_BY_HOP | frozenset({b"cookie", b"x-csrftoken"})


def _eligible(method: str, path: str, admin: bool) -> bool:
    return method == "POST" and path.startswith("/v1/") and not admin


def at_edge(request: Any, path: str, admin: bool) -> bool:
    """Whether a keyless request head that announces a body may be a staff session's
    (Twisted's request, whose method is not parsed yet): the edge lets it through to the
    consumer, which decides."""
    if not _eligible("POST", path, admin):
        return False
    headers = request.requestHeaders
    cookie = b"; ".join(headers.getRawHeaders(b"cookie") or [])
    return (headers.hasHeader(b"origin") and headers.hasHeader(b"x-csrftoken")
            and settings.SESSION_COOKIE_NAME.encode() + b"=" in cookie)


async def authorize_proxy(scope: dict[str, Any], headers: Mapping[bytes, bytes],
                          api_keys: Mapping[str, str], admin_keys: Collection[str], *,
                          admin: bool) -> KeyRefusal | tuple[str, frozenset[bytes]] | None:
    """The proxy's check: an API key as before when keys are defined, else a staff session
    (above). Who calls (the activity log's client) and the headers not to forward, or why
    not: without either, the refusal is the key check's own. Without keys the API is open
    and None means "anyone"; a staff session is still named, and its cookie kept from the
    upstream (which may be a peer on another machine)."""
    path: str = scope["path"]
    refusal = None
    if api_keys:
        who = authorize(headers.get(b"authorization", b"").decode("latin-1"),
                        headers.get(b"x-api-key", b"").decode("latin-1"), api_keys,
                        admin_keys, admin=admin, path=path)
        if isinstance(who, Caller):
            return who.name, credential_drop(dict(headers), who.key)
        if who.caller is not None:
            return who  # a valid key on the wrong path: a session changes nothing
        refusal = who
    if (_eligible(scope["method"], path, admin)
            and b"origin" in headers and b"x-csrftoken" in headers):
        from channels.db import database_sync_to_async

        name = await database_sync_to_async(staff_username)(scope)
        if name is not None:
            return STAFF_PREFIX + name, SESSION_DROP
    return refusal


def staff_username(scope: dict[str, Any]) -> str | None:
    """The username of the active staff user whose session this request carries, when its
    CSRF token and Origin pass Django's check; None otherwise. Blocking (database)."""
    from django.contrib.auth import get_user
    from django.core.handlers.asgi import ASGIRequest
    from django.middleware.csrf import CsrfViewMiddleware

    request = ASGIRequest(scope, io.BytesIO())
    if "HTTP_ORIGIN" not in request.META:
        return None
    engine = import_module(settings.SESSION_ENGINE)
    request.session = engine.SessionStore(request.COOKIES.get(settings.SESSION_COOKIE_NAME))
    check = CsrfViewMiddleware(lambda r: HttpResponse())
    if check.process_view(request, lambda r: HttpResponse(), (), {}) is not None:
        return None  # the token or the Origin is wrong (Django logs the reason)
    user = get_user(request)  # type: ignore[arg-type]
    if not (user.is_authenticated and user.is_active and user.is_staff):
        return None
    return user.get_username()
