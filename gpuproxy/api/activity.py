"""The activity log's JSON API for the dashboard (`docs/activity.md`).

- `GET /api/activity?model=&band=&outcome=&since=&until=&limit=`: the newest rows first, every
  column, at most `limit` (1..1000, default 100).
- `GET /api/activity/stats?since=&until=&model=`: over a window (default the last hour):
  counts per outcome, token sums, and per band and per model the count, p50/p95/p99 of
  `queue_wait_ms` and p50 of `generation_tps`. Percentiles are `percentile_cont` (linear
  interpolation, NULLs ignored): in SQL on PostgreSQL, the same formula in Python on SQLite.

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
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from django.db.models import Count, Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from activity import outcomes
from activity.models import RequestLog
from gpuproxy.api.decorators import api_view, json_error
from gpuproxy.shell import runtime

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
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
        limit = parse_limit(q.get("limit"))
        since, until = parse_window(q, timezone.now(), None)
        filters = _filters(since, until, model=_text(q, "model"), band=_text(q, "band"),
                           outcome=parse_outcome(q.get("outcome")))
    except BadParameter as exc:
        return bad_parameter(exc)

    def fetch() -> list[dict[str, Any]]:
        qs = RequestLog.objects.filter(**filters).order_by("-received_at", "-id")
        return [dict(row) for row in qs.values()[:limit]]

    try:
        rows = await runtime.run_db(fetch)
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse({"data": rows, "limit": limit})


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


def _groups_postgresql(column: str, filters: dict[str, Any]) -> dict[str, dict]:
    assert column in ("band", "model")
    where, params = ["received_at >= %s"], [filters["received_at__gte"]]
    if "received_at__lt" in filters:
        where.append("received_at < %s")
        params.append(filters["received_at__lt"])
    if "model" in filters:
        where.append("model = %s")
        params.append(filters["model"])
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
    groups = (_groups_postgresql if connection.vendor == "postgresql" else _groups_python)
    return {
        "total": sum(by_outcome.values()),
        "outcomes": by_outcome,
        "tokens": {k: v or 0 for k, v in tokens.items()},
        "bands": groups("band", filters),
        "models": groups("model", filters),
    }


@api_view(("GET",))
async def activity_stats(request: HttpRequest) -> HttpResponse:
    q = request.GET
    now = timezone.now()
    try:
        since, until = parse_window(q, now, now - DEFAULT_STATS_WINDOW)
        model = _text(q, "model")
    except BadParameter as exc:
        return bad_parameter(exc)
    assert since is not None
    filters = _filters(since, until, model=model)
    try:
        stats = await runtime.run_db(lambda: compute_stats(filters))
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse({"window": {"since": since, "until": until or now}, "model": model,
                         **stats})
