"""`GET /api/whatif?window=24h&scheduler=&aging_divisor=&swap_affinity_bonus=&affinity_budget=`:
the settings page's what-if panel (scheduling/static/scheduling/whatif.js) asks what the
values being typed would have done to the activity log's last `window` (1h..7d as `90m`,
`24h`, `7d`; default 24h). The answer is `scheduling.whatif.Report.as_dict()` plus its
`verdict` (that module's wording, so the command and the panel say the same), or, when the
window holds no request that ran, a 200 with `empty: true` and the reason
(docs/dashboard.md, "What if").

Who may ask: a staff session that may view the proxy settings (the page's own reader), or an
admin API key. Not `api_view`: with keys defined, the edge would refuse the panel's keyless
GET before its session is looked at (gpuproxy/proxy/edge.py reads `requires_api_key`). Anyone
else gets a 403 in the API's envelope, which the panel can show.

Values the settings page refuses are 400s with `WhatIfError`'s message, checked on the loop
before anything is read. The replay reads the database and burns CPU (a 24 h window of
20,000 requests: 2-4 s, about 30 s for values that would have overloaded the box,
docs/dashboard.md): the window is read on a thread of its own, not on the loop nor on
`runtime.run_db`'s database thread (the activity API would wait behind it), one at a time,
and replayed in a process of its own (`replay_elsewhere`), stopped after `REPLAY_SECONDS`; a
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
import multiprocessing
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
from scheduling.whatif import (
    Replayable,
    Settings,
    WhatIfError,
    answer_in_child,
    settings_of,
    variant,
)

DEFAULT_WINDOW = "24h"
MIN_WINDOW = dt.timedelta(hours=1)
MAX_WINDOW = dt.timedelta(days=7)
CACHE_SECONDS = 45.0
#: the longest one replay may run before it is stopped (the command has no limit)
REPLAY_SECONDS = 120.0
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
    """None when the caller may ask: staff who may view the settings, or an admin key."""
    user = await request.auser()
    staff = user.is_active and user.is_staff
    if staff:
        for perm in PERMISSIONS:
            if await user.ahas_perm(perm):
                return None
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
    if staff:
        return json_error(403, "your account may not view the proxy settings: a superuser can "
                               "grant it 'scheduling | proxy settings | Can view proxy "
                               "settings' in the admin",
                          type_="permission_error", code="permission_required")
    return json_error(403, "log in as staff (the admin's login) with permission to view the "
                           "proxy settings" + (", or send an admin API key"
                                               if catalog.api_keys else ""),
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
                             "swap_affinity_bonus": _number(q, "swap_affinity_bonus"),
                             "affinity_budget": q.get("affinity_budget")}
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
        body = await _answer(key, functools.partial(compute, span, config,
                                                     log_window.ttls(catalog), asked))
    except (OperationalError, InterfaceError) as exc:
        return database_unavailable(exc)
    except ReplayTooLong as exc:
        return json_error(503, str(exc), type_="server_error", code="replay_too_long")
    return JsonResponse(body, json_dumps_params={"ensure_ascii": False})


def compute(span: dt.timedelta, config: SchedulerConfig, ttl: dict[str, float],
            asked: dict[str, Any]) -> dict[str, Any]:
    """The replay, on the what-if thread (ORM, then CPU)."""
    close_old_connections()
    began = time.monotonic()
    end = timezone.now()
    try:
        args = log_window.prepare(end - span, end, config=config, ttl=ttl, **asked)
    finally:
        connections.close_all()  # a thread that is idle most of the time holds none open
    try:
        data = replay_elsewhere(args)
    except WhatIfError as exc:  # settings were checked already: the window has nothing
        return {"empty": True, "message": str(exc), "window_seconds": span.total_seconds(),
                "computed_at": end.isoformat()}
    return data | {
        "empty": False,
        "window_seconds": span.total_seconds(), "computed_at": end.isoformat(),
        "elapsed_s": round(time.monotonic() - began, 3)}


class ReplayTooLong(RuntimeError):
    """The replay ran past `REPLAY_SECONDS` and was stopped."""


def replay_elsewhere(args: Replayable, limit: float | None = None) -> dict[str, Any]:
    """`compare(*args).as_dict()` in a process of its own (`answer_in_child`), stopped after
    `limit` seconds: pure Python here would hold the proxy's interpreter lock for as long as
    it runs (a 20,000-request replay beside the event loop made the loop wake 5 ms late
    instead of 0.1 ms, /tmp probe in the review of issue 22). Spawned, not forked: the proxy
    has threads and an event loop a fork would copy mid-flight."""
    limit = REPLAY_SECONDS if limit is None else limit
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=answer_in_child, args=(theirs, args), daemon=True,
                        name="gpuproxy-whatif")
    child.start()
    theirs.close()
    try:
        if not ours.poll(limit):
            raise ReplayTooLong(
                f"the replay took longer than {format_duration(limit)} and was stopped: ask "
                "for a shorter window, or run `gpuproxy whatif` on the command line, which "
                "has no limit")
        status, value = ours.recv()
    except EOFError:
        status, value = "error", f"the replay process ended without an answer ({child.exitcode})"
    finally:
        ours.close()
        if child.is_alive():
            child.kill()
        child.join(5)
    if status == "whatif":
        raise WhatIfError(value)
    if status == "error":
        raise RuntimeError(f"the what-if replay failed: {value}")
    return value


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
