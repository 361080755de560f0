"""The management API: health, running models, explicit load/unload, logs (llama-swap's paths).

With API keys defined, every view here is for admin keys but `/running` (without commands for
other keys) and `/metrics` (`api_view(..., admin=False)`); `/health` needs none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from gpuproxy.api.decorators import ApiRequest, api_view, json_error
from gpuproxy.proxy.guard import client_reason
from gpuproxy.shell import runtime
from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.logbuffer import PROXY
from gpuproxy.upstream.states import State
from scheduling.core.effects import Scheduler
from scheduling.core.errors import ModelNotFound, SchedulingError
from scheduling.core.priority import band


@csrf_exempt  # any method answers: a POST without a CSRF token must not get Django's 403 page
async def health(request: HttpRequest) -> HttpResponse:
    """`OK`, or `degraded: <why>` while the database is unreachable: still 200, because the
    proxy serves requests without it (a load balancer must not take it out), but a person or a
    monitor reading the body learns what is wrong. While draining at shutdown the edge answers
    503 instead (gpuproxy/proxy/edge.py)."""
    problem = runtime.database_problem()
    if problem is not None:
        return HttpResponse(f"degraded: {problem}", content_type="text/plain; charset=utf-8")
    return HttpResponse("OK", content_type="text/plain")


@api_view(("GET",), admin=False)
async def running(request: ApiRequest) -> HttpResponse:
    """llama-swap's `/running`. A model's `cmd` can carry secrets (an `--api-key`, a token in
    a URL): admin keys see it, other keys do not (with no keys at all, everyone may, as in
    llama-swap; the Host and Origin rules keep other web pages out)."""
    records = (await runtime.port()).running()
    who = request.caller
    if who is not None and not who.admin:
        records = [{k: v for k, v in r.items() if k != "cmd"} for r in records]
    return JsonResponse({"running": records})


def scheduling_error(exc: SchedulingError) -> HttpResponse:
    return json_error(exc.status, exc.message, type_=exc.type, code=exc.code,
                      headers=exc.headers())


@api_view(("POST",))
async def load_model(request: HttpRequest, model: str) -> HttpResponse:
    """Load a model through the scheduler and answer once it is ready, or with the failure.

    It is an ordinary request that is released as soon as it is granted, so it queues, joins
    swaps and respects in-flight work exactly like an inference request would.
    """
    rt = await runtime.port()
    model_id = rt.catalog.resolve(model) or model
    try:
        loaded = await rt.load(model_id)
    except SchedulingError as exc:
        return scheduling_error(exc)
    return JsonResponse({"msg": "ok", "model": loaded, "state": State.READY.value})


@api_view(("POST",))
async def unload_model(request: HttpRequest, model: str) -> HttpResponse:
    rt = await runtime.port()
    model_id = rt.catalog.resolve(model)
    if model_id is None:
        return scheduling_error(ModelNotFound(model))
    await rt.unload([model_id])
    return JsonResponse({"msg": "ok", "model": model_id})


def _queue(sched: Scheduler, now: float) -> dict[str, Any]:
    """Who waits for what, in dispatch order; read by the run loop between two events."""
    waiting = [
        {"position": i, "model": r.model, "priority": r.priority, "band": band(r.priority),
         "waited_s": round(now - r.arrived, 3), "seq": r.seq}
        for i, r in enumerate(sched.queued(), 1)
    ]
    swaps = {m: len(w) for m, w in sched.active_swaps().items()}
    in_flight = {m: n for m in sched.config.models if (n := sched.in_flight(m))}
    return {"scheduler": sched.config.scheduler, "queued": waiting, "loading": swaps,
            "in_flight": in_flight}


@api_view(("GET",))
async def queue(request: HttpRequest) -> HttpResponse:
    """The scheduler's queue, as its owner (the run loop) reads it."""
    return JsonResponse(await (await runtime.port()).inspect(_queue))


async def _unload_everything() -> None:
    await (await runtime.port()).unload_all()


@api_view(("POST",))
async def unload_all(request: HttpRequest) -> HttpResponse:
    await _unload_everything()
    return JsonResponse({"msg": "ok"})


@api_view(("GET",))
async def unload_all_legacy(request: HttpRequest) -> HttpResponse:
    """llama-swap's old `GET /unload`."""
    await _unload_everything()
    return HttpResponse("OK", content_type="text/plain")


def _sources(which: str) -> list[str] | None:
    """Buffer names for a `/logs/stream/<which>`; None when the model is unknown."""
    rt = runtime.current()
    catalog = rt.catalog if rt else None
    models = sorted(catalog.models) if catalog else []
    if which == "":
        return [PROXY, *models]
    if which == "proxy":
        return [PROXY]
    if which == "upstream":
        return models
    model_id = catalog.resolve(which) if catalog else None
    return [model_id] if model_id else None


@api_view(("GET",))
async def logs(request: HttpRequest) -> HttpResponse:
    rt = await runtime.port()
    async with rt.log_feed(_sources("") or [], history=True) as (lines, _):
        pass
    return HttpResponse("\n".join(lines) + ("\n" if lines else ""),
                        content_type="text/plain; charset=utf-8")


@api_view(("GET",))
async def logs_stream(request: HttpRequest, which: str = "") -> HttpResponseBase:
    """History (unless `?no-history`), then live lines until the client leaves."""
    sources = _sources(which)
    if sources is None:
        return json_error(400, f"no logs for {which!r}: it is not a model id, alias, "
                               "'proxy' or 'upstream'", code="unknown_log_source")
    history = "no-history" not in request.GET
    response = StreamingHttpResponse(_stream(await runtime.port(), sources, history),
                                     content_type="text/plain; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _stream(rt: ProxyPort, sources: list[str], history: bool) -> AsyncIterator[bytes]:
    async with rt.log_feed(sources, history) as (past, queue):
        # Something at once, history or not: the server sends the head with the first body
        # chunk, and a model with no lines yet would hold its client without one.
        yield ("\n".join(past) + "\n").encode() if past else b""
        while True:
            line = await queue.get()
            yield (line + "\n").encode()


@api_view(("GET",), admin=False)
async def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition of the default registry: django-prometheus's `django_*` series
    and ours (gpuproxy/observe/metrics.py). Any key may scrape it (Prometheus sends a bearer token;
    the series hold counts and model names, no request's content). Always 200: with
    performance monitoring off the system series are simply absent (llama-swap answers 503
    instead). Rendered on a worker thread so a scrape never holds the event loop; the
    collectors read only published snapshots. Under `serve --workers N` it is the whole
    proxy's, merged by the scheduler process (gpuproxy/observe/exposition.py)."""
    rt = await runtime.port()
    body, content_type = await rt.metrics_text(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return json_error(404, f"no such endpoint: {request.method} {request.path}",
                      code="not_found")


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 400s (a malformed Host header, over DATA_UPLOAD_MAX_NUMBER_FIELDS query
    fields, an unreadable multipart body, ...), in the envelope instead of an HTML page; the
    message never carries a path of this machine (`guard.client_reason`)."""
    detail = client_reason(exception) if exception is not None else "bad request"
    return json_error(400, f"{detail} ({request.method} {request.path})", code="bad_request")


def permission_denied(request: HttpRequest, exception: Exception | None = None
                      ) -> HttpResponse:
    return json_error(403, f"permission denied: {request.method} {request.path}",
                      type_="permission_error", code="permission_denied")


def server_error(request: HttpRequest) -> HttpResponse:
    return json_error(500, "internal error in gpuproxy; the proxy log has the details",
                      type_="server_error", code="internal_error")
