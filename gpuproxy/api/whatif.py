"""`GET /api/whatif?window=24h&scheduler=&aging_divisor=&swap_affinity_bonus=`: the settings
page's what-if panel (scheduling/static/scheduling/whatif.js) asks what the values being typed
would have done to the activity log's last `window` (1h..7d as `90m`, `24h`, `7d`; default
24h). The answer is `scheduling.whatif.Report.as_dict()` plus its `verdict` (that module's
wording, so the command and the panel say the same), or, when the window holds no request
that ran, a 200 with `empty: true` and the reason (docs/dashboard.md, "What if").

Who may ask: a staff session that may view the proxy settings (the page's own reader), or an
admin API key. Not `api_view`: with keys defined, the edge would refuse the panel's keyless
GET before its session is looked at (gpuproxy/proxy/edge.py reads `requires_api_key`). Anyone
else gets a 403 in the API's envelope, which the panel can show.

Values the settings page refuses are 400s with `WhatIfError`'s message, checked on the loop
before anything is read. The replay itself reads the database and burns CPU (a 24 h window
of 20,000 requests: 2-4 s, and 36 s for values that would have overloaded the box,
docs/dashboard.md), so it runs on a thread of its own, not on the loop nor on
`runtime.run_db`'s database thread (the activity API would wait behind it), one at a time; a
question given up before its replay starts is dropped.
An answer is kept `CACHE_SECONDS` per (window, settings asked, catalog in force), and a
second ask while the first is still replaying waits for that one: an admin typing back and
forth, or two tabs, replay once. A catalog change (a save) is a new key, so "today" is never
an old one's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError, close_old_connections, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils import timezone

from activity import whatif as log_window
from activity.management.commands.activity_export import parse_age
from gpuproxy.api.activity import database_unavailable
from gpuproxy.api.decorators import json_error
from gpuproxy.proxy.auth import KeyRefusal, authorize
from gpuproxy.shell import runtime
from scheduling.core.config import SchedulerConfig
from scheduling.guarantees import format_duration, parse_number
from scheduling.whatif import Settings, WhatIfError, settings_of, variant, verdict

DEFAULT_WINDOW = "24h"
MIN_WINDOW = dt.timedelta(hours=1)
MAX_WINDOW = dt.timedelta(days=7)
CACHE_SECONDS = 45.0
CACHE_ENTRIES = 32
#: who may: the admin's own test for reading the settings page (view, or change, permission)
PERMISSIONS = ("scheduling.view_proxysettings", "scheduling.change_proxysettings")

Key = tuple[dt.timedelta, Settings, tuple[str, ...], tuple]

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuproxy-whatif")
_done: dict[Key, tuple[float, dict[str, Any]]] = {}  # key → (expires, monotonic; answer)
_running: dict[Key, _Replay] = {}


class BadQuery(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_window(value: str | None) -> dt.timedelta:
    text = (value or "").strip() or DEFAULT_WINDOW
    span = parse_age(text)
    if span is None:
        raise BadQuery("window", f"window={value!r}: give an age like 90m, 24h or 7d "
                                 "(1h to 7d)")
    if not MIN_WINDOW <= span <= MAX_WINDOW:
        raise BadQuery("window", f"window={value!r} is {format_duration(span.total_seconds())}"
                                 ": the panel replays 1h to 7d (longer: `gpuproxy whatif "
                                 "--from … --to …`)")
    return span


def _number(query: Any, name: str) -> float | None:
    """Absent: today's value. Present, a number as the settings page reads one; anything
    else (empty included) NaN, which `variant` refuses as "not a number", as the page does."""
    if name not in query:
        return None
    value = parse_number(query[name])
    return math.nan if value is None else value


async def _refusal(request: HttpRequest) -> HttpResponse | None:
    user = await request.auser()
    if user.is_active and user.is_staff:
        for perm in PERMISSIONS:
            if await user.ahas_perm(perm):
                return None
        return json_error(403, "your account may not view the proxy settings: a superuser can "
                               "grant it 'scheduling | proxy settings | Can view proxy "
                               "settings' in the admin",
                          type_="permission_error", code="permission_required")
    authorization = request.headers.get("Authorization", "")
    x_api_key = request.headers.get("X-Api-Key", "")
    catalog = (await runtime.port()).catalog
    if catalog.api_keys and (authorization or x_api_key):
        who = authorize(authorization, x_api_key, catalog.api_keys, catalog.admin_keys,
                        admin=True, path=request.path)
        if isinstance(who, KeyRefusal):
            return json_error(who.status, who.message, type_=who.type, code=who.code,
                              headers=who.headers)
        return None
    return json_error(403, "log in as staff (the admin's login) with permission to view the "
                           "proxy settings, or send an admin API key",
                      type_="permission_error", code="staff_required")


async def whatif(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return json_error(405, f"{request.method} is not allowed on {request.path}; use GET",
                          code="method_not_allowed", headers={"Allow": "GET"})
    refused = await _refusal(request)
    if refused is not None:
        return refused
    catalog = (await runtime.port()).catalog
    config = catalog.scheduler_config()
    q = request.GET
    asked: dict[str, Any] = {"scheduler": q.get("scheduler") or None,
                             "aging_divisor": _number(q, "aging_divisor"),
                             "swap_affinity_bonus": _number(q, "swap_affinity_bonus")}
    try:
        span = parse_window(q.get("window"))
        other, notes = variant(settings_of(config), **asked)
    except BadQuery as exc:
        return json_error(400, str(exc), code="invalid_parameter", param=exc.param)
    except WhatIfError as exc:
        return json_error(400, str(exc), code="invalid_parameter")
    key: Key = (span, other, tuple(notes), catalog.fingerprint)
    try:
        if (problem := runtime.database_problem()) is not None:
            raise runtime.DatabaseUnavailable(problem)
        body = await _answer(key, functools.partial(compute, span, config, asked))
    except (OperationalError, InterfaceError) as exc:
        return database_unavailable(exc)
    return JsonResponse(body, json_dumps_params={"ensure_ascii": False})


def compute(span: dt.timedelta, config: SchedulerConfig, asked: dict[str, Any]
            ) -> dict[str, Any]:
    """The replay, on the what-if thread (ORM, then CPU)."""
    close_old_connections()
    began = time.monotonic()
    end = timezone.now()
    try:
        report = log_window.report(end - span, end, config=config, **asked)
    except WhatIfError as exc:  # settings were checked already: the window has nothing
        return {"empty": True, "message": str(exc), "window_seconds": span.total_seconds(),
                "computed_at": end.isoformat()}
    finally:
        connections.close_all()  # a thread that is idle most of the time holds none open
    return report.as_dict() | {
        "empty": False, "verdict": verdict(report.fidelity),
        "window_seconds": span.total_seconds(), "computed_at": end.isoformat(),
        "elapsed_s": round(time.monotonic() - began, 3)}


@dataclass(eq=False)
class _Replay:
    """A replay asked for and not finished: who waits for it, and its thread's future."""

    work: concurrent.futures.Future[dict[str, Any]]
    done: asyncio.Future[dict[str, Any]]
    waiting: int = 0


async def _answer(key: Key, work: functools.partial[dict[str, Any]]) -> dict[str, Any]:
    hit = _done.get(key)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1]
    loop = asyncio.get_running_loop()
    job = _running.get(key)
    if job is None or job.work.cancelled() or job.done.get_loop() is not loop:
        submitted = _executor.submit(work)
        job = _Replay(submitted, asyncio.wrap_future(submitted, loop=loop))
        _running[key] = job
        job.done.add_done_callback(functools.partial(_keep, key, job))
    job.waiting += 1
    try:
        # shielded: a client that goes away (the panel aborts a stale fetch) does not cancel
        # a replay another one waits for, or one already running (its answer is kept)
        return await asyncio.shield(job.done)
    finally:
        job.waiting -= 1
        if not job.waiting:
            job.work.cancel()  # nobody wants it any more: dropped if it has not started


def _keep(key: Key, job: _Replay, future: asyncio.Future[dict[str, Any]]) -> None:
    if _running.get(key) is job:
        del _running[key]
    if future.cancelled() or future.exception() is not None:
        return
    now = time.monotonic()
    for old in [k for k, (expires, _) in _done.items() if expires <= now]:
        del _done[old]
    while len(_done) >= CACHE_ENTRIES:
        del _done[next(iter(_done))]  # the oldest
    _done[key] = (now + CACHE_SECONDS, future.result())


def forget() -> None:
    """Drop every kept answer (tests)."""
    _done.clear()


urlpatterns = [
    path("api/whatif", whatif, name="api-whatif"),
]
