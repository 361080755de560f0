"""`GET /api/captures/{id}`: one request's capture (llama-swap's path and JSON), `id` being
its activity row's id (`/api/activity`, `/api/metrics/activity`).

Captures hold prompts and answers, so only admin keys read them (or anyone, where no key is
defined at all: docs/security.md). With captures off (`captureBuffer: 0`) every id is 404, as
in llama-swap, whatever an earlier run with them on left in the table.
"""

from __future__ import annotations

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from activity import captures
from gpuproxy.api.activity import database_unavailable
from gpuproxy.api.decorators import api_view, json_error
from gpuproxy.shell import runtime


@api_view(("GET",))
async def capture(request: HttpRequest, capture_id: str) -> HttpResponse:
    if not capture_id.isdigit() or len(capture_id) > 18:
        return json_error(400, f"invalid capture ID {capture_id!r}: the id of an activity row "
                               "(a number)", code="invalid_capture_id")
    if not (await runtime.port()).catalog.capture_buffer_mb:
        return json_error(404, "capture not found: captures are off (captureBuffer: 0)",
                          code="capture_not_found")
    try:
        found = await runtime.run_db(lambda: captures.find(int(capture_id)))
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    if found is None:
        return json_error(404, f"capture {capture_id} not found: never stored (not a model "
                               "request, or over captureBuffer) or evicted by newer ones",
                          code="capture_not_found")
    return JsonResponse(found)


urlpatterns = [
    path("api/captures/<str:capture_id>", capture),
]
