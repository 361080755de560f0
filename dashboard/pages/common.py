"""What the dashboard pages under `dashboard/pages/` share: an async page rendered for staff,
and the staff check of their small JSON endpoints.

Why async pages: the running proxy (`runtime.port()`: its catalog, its log feeds, its
performance monitor) lives on the event loop, and a sync view runs on a worker thread
where `runtime.current()` is None. The view reads what it needs on the loop, then renders on
a thread (`sync_to_async`): the frame's `request.user` and CSRF token may touch the database.

Why not the `/api/...` endpoints from the browser: they take API keys, which a page has not,
and must not have; these endpoints take the staff session instead.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard import nav
from gpuproxy.proxy.errors import error_body


async def is_staff(request: HttpRequest) -> bool:
    """The same test as `staff_member_required`, for an endpoint that answers JSON: a
    script's fetch should get a 403 it can show, not the login page's HTML."""
    user = await request.auser()
    return bool(user.is_active and user.is_staff)


def json_error(status: int, message: str, type_: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> HttpResponse:
    """The API's error envelope (gpuproxy/proxy/errors.py), which the page scripts read; the
    API's own helper is a sibling layer's, not the dashboard's to import."""
    return HttpResponse(error_body(message, type_, code, param), status=status,
                        content_type="application/json")


def not_staff() -> HttpResponse:
    """403 in the API's error envelope, as the Activity page's data paths answer."""
    return json_error(403, "log in as staff (the admin's login) to read this",
                      type_="permission_error", code="staff_required")


async def render_page(request: HttpRequest, template: str, context: dict[str, Any]
                      ) -> HttpResponse:
    """A page's frame and content, rendered off the event loop."""
    return await sync_to_async(render)(request, template, {**context, **nav.context(request)})
