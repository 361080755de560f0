"""Cross-cutting concerns of the HTTP API, written once: OpenAI-style errors and API keys."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from gpuproxy.proxy.auth import KEY_REQUIRED, WWW_AUTHENTICATE, admin_required, caller
from gpuproxy.proxy.auth import presented_key as _presented
from gpuproxy.proxy.errors import error_body
from gpuproxy.shell import runtime

View = Callable[..., Awaitable[HttpResponse]]


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               code: str | None = None, headers: dict[str, str] | None = None,
               param: str | None = None) -> HttpResponse:
    """The OpenAI error envelope (gpuproxy/proxy/errors.py) as Django's answer."""
    response = HttpResponse(error_body(message, type_, code, param), status=status,
                            content_type="application/json")
    for key, value in (headers or {}).items():
        response[key] = value
    return response


def presented_key(request: HttpRequest) -> str | None:
    return _presented(request.headers.get("Authorization", ""),
                      request.headers.get("X-Api-Key", ""))


def api_view(methods: tuple[str, ...], *, admin: bool = True) -> Callable[[View], View]:
    """An async JSON API view: method check, API key check (when keys exist), no CSRF.

    `admin`: only admin keys may call it (401 without a valid key, 403 with another one). The
    default, so that an endpoint added later is for admins unless it says otherwise; the
    ones any key holder may call say `admin=False` (docs/security.md, "Who can do what").
    The view finds who called in `request.caller` (an `auth.Caller`, None without keys).

    The returned view carries `requires_api_key` and `requires_admin_key`: the edge
    (gpuproxy/proxy/edge.py) reads them to refuse an upload on the request head alone.

    The API is for programs sending bearer tokens, not for browsers with a session, so CSRF
    does not apply (the Origin check of gpuproxy/proxy/exposure.py still does); the admin keeps its
    own protection.
    """

    def wrap(view: View) -> View:
        @functools.wraps(view)
        async def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method not in methods:
                return json_error(405, f"{request.method} is not allowed on {request.path}; "
                                       f"use {' or '.join(methods)}",
                                  code="method_not_allowed",
                                  headers={"Allow": ", ".join(methods)})
            catalog = (await runtime.get()).catalog
            request.caller = None
            if catalog.api_keys:
                who = caller(presented_key(request), catalog.api_keys, catalog.admin_keys)
                if who is None:
                    return json_error(401, KEY_REQUIRED, type_="authentication_error",
                                      code="invalid_api_key",
                                      headers={"WWW-Authenticate": WWW_AUTHENTICATE})
                if admin and not who.admin:
                    return json_error(403, admin_required(request.path),
                                      type_="permission_error", code="admin_key_required")
                request.caller = who
            return await view(request, *args, **kwargs)

        exempt = csrf_exempt(wrapped)
        exempt.requires_api_key = True  # type: ignore[attr-defined]
        exempt.requires_admin_key = admin  # type: ignore[attr-defined]
        return exempt

    return wrap
