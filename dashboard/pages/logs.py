"""`/dashboard/logs`: two log panes side by side, each following one source (the proxy's own
log or one model's output) live, ANSI colours rendered (dashboard/static/dashboard/logs.js).

Each pane reads `feed`, a Server-Sent Events stream of the source's last `HISTORY` lines
then every new one, from `ProxyPort.log_feed` (the same buffers as `/logs/stream/...`, in
every process under `serve --workers N`). SSE, not the dashboard's WebSocket: one stream
per pane, nothing else sent on it, and the browser's EventSource reconnects by itself (the
first event after a reconnect carries `reset`, so the pane is redrawn, not doubled). It
takes the staff session, not an API key (dashboard/pages/common.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from dashboard.pages.common import is_staff, json_error, not_staff, render_page
from gpuproxy.shell import runtime
from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.logbuffer import PROXY

HISTORY = 500  # lines sent when a pane starts following
BATCH = 0.2  # seconds: lines arriving within this go out as one event
KEEPALIVE = 15.0  # seconds without a line before a comment keeps idle proxies from cutting it


@staff_member_required
async def page(request: HttpRequest) -> HttpResponse:
    """The two panes: the proxy on the left, the first model on the right."""
    models = sorted((await runtime.port()).catalog.models)
    return await render_page(request, "dashboard/logs.html", {
        "sources": ["proxy", *models],
        "panes": [("left", "proxy"), ("right", models[0] if models else "proxy")],
    })


def event(payload: dict[str, object]) -> bytes:
    """One SSE event: the JSON on one `data:` line (JSON escapes newlines)."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def feed(request: HttpRequest) -> HttpResponseBase:
    """`?source=proxy` or a model id or alias: that log, followed until the page leaves."""
    if not await is_staff(request):
        return not_staff()
    rt = await runtime.port()
    source = request.GET.get("source", "")
    name = PROXY if source == "proxy" else rt.catalog.resolve(source)
    if name is None:
        return json_error(404, f"no log for {source!r}: not 'proxy', a model id or an alias",
                          code="unknown_log_source")
    response = StreamingHttpResponse(_follow(rt, name), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a reverse proxy must not hold lines back
    return response


async def _follow(rt: ProxyPort, name: str) -> AsyncIterator[bytes]:
    async with rt.log_feed([name], history=True) as (past, queue):
        yield event({"reset": True, "lines": past[-HISTORY:]})
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE):
                    lines = [await queue.get()]
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            with contextlib.suppress(TimeoutError):  # gather what comes meanwhile
                async with asyncio.timeout(BATCH):
                    while True:
                        lines.append(await queue.get())
            yield event({"lines": lines})
