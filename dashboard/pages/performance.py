"""`/dashboard/performance`: charts of the performance monitor's samples (CPU, memory, load,
network, GPU utilisation, VRAM, temperature, power), llama-swap's Performance page.

The page polls `data` (the same body as `/api/performance`, llama-swap's shape) every
sampling interval with `?after=` the newest timestamp it has, so each poll carries only the
new samples. `data` takes the staff session, not an API key (dashboard/pages/common.py).
"""

from __future__ import annotations

import datetime as dt

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse

from dashboard.pages.common import is_staff, json_error, not_staff, render_page
from gpuproxy.shell import runtime


@staff_member_required
async def page(request: HttpRequest) -> HttpResponse:
    """The frame; the script asks `data` for the samples, every sampling interval."""
    catalog = (await runtime.port()).catalog
    return await render_page(request, "dashboard/performance.html", {
        "every": catalog.performance_interval,
        "enabled": catalog.performance_monitoring,
    })


def parse_after(raw: str) -> dt.datetime | None:
    """`?after=` as `/api/performance` reads it (RFC 3339, its offset required); ValueError
    for another form, None when absent."""
    if not raw:
        return None
    after = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    if after.tzinfo is None:
        raise ValueError(raw)
    return after


async def data(request: HttpRequest) -> HttpResponse:
    """The samples (all kept, or those after `?after=`); 503 `{"enabled": false}` while
    monitoring is off, which the page turns into how to switch it on."""
    if not await is_staff(request):
        return not_staff()
    try:
        after = parse_after(request.GET.get("after", ""))
    except ValueError:
        return json_error(400, "invalid 'after' timestamp: an RFC 3339 instant with its "
                               "offset, as 2026-01-02T15:04:05Z", code="bad_request",
                          param="after")
    rt = await runtime.port()
    body = await rt.performance(after) if rt.catalog.performance_monitoring else None
    if body is None:
        return JsonResponse({"enabled": False}, status=503)
    return JsonResponse(body)
