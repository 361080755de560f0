"""The activity log's JSON API for the dashboard (`docs/activity.md`).

- `GET /api/activity?model=&band=&outcome=&since=&until=&limit=&offset=&sort=`: every
  column, at most `limit` rows (1..1000, default 100) after skipping `offset` (0..100000), in
  the order of `sort` (a column of SORTABLE, `-` for descending, NULLs last; default
  `-received_at`, the newest first). Ordering and paging happen in the database: the table
  has millions of rows. `has_more` says whether a next page exists (one row more is read).
- `GET /api/activity/stats?since=&until=&model=`: over a window (default the last hour):
  counts per outcome, the error rate, token sums, p50/p95/p99 of the queue wait, time to
  first token and duration, per band and per model the count, p50/p95/p99 of
  `queue_wait_ms` and p50 of `generation_tps`, a log-scale queue-wait histogram per band and
  the model loads (swaps) per hour. Percentiles are `percentile_cont` (linear
  interpolation, NULLs ignored): in SQL on PostgreSQL, the same formula in Python on SQLite.

`/dashboard/activity/rows` and `/dashboard/activity/stats` (`page_data`) answer the same
queries to the dashboard's Activity page: a logged-in staff member's session instead of an
API key (the page never holds one; once keys are defined the two paths above refuse it).
They are GETs that change nothing, and a foreign page cannot read their answers (no CORS
credentials, docs/security.md), so the session alone suffices, unlike the playground's POSTs
(gpuproxy/proxy/staff_session.py). Anyone else gets a 403 in the same envelope (a fetch can
show it; the login page's HTML it could not), as the other pages' data paths.

`since`/`until` take an ISO 8601 time or date (naive means UTC) or a relative age like `30m`,
`1h`, `7d`. The ORM runs on the dedicated database thread (`runtime.run_db`), never here.

The API needs the database and the proxy does not: during an outage both endpoints answer 503
`database_unavailable` (OpenAI envelope, Retry-After) at once while the outage is known
(`runtime.run_db` refuses without waiting for the pool), and after the pool's timeout for a
failure nothing had noticed yet, instead of a 500.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncHour
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from activity import captures, events, outcomes
from activity.models import ModelEvent, RequestLog
from gpuproxy.api.decorators import api_view, json_error, staff_refusal
from gpuproxy.shell import runtime

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# An offset is read and thrown away by the database: past this, narrow the window instead.
MAX_OFFSET = 100_000
DEFAULT_SORT = "-received_at"
#: The columns `sort` takes: those the page sorts by (no JSON, no free text but the model).
SORTABLE = ("received_at", "model", "band", "outcome", "status_code", "priority",
            "queue_wait_ms", "swap_ms", "ttft_ms", "duration_ms", "input_tokens",
            "cached_tokens", "output_tokens", "prompt_tps", "generation_tps")
#: Upper edges (ms) of the queue-wait histogram's buckets, log scale; a last bucket holds
#: the waits at or above the last edge.
WAIT_EDGES_MS = (1, 3, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000)
#: Outcomes that are not errors for the error rate: served, or the client or an operator
#: gave up (nothing failed).
NOT_ERRORS = (outcomes.OK, outcomes.CANCELLED_QUEUED, outcomes.CANCELLED_INFLIGHT,
              outcomes.CANCELLED_BY_ADMIN)
LATENCIES = ("queue_wait_ms", "ttft_ms", "duration_ms")
DEFAULT_STATS_WINDOW = dt.timedelta(hours=1)
PERCENTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)$", re.IGNORECASE)
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class BadParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


RETRY_AFTER = "5"  # seconds; the instance lock's check notices a recovery within about one


def database_unavailable(exc: OperationalError | InterfaceError) -> HttpResponse:
    detail = (str(exc) if isinstance(exc, runtime.DatabaseUnavailable)
              else f"database error ({type(exc).__name__})")
    return json_error(503, f"the activity log cannot be read: {detail}; retry later",
                      type_="server_error", code="database_unavailable",
                      headers={"Retry-After": RETRY_AFTER})


def bad_parameter(exc: BadParameter) -> HttpResponse:
    """A 400 in the OpenAI envelope, with `error.param` naming the parameter."""
    return json_error(400, exc.message, code="invalid_parameter", param=exc.param)


# ---- parameters ---------------------------------------------------------------------------

def parse_time(param: str, value: str, now: dt.datetime) -> dt.datetime:
    """An ISO 8601 time or date (naive = UTC), or a relative age (`90s`, `30m`, `1h`, `7d`,
    `2w`) counted back from now."""
    text = value.strip()
    m = _RELATIVE.match(text)
    if m:
        seconds = float(m.group(1)) * _UNITS[m.group(2).lower()]
        try:
            return now - dt.timedelta(seconds=seconds)
        except OverflowError:
            raise BadParameter(param, f"{param}={value!r} is too far back") from None
    # An unencoded `+01:00` arrives as a space.
    if "T" in text and " " in text:
        text = text.replace(" ", "+")
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadParameter(
            param, f"{param}={value!r} is neither an ISO 8601 time (2026-01-31T12:00:00Z) nor "
                   "a relative age like 30m, 1h or 7d") from None
    if timezone.is_naive(when):
        when = when.replace(tzinfo=dt.UTC)
    return when


def parse_limit(value: str | None) -> int:
    if value is None or value == "":
        return DEFAULT_LIMIT
    try:
        n = int(value)
    except ValueError:
        raise BadParameter("limit", f"limit={value!r} is not an integer "
                                    f"(1..{MAX_LIMIT})") from None
    if not 1 <= n <= MAX_LIMIT:
        raise BadParameter("limit", f"limit={n} is out of range: 1..{MAX_LIMIT}")
    return n


def _bounded_int(param: str, value: str | None, default: int, lo: int, hi: int) -> int:
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise BadParameter(param, f"{param}={value!r} is not an integer ({lo}..{hi})") from None
    if not lo <= n <= hi:
        raise BadParameter(param, f"{param}={n} is out of range: {lo}..{hi}")
    return n


def parse_offset(value: str | None) -> int:
    return _bounded_int("offset", value, 0, 0, MAX_OFFSET)


def parse_sort(value: str | None) -> str:
    """`column` or `-column`, a column of SORTABLE."""
    if not value:
        return DEFAULT_SORT
    if value.lstrip("-") not in SORTABLE or value.startswith("--"):
        raise BadParameter("sort", f"sort={value!r} is not one of: {', '.join(SORTABLE)} "
                                   "(a leading - sorts descending)")
    return value


def ordering(sort: str) -> list[Any]:
    """NULLs last either way (a request that never started has no ttft, and is not the
    fastest nor the slowest), then the id, so that pages never overlap."""
    column = sort.lstrip("-")
    if sort.startswith("-"):
        return [F(column).desc(nulls_last=True), F("id").desc()]
    return [F(column).asc(nulls_last=True), F("id").asc()]


def parse_window(query, now: dt.datetime, default_since: dt.datetime | None
                 ) -> tuple[dt.datetime | None, dt.datetime | None]:
    since = parse_time("since", query["since"], now) if query.get("since") else default_since
    until = parse_time("until", query["until"], now) if query.get("until") else None
    if since is not None and until is not None and since > until:
        raise BadParameter("since", f"since ({since.isoformat()}) is after until "
                                    f"({until.isoformat()})")
    return since, until


def parse_outcome(value: str | None) -> str | None:
    if not value:
        return None
    if value not in outcomes.ALL:
        raise BadParameter("outcome", f"outcome={value!r} is not one of: "
                                      f"{', '.join(outcomes.ALL)}")
    return value


def _text(query, name: str) -> str | None:
    """A free-text filter; NUL is refused (PostgreSQL text cannot hold it: the query would
    fail with a 500)."""
    value = query.get(name)
    if value and "\x00" in value:
        raise BadParameter(name, f"{name}={value!r} contains a NUL character")
    return value if value else None


def _filters(since: dt.datetime | None, until: dt.datetime | None,
             **equal: str | None) -> dict[str, Any]:
    f: dict[str, Any] = {k: v for k, v in equal.items() if v is not None}
    if since is not None:
        f["received_at__gte"] = since
    if until is not None:
        f["received_at__lt"] = until
    return f


# ---- GET /api/activity ----------------------------------------------------------------------

@api_view(("GET",))
async def activity_list(request: HttpRequest) -> HttpResponse:
    q = request.GET
    try:
        page = list_query(q, await captures_on())
    except BadParameter as exc:
        return bad_parameter(exc)
    try:
        body = await runtime.run_db(page)
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse(body)


async def captures_on() -> bool:
    """Whether captures are on (`captureBuffer`): off, no row has one, as the capture paths
    answer 404 then."""
    return bool((await runtime.port()).catalog.capture_buffer_mb)


def list_query(q, with_captures: bool = False) -> Callable[[], dict[str, Any]]:
    """The parameters checked (BadParameter), and the read to run on the database thread:
    shared with the dashboard's Activity page (dashboard/pages/activity.py). Each row says
    whether it has a capture (`has_capture`, as llama-swap's rows), for the page's capture
    button; `with_captures` False (captures off) is False for all, without a query."""
    limit = parse_limit(q.get("limit"))
    offset = parse_offset(q.get("offset"))
    sort = parse_sort(q.get("sort"))
    since, until = parse_window(q, timezone.now(), None)
    filters = _filters(since, until, model=_text(q, "model"), band=_text(q, "band"),
                       outcome=parse_outcome(q.get("outcome")))

    def fetch() -> dict[str, Any]:
        qs = RequestLog.objects.filter(**filters).order_by(*ordering(sort))
        read = list(qs.values()[offset:offset + limit + 1])
        has_more = len(read) > limit
        rows: list[dict[str, Any]] = [dict(row) for row in read[:limit]]
        captured = (captures.having(row["request_id"] for row in rows)
                    if with_captures and rows else frozenset())
        for row in rows:
            row["has_capture"] = row["request_id"] in captured
        return {"data": rows, "limit": limit, "offset": offset, "sort": sort,
                "has_more": has_more}

    return fetch


# ---- GET /api/activity/stats ----------------------------------------------------------------

def percentile_cont(values: list[float], fraction: float) -> float | None:
    """PostgreSQL's `percentile_cont`: linear interpolation between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = fraction * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(ordered[lo])
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _group_entry(count: int, waits: dict[str, float | None], tps_p50: float | None) -> dict:
    return {"count": count, "queue_wait_ms": waits, "generation_tps": {"p50": tps_p50}}


def _where(filters: dict[str, Any]) -> tuple[list[str], list[Any]]:
    where, params = ["received_at >= %s"], [filters["received_at__gte"]]
    if "received_at__lt" in filters:
        where.append("received_at < %s")
        params.append(filters["received_at__lt"])
    if "model" in filters:
        where.append("model = %s")
        params.append(filters["model"])
    return where, params


def _groups_postgresql(column: str, filters: dict[str, Any]) -> dict[str, dict]:
    assert column in ("band", "model")
    where, params = _where(filters)
    pct = ", ".join(f"percentile_cont({f}) WITHIN GROUP (ORDER BY queue_wait_ms)"
                    for _, f in PERCENTILES)
    sql = (f"SELECT {column}, count(*), {pct}, "
           "percentile_cont(0.5) WITHIN GROUP (ORDER BY generation_tps) "
           f"FROM activity_requestlog WHERE {' AND '.join(where)} "
           f"GROUP BY {column} ORDER BY {column}")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        out = {}
        for key, count, *rest in cursor.fetchall():
            waits = {name: rest[i] for i, (name, _) in enumerate(PERCENTILES)}
            out[key] = _group_entry(count, waits, rest[len(PERCENTILES)])
        return out


def _groups_python(column: str, filters: dict[str, Any]) -> dict[str, dict]:
    """The fallback (SQLite has no percentile_cont): the window's values, computed here."""
    acc: dict[str, tuple[list[int], list[float], list[float]]] = {}
    qs = (RequestLog.objects.filter(**filters)
          .values_list(column, "queue_wait_ms", "generation_tps").iterator(chunk_size=5000))
    for key, wait, tps in qs:
        n, waits, speeds = acc.setdefault(key, ([0], [], []))
        n[0] += 1
        if wait is not None:
            waits.append(wait)
        if tps is not None:
            speeds.append(tps)
    return {key: _group_entry(n[0], {name: percentile_cont(waits, f) for name, f in PERCENTILES},
                              percentile_cont(speeds, 0.5))
            for key, (n, waits, speeds) in sorted(acc.items())}


def _latency_postgresql(filters: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    where, params = _where(filters)
    pct = ", ".join(f"percentile_cont({f}) WITHIN GROUP (ORDER BY {column})"
                    for column in LATENCIES for _, f in PERCENTILES)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {pct} FROM activity_requestlog WHERE {' AND '.join(where)}",
                       params)
        values = iter(cursor.fetchone())
    return {column: {name: next(values) for name, _ in PERCENTILES} for column in LATENCIES}


def _latency_python(filters: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The fallback (SQLite has no percentile_cont)."""
    acc: dict[str, list[float]] = {column: [] for column in LATENCIES}
    for values in (RequestLog.objects.filter(**filters).values_list(*LATENCIES)
                   .iterator(chunk_size=5000)):
        for column, value in zip(LATENCIES, values, strict=True):
            if value is not None:
                acc[column].append(value)
    return {column: {name: percentile_cont(acc[column], f) for name, f in PERCENTILES}
            for column in LATENCIES}


def wait_histogram(filters: dict[str, Any]) -> dict[str, Any]:
    """Per band, the count of waits in each bucket, counted in the database (one pass,
    portable SQL: a filtered COUNT per bucket)."""
    lows = (None, *WAIT_EDGES_MS)
    highs = (*WAIT_EDGES_MS, None)
    buckets = {}
    for i, (lo, hi) in enumerate(zip(lows, highs, strict=True)):
        q = Q(queue_wait_ms__isnull=False)
        if lo is not None:
            q &= Q(queue_wait_ms__gte=lo)
        if hi is not None:
            q &= Q(queue_wait_ms__lt=hi)
        buckets[f"b{i}"] = Count("id", filter=q)
    rows = (RequestLog.objects.filter(**filters).values("band").annotate(**buckets)
            .order_by("band").values_list("band", *buckets))
    return {"edges_ms": list(WAIT_EDGES_MS),
            "bands": {band: list(counts) for band, *counts in rows}}


def swaps_per_hour(filters: dict[str, Any]) -> list[dict[str, Any]]:
    """Model loads (activity_modelevent kind='load') per UTC hour, hours without one left
    out."""
    f: dict[str, Any] = {"kind": events.LOAD, "at__gte": filters["received_at__gte"]}
    if "received_at__lt" in filters:
        f["at__lt"] = filters["received_at__lt"]
    if "model" in filters:
        f["model"] = filters["model"]
    rows = (ModelEvent.objects.filter(**f).annotate(hour=TruncHour("at", tzinfo=dt.UTC))
            .values("hour").annotate(n=Count("id")).order_by("hour"))
    return [{"hour": row["hour"], "count": row["n"]} for row in rows]


def compute_stats(filters: dict[str, Any]) -> dict[str, Any]:
    qs = RequestLog.objects.filter(**filters)
    by_outcome = {o: 0 for o in outcomes.ALL}
    for row in qs.values("outcome").annotate(n=Count("id")).order_by():
        by_outcome[row["outcome"]] = row["n"]
    # input/output: one meaning on every backend; prompt/completion: their aliases, which
    # rows older than migration 0006 fill with the backend's own meaning (docs/activity.md)
    tokens = qs.aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
                          cached=Sum("cached_tokens"), input=Sum("input_tokens"),
                          output=Sum("output_tokens"), draft=Sum("draft_tokens"),
                          draft_accepted=Sum("draft_accepted_tokens"))
    postgresql = connection.vendor == "postgresql"
    groups = _groups_postgresql if postgresql else _groups_python
    latency = _latency_postgresql if postgresql else _latency_python
    total = sum(by_outcome.values())
    errors = total - sum(by_outcome[o] for o in NOT_ERRORS)
    return {
        "total": total,
        "outcomes": by_outcome,
        "error_rate": errors / total if total else None,
        "tokens": {k: v or 0 for k, v in tokens.items()},
        "latency_ms": latency(filters),
        "queue_wait_histogram": wait_histogram(filters),
        "swaps_per_hour": swaps_per_hour(filters),
        "bands": groups("band", filters),
        "models": groups("model", filters),
    }


@api_view(("GET",))
async def activity_stats(request: HttpRequest) -> HttpResponse:
    try:
        stats = stats_query(request.GET)
    except BadParameter as exc:
        return bad_parameter(exc)
    try:
        body = await runtime.run_db(stats)
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse(body)


def stats_query(q) -> Callable[[], dict[str, Any]]:
    """As `list_query`, for the stats."""
    now = timezone.now()
    since, until = parse_window(q, now, now - DEFAULT_STATS_WINDOW)
    model = _text(q, "model")
    assert since is not None
    filters = _filters(since, until, model=model)

    def fetch() -> dict[str, Any]:
        return {"window": {"since": since, "until": until or now}, "model": model,
                **compute_stats(filters)}

    return fetch


# ---- the dashboard's Activity page ---------------------------------------------------------

PAGE_QUERIES = {"rows": list_query, "stats": stats_query}


async def page_data(request: HttpRequest, what: str) -> HttpResponse:
    """`rows` or `stats`: what `/api/activity` or `/api/activity/stats` answers to the same
    query string, errors included; for an active staff member's session only."""
    if refusal := await staff_refusal(request, "activity.view_requestlog",  # as the admin's
                                      reading="activity log", viewing="the activity log",
                                      perm_label="activity | request log | Can view request "
                                                 "log"):
        return refusal
    if what not in PAGE_QUERIES:
        return json_error(404, f"{request.path} is not a page of activity data: "
                               "/dashboard/activity/rows or /dashboard/activity/stats",
                          code="not_found")
    try:
        read = (list_query(request.GET, await captures_on()) if what == "rows"
                else PAGE_QUERIES[what](request.GET))
    except BadParameter as exc:
        return bad_parameter(exc)
    try:
        body = await runtime.run_db(read)
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse(body)
