"""Cross-cutting concerns of the HTTP API, written once: OpenAI-style errors and API keys."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from gpuproxy import runtime
from gpuproxy.auth import WWW_AUTHENTICATE, key_name
from gpuproxy.auth import presented_key as _presented

View = Callable[..., Awaitable[HttpResponse]]


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               code: str | None = None, headers: dict[str, str] | None = None) -> JsonResponse:
    """The OpenAI error envelope, so every client library shows the message."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    response = JsonResponse(body, status=status)
    for key, value in (headers or {}).items():
        response[key] = value
    return response


def presented_key(request: HttpRequest) -> str | None:
    return _presented(request.headers.get("Authorization", ""),
                      request.headers.get("X-Api-Key", ""))


def api_view(methods: tuple[str, ...]) -> Callable[[View], View]:
    """An async JSON API view: method check, API key check (when keys exist), no CSRF.

    The API is for programs sending bearer tokens, not for browsers with a session, so CSRF
    does not apply; the admin keeps its own protection.
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
            if catalog.api_keys:
                if key_name(presented_key(request), catalog.api_keys) is None:
                    return json_error(
                        401, "a valid API key is required: send Authorization: Bearer <key>",
                        type_="authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": WWW_AUTHENTICATE})
            return await view(request, *args, **kwargs)

        return csrf_exempt(wrapped)

    return wrap
