"""llama-swap's live API: `/api/events`, `/api/inflight/{id}/cancel`, `/api/performance` and
`/api/hardware` (`internal/server/apigroup.go`), same paths, shapes and statuses.

llama-swap puts all four behind its API keys. Here (docs/security.md, "Who can do what"),
the two that show or touch other clients' requests are for admin keys: the event stream
carries the upstreams' output (secrets a server prints at start) and the in-flight requests'
headers and addresses, and a cancel ends someone else's request. The two that describe the
machine take any key, as `/metrics` does with the same figures.
"""

from __future__ import annotations

import datetime as dt

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from gpuproxy.api import events
from gpuproxy.api.decorators import ApiRequest, api_view, json_error
from gpuproxy.observe import hardware as hardware_snapshot
from gpuproxy.shell import runtime


@api_view(("GET",))
async def events_stream(request: ApiRequest) -> HttpResponseBase:
    """The SSE stream (gpuproxy/api/events.py). Admin keys only: it carries the logs and
    the in-flight requests' (redacted) headers."""
    response = StreamingHttpResponse(events.stream(await runtime.port()),
                                     content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a reverse proxy must not hold frames back
    return response


@api_view(("POST",))
async def cancel_inflight(request: ApiRequest, request_id: str) -> HttpResponse:
    """End a request in flight, whichever request process serves it (the dashboard's cancel
    button, `ProxyPort.cancel_request`): its client gets `cancelled_by_admin`, its activity
    row says so. Admin keys only: it ends another client's work."""
    if not await (await runtime.port()).cancel_request(request_id):
        return json_error(404, f"inflight request not found: {request_id!r} is not in flight "
                               "(it may have ended; /api/events lists the ones that are)",
                          code="not_found")
    return JsonResponse({"msg": "ok"})


@api_view(("GET",), admin=False)
async def performance(request: ApiRequest) -> HttpResponse:
    """The last hour of CPU, memory, network and GPU samples, those after `?after=` (RFC
    3339) if given; 503 `{"enabled": false}` with `performance.disabled`. Any key, as
    `/metrics`: figures about the machine, nothing of a request."""
    after: dt.datetime | None = None
    raw = request.GET.get("after", "")
    if raw:
        try:
            after = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
            if after.tzinfo is None:  # RFC 3339 always says its offset
                raise ValueError(raw)
        except ValueError:
            return json_error(400, "invalid 'after' timestamp, use RFC3339 format "
                                   "(2006-01-02T15:04:05Z)", code="bad_request", param="after")
    rt = await runtime.port()
    body = await rt.performance(after) if rt.catalog.performance_monitoring else None
    if body is None:
        return JsonResponse({"enabled": False}, status=503)
    return JsonResponse(body)


@api_view(("GET",), admin=False)
async def hardware(request: ApiRequest) -> HttpResponse:
    """What this machine is (gpuproxy/observe/hardware.py), llama-swap's field names. Any
    key: the same kind of figures as `/metrics`."""
    return JsonResponse(await hardware_snapshot.snapshot())
