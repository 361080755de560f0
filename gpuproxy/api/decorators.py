"""Cross-cutting concerns of the HTTP API, written once: OpenAI-style errors and API keys."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, cast

from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from gpuproxy.proxy.auth import Caller, KeyRefusal, authorize
from gpuproxy.proxy.errors import error_body
from gpuproxy.shell import runtime

View = Callable[..., Coroutine[Any, Any, HttpResponseBase]]


class ApiRequest(HttpRequest):
    """What an `api_view` hands its view: Django's request, with who called."""

    caller: Caller | None


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               code: str | None = None, headers: dict[str, str] | None = None,
               param: str | None = None) -> HttpResponse:
    """The OpenAI error envelope (gpuproxy/proxy/errors.py) as Django's answer."""
    response = HttpResponse(error_body(message, type_, code, param), status=status,
                            content_type="application/json")
    for key, value in (headers or {}).items():
        response[key] = value
    return response


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
        async def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in methods:
                return json_error(405, f"{request.method} is not allowed on {request.path}; "
                                       f"use {' or '.join(methods)}",
                                  code="method_not_allowed",
                                  headers={"Allow": ", ".join(methods)})
            catalog = (await runtime.port()).catalog
            api_request = cast(ApiRequest, request)
            api_request.caller = None
            if catalog.api_keys:
                who = authorize(request.headers.get("Authorization", ""),
                                request.headers.get("X-Api-Key", ""), catalog.api_keys,
                                catalog.admin_keys, admin=admin, path=request.path)
                if isinstance(who, KeyRefusal):
                    return json_error(who.status, who.message, type_=who.type, code=who.code,
                                      headers=who.headers)
                api_request.caller = Caller(who.name, who.admin)  # without the key
            return await view(api_request, *args, **kwargs)

        exempt = csrf_exempt(wrapped)
        exempt.requires_api_key = True  # type: ignore[attr-defined]
        exempt.requires_admin_key = admin  # type: ignore[attr-defined]
        return exempt

    return wrap


async def staff_refusal(request: HttpRequest, perm: str, *, reading: str, viewing: str,
                        perm_label: str) -> HttpResponse | None:
    """Why a dashboard page's JSON endpoint refuses this request, None when it may answer.

    Those endpoints are for the page's own session, never a key (the page holds none), so the
    check is Django's: an active staff member holding the same view permission as the admin's
    list of the same rows. `reading` ends the login message ("read the {reading}"),
    `viewing` the permission one ("may not view {viewing}"), `perm_label` is the permission
    as the admin's user page names it."""
    user = await request.auser()
    if not (user.is_active and user.is_staff):
        return json_error(403, f"log in as staff (the admin's login) to read the {reading}",
                          type_="permission_error", code="staff_required")
    if not await user.ahas_perm(perm):
        return json_error(403, f"your account may not view {viewing}: a superuser can grant "
                               f"it the permission '{perm_label}' in the admin",
                          type_="permission_error", code="permission_required")
    if request.method != "GET":
        return json_error(405, f"{request.method} is not allowed on {request.path}; use GET",
                          code="method_not_allowed", headers={"Allow": "GET"})
    return None
