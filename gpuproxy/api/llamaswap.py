"""llama-swap's read API over our own data, same paths and shapes, so its clients and scripts
keep working (`docs/activity.md`, "llama-swap's activity API"):

- `GET /api/metrics/activity`: pages of `activity_requestlog` in llama-swap's row shape.
- `GET /api/metrics/stats`: request and token totals, prompt and generation speed histograms.
- `GET /api/version`: `gpuproxy.version.version_info()`.
- `/ui`, `/ui/…` and `GET /upstream`: redirects to our dashboard, where llama-swap serves its
  own UI (a bookmark of `/ui/#/models` keeps its fragment across the redirect).

Where llama-swap has a number we do not know (a NULL column: a draft count not reported), we
send its sentinel for "unknown", -1, so its UI and scripts read it the same way. The `tokens`
come from the columns that mean the same on every backend (issue 20): `input_tokens` counts
the cached ones too, where llama-swap's is llama.cpp's uncached `prompt_n` (docs/activity.md);
a row written before those columns existed shows its `prompt_tokens`/`completion_tokens`.

The table holds millions of rows (llama-swap's holds at most a thousand in memory): `total`
counts at most COUNT_CAP matching rows (the admin's paginator, one owner of that rule), and an
unfiltered table larger than that reports PostgreSQL's estimate; the stats are aggregates
computed by the database, never rows loaded here. The ORM runs on the database thread
(`runtime.run_db`), and a database outage is a 503, as on `/api/activity`.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from django.db import InterfaceError, OperationalError, connection
from django.db.models import Aggregate, Count, F, FloatField, Max, Min, Q, QuerySet, Sum, Value
from django.db.models.functions import Floor
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from activity import captures
from activity.admin import EstimatedCountPaginator
from activity.models import RequestLog
from gpuproxy.api.activity import BadParameter, bad_parameter, database_unavailable
from gpuproxy.api.decorators import api_view, json_error
from gpuproxy.shell import runtime
from gpuproxy.version import version_info

DEFAULT_LIMIT = 25
MAX_LIMIT = 999
UNKNOWN = -1  # llama-swap's "not reported"

#: llama-swap's sort keys (its UI's column ids) -> our column. `resp_content_type` sorts by
#: `stream`, the column it is derived from.
SORT_COLUMNS = {
    "id": "id",
    "time": "received_at",
    "model": "model",
    "req_path": "path",
    "resp_status_code": "status_code",
    "resp_content_type": "stream",
    "cached": "cached_tokens",
    "prompt": "prompt_tokens",  # input_tokens' alias, set on rows older than it too
    "generated": "completion_tokens",
    "drafted": "draft_tokens",
    "prompt_speed": "prompt_tps",
    "gen_speed": "generation_tps",
    "duration": "duration_ms",
}

_ROW_FIELDS = ("id", "request_id", "received_at", "model", "model_requested", "path",
               "status_code", "outcome", "stream", "priority", "band", "scheduler",
               "queue_wait_ms", "swap_ms", "ttft_ms", "duration_ms", "input_tokens",
               "output_tokens", "prompt_tokens", "completion_tokens", "cached_tokens",
               "draft_tokens", "draft_accepted_tokens", "prompt_tps", "generation_tps", "error")

# Go's time.RFC3339 as time.Parse reads it: a zone is required, fractional seconds allowed.
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


# ---- GET /api/metrics/activity --------------------------------------------------------------

@dataclass
class ActivityQuery:
    models: list[str] = field(default_factory=list)
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    min_id: int = 0
    max_id: int = 0
    limit: int = DEFAULT_LIMIT
    page: int = 1
    sort: str = "id"
    order: str = "desc"


def _rfc3339(param: str, raw: str) -> dt.datetime | None:
    text = raw.strip()
    if not text:
        return None
    if " " in text:  # an unencoded `+01:00` arrives as a space
        text = text.replace(" ", "+")
    message = (f"invalid '{param}' timestamp, use RFC3339 format "
               f"(2026-01-31T12:00:00Z), not {raw!r}")
    if not _RFC3339.match(text):
        raise BadParameter(param, message)
    try:
        return dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        raise BadParameter(param, message) from None


def _row_id(param: str, raw: str) -> int:
    text = raw.strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BadParameter(param, f"{param} must be >= 1, not {raw!r}")
    return value


def parse_activity_query(q: Any) -> ActivityQuery:
    """llama-swap's parameters, its checks in its order, its messages (with the value sent)."""
    query = ActivityQuery()
    for raw in q.getlist("model"):
        model = raw.strip()
        if "\x00" in model:  # PostgreSQL text cannot hold it: the query would fail with a 500
            raise BadParameter("model", f"model={raw!r} contains a NUL character")
        if model:
            query.models.append(model)
    query.start = _rfc3339("start", q.get("start", ""))
    query.end = _rfc3339("end", q.get("end", ""))
    if query.start is not None and query.end is not None and query.start > query.end:
        raise BadParameter("start", "start must be before end")
    query.min_id = _row_id("min_id", q.get("min_id", ""))
    query.max_id = _row_id("max_id", q.get("max_id", ""))
    if query.min_id and query.max_id and query.min_id > query.max_id:
        raise BadParameter("min_id", "min_id must be <= max_id")
    if raw := q.get("limit", "").strip():
        try:
            limit = int(raw)
        except ValueError:
            raise BadParameter("limit", f"invalid limit {raw!r}: use a number between 1 and "
                                        f"{MAX_LIMIT}") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise BadParameter("limit", f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
        query.limit = limit
    if raw := q.get("page", "").strip():
        try:
            page = int(raw)
        except ValueError:
            page = 0
        if page < 1:
            raise BadParameter("page", f"page must be >= 1, not {raw!r}")
        query.page = page
    if raw := q.get("sort", "").strip():
        if raw not in SORT_COLUMNS:
            raise BadParameter("sort", f"invalid sort column {raw!r}: use one of "
                                       f"{', '.join(SORT_COLUMNS)}")
        query.sort = raw
    if raw := q.get("order", "").strip():
        if raw.lower() not in ("asc", "desc"):
            raise BadParameter("order", f"order must be asc or desc, not {raw!r}")
        query.order = raw.lower()
    return query


def models_filter(models: list[str]) -> Q:
    """The rows a llama-swap `model` filter names: by the model they resolved to, or, for a
    request that named no known model, by the name asked for (what the row shows)."""
    return Q(model__in=models) | Q(model="", model_requested__in=models)


def activity_queryset(query: ActivityQuery) -> QuerySet[RequestLog]:
    qs = RequestLog.objects.all()
    if query.models:
        qs = qs.filter(models_filter(query.models))
    if query.start is not None:
        qs = qs.filter(received_at__gte=query.start)
    if query.end is not None:
        qs = qs.filter(received_at__lte=query.end)  # inclusive, as llama-swap's
    if query.min_id:
        qs = qs.filter(id__gte=query.min_id)
    if query.max_id:
        qs = qs.filter(id__lte=query.max_id)
    return qs


def _ordering(query: ActivityQuery) -> list[Any]:
    """llama-swap's order: the column, then id the same way so pages are stable; an unknown
    value (NULL, llama-swap's -1) sorts as the smallest."""
    column = SORT_COLUMNS[query.sort]
    desc = query.order == "desc"
    first = F(column).desc(nulls_last=True) if desc else F(column).asc(nulls_first=True)
    if column == "id":
        return [first]
    return [first, F("id").desc() if desc else F("id").asc()]


def _number(value: float | int | None, as_int: bool = False) -> float | int:
    if value is None:
        return UNKNOWN
    return round(value) if as_int else value


def _timestamp(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _either(value: Any, older: Any) -> Any:
    """A token column, else its alias (rows written before migration 0006 have only that)."""
    return value if value is not None else older


def llamaswap_row(row: dict[str, Any], captured: AbstractSet[Any] = frozenset()
                  ) -> dict[str, Any]:
    """One of our rows as llama-swap's `ActivityLogEntry`. What llama-swap has no field for
    travels in `metadata` (a string map there: `fifo_priority` is its own key)."""
    status = row["status_code"]
    entry: dict[str, Any] = {
        "id": row["id"],
        "timestamp": _timestamp(row["received_at"]),
        "model": row["model"] or row["model_requested"],
        "req_path": row["path"],
        # Not recorded: a streamed request that succeeded was answered with SSE.
        "resp_content_type": ("text/event-stream"
                              if row["stream"] and status is not None and 200 <= status < 300
                              else ""),
        "resp_status_code": _number(status),
        "tokens": {
            "cache_tokens": _number(row["cached_tokens"]),
            "draft_tokens": _number(row["draft_tokens"]),
            "draft_acc_tokens": _number(row["draft_accepted_tokens"]),
            "input_tokens": _number(_either(row["input_tokens"], row["prompt_tokens"])),
            "output_tokens": _number(_either(row["output_tokens"], row["completion_tokens"])),
            "prompt_per_second": _number(row["prompt_tps"]),
            "tokens_per_second": _number(row["generation_tps"]),
        },
        "duration_ms": _number(row["duration_ms"], as_int=True),
        # captures: the one place `has_capture` is computed (`captured`: activity/captures.py)
        "has_capture": row["request_id"] in captured,
    }
    if row["error"]:
        entry["error_msg"] = row["error"]
    metadata = {"fifo_priority": str(row["priority"]), "outcome": row["outcome"],
                "request_id": str(row["request_id"])}
    for key in ("band", "scheduler", "model_requested"):
        if row[key]:
            metadata[key] = row[key]
    for key in ("queue_wait_ms", "swap_ms", "ttft_ms"):
        if row[key] is not None:
            metadata[key] = f"{row[key]:.3f}"
    entry["metadata"] = metadata
    return entry


def list_activity(query: ActivityQuery, captures_on: bool = False) -> dict[str, Any]:
    """`captures_on`: whether captures are on (`captureBuffer`); off, no row has one, as
    `/api/captures/{id}` answers 404 then."""
    qs = activity_queryset(query)
    total = EstimatedCountPaginator(qs, query.limit).count
    offset = (query.page - 1) * query.limit
    rows = list(qs.order_by(*_ordering(query)).values(*_ROW_FIELDS)[offset:offset + query.limit])
    captured = (captures.having(row["request_id"] for row in rows) if captures_on and rows
                else frozenset())
    return {"data": [llamaswap_row(row, captured) for row in rows], "page": query.page,
            "limit": query.limit, "total": total,
            "total_pages": math.ceil(total / query.limit) if total else 0}


@api_view(("GET",))
async def activity(request: HttpRequest) -> HttpResponse:
    try:
        query = parse_activity_query(request.GET)
    except BadParameter as exc:
        return bad_parameter(exc)
    try:
        on = bool((await runtime.port()).catalog.capture_buffer_mb)
        page = await runtime.run_db(lambda: list_activity(query, on))
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse(page)


# ---- GET /api/metrics/stats -----------------------------------------------------------------

PERCENTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
MIN_BINS, MAX_BINS = 5, 20
#: llama-swap's histograms -> our speed column
HISTOGRAMS = (("prompt_histogram", "prompt_tps"), ("gen_histogram", "generation_tps"))


class PercentileCont(Aggregate):
    """PostgreSQL's `percentile_cont`: linear interpolation between the closest ranks, the
    formula of llama-swap's `percentile`."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: str, fraction: float, **extra: Any) -> None:
        super().__init__(expression, fraction=float(fraction), **extra)


def _percentiles_by_rank(qs: QuerySet[RequestLog], column: str, n: int) -> dict[str, float]:
    """The same interpolation where the database has no `percentile_cont` (SQLite): the two
    values around each rank, read by the database's sort (two rows each)."""
    out = {}
    for name, fraction in PERCENTILES:
        rank = fraction * (n - 1)
        lower = math.floor(rank)
        pair = list(qs.order_by(column).values_list(column, flat=True)[lower:lower + 2])
        value = pair[0]
        if len(pair) > 1:
            value += (rank - lower) * (pair[1] - pair[0])
        out[name] = value
    return out


def compute_llamaswap_stats(models: list[str]) -> dict[str, Any]:
    """llama-swap's stats: totals over the rows, and per speed column (values > 0, as
    llama-swap counts a speed that was not reported as none) its histogram: Sturges' bin
    count within 5..20, equal widths from min to max, and p50/p95/p99."""
    qs = RequestLog.objects.all()
    if models:
        qs = qs.filter(models_filter(models))
    postgres = connection.vendor == "postgresql"
    aggregates: dict[str, Any] = {
        "total": Count("id"), "input": Sum("prompt_tokens"), "output": Sum("completion_tokens"),
        "cache": Sum("cached_tokens", filter=Q(cached_tokens__gt=0)),
    }
    for _, column in HISTOGRAMS:
        positive = Q(**{f"{column}__gt": 0})
        aggregates[f"{column}_n"] = Count(column, filter=positive)
        aggregates[f"{column}_min"] = Min(column, filter=positive)
        aggregates[f"{column}_max"] = Max(column, filter=positive)
        if postgres:
            for name, fraction in PERCENTILES:
                aggregates[f"{column}_{name}"] = PercentileCont(column, fraction,
                                                                filter=positive)
    agg = qs.aggregate(**aggregates)
    stats: dict[str, Any] = {
        "total_requests": agg["total"], "total_input_tokens": agg["input"] or 0,
        "total_output_tokens": agg["output"] or 0, "total_cache_tokens": agg["cache"] or 0,
    }
    for key, column in HISTOGRAMS:
        n = agg[f"{column}_n"]
        if not n:
            stats[key] = None
            continue
        values = qs.filter(**{f"{column}__gt": 0})
        lo, hi = float(agg[f"{column}_min"]), float(agg[f"{column}_max"])
        pct = ({name: agg[f"{column}_{name}"] for name, _ in PERCENTILES} if postgres
               else _percentiles_by_rank(values, column, n))
        if lo == hi:
            bins, size = [n], 0.0
        else:
            count = min(MAX_BINS, max(MIN_BINS, math.ceil(math.log2(n)) + 1))
            size = (hi - lo) / count
            bins = [0] * count
            index = Floor((F(column) - Value(lo)) / Value(size), output_field=FloatField())
            for b, c in (values.annotate(b=index).values("b").annotate(c=Count("id"))
                         .order_by().values_list("b", "c")):
                bins[min(int(b), count - 1)] += c  # the maximum falls one past the last bin
        stats[key] = {"bins": bins, "min": lo, "max": hi, "binSize": size, **pct}
    return stats


@api_view(("GET",))
async def stats(request: HttpRequest) -> HttpResponse:
    model = request.GET.get("model", "").strip()
    if "\x00" in model:
        return bad_parameter(BadParameter("model", f"model={model!r} contains a NUL character"))
    try:
        body = await runtime.run_db(lambda: compute_llamaswap_stats([model] if model else []))
    except (OperationalError, InterfaceError) as exc:  # the connection, not the query
        return database_unavailable(exc)
    return JsonResponse(body)


# ---- GET /api/version, the UI's paths ------------------------------------------------------

@api_view(("GET",), admin=False)
async def version(request: HttpRequest) -> HttpResponse:
    """What build this is; any key holder may ask (it says nothing of the models or users)."""
    return JsonResponse(version_info())


@csrf_exempt  # a POST is refused below, as JSON; CSRF's own refusal is an HTML page
def to_dashboard(request: HttpRequest, rest: str = "") -> HttpResponse:
    """llama-swap's UI paths (`/ui/…`, and `/upstream`, its model list) lead to our dashboard;
    a URL fragment such as `#/models` is kept by the browser and ignored there."""
    if request.method not in ("GET", "HEAD"):
        return json_error(405, f"{request.method} is not allowed on {request.path}; use GET",
                          code="method_not_allowed", headers={"Allow": "GET, HEAD"})
    return HttpResponseRedirect("/")
