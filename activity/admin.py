"""A read-only admin for the activity log, built to stay fast at 10M rows.

- No exact COUNT(*): the paginator estimates an unfiltered table from PostgreSQL's statistics
  (`pg_class.reltuples`) and caps a filtered count at `COUNT_CAP` rows.
- Default ordering is `-received_at` (newest arrival first; id order is finish order, where
  times look shuffled), paged by `admin_time.TimeBoundedPaginator`, which bounds the time
  through the primary key first so the BRIN index, not a sort of the table, finds a page.
  Column sorting is off, since sorting 10M rows by a non-btree column is a full sort.
- Times show seconds (milliseconds on a row's page) and durations read "2 min 42 s"
  (`admin_time`), not the admin's minute-only dates and raw milliseconds.
- The model and band filters list their distinct values with a loose index scan over the
  (model, received_at) / (band, received_at) indexes, not a `SELECT DISTINCT` over the table;
  the status filter offers a fixed list (status_code has no index).
- `date_hierarchy` costs one min/max and one `dates()` query per page (accepted).
- Search: a UUID searches `request_id` (indexed); anything else matches `model`, `client` or
  `end_user` exactly, and `client_ip` when it is an address (no `LIKE '%…%'` scans).
- The endpoint filter offers the fixed set of `activity/endpoints.py` (`endpoint` has no
  index, so its distinct values would cost a table scan).
- Model events (`ModelEvent`) get the same read-only list: filters by model (loose index scan)
  and kind, a date hierarchy, no exact count.
- Both show and filter by `node` (GPUPROXY_NODE, issue 24): a loose index scan over the
  (node, time) index; rows from before migration 0012 have '' and are not listed there.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import uuid
from functools import cached_property
from typing import Any, cast

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.http import StreamingHttpResponse
from django.utils import timezone
from django.utils.html import format_html

from activity import endpoints, fleet, partitions
from activity.admin_time import (
    TimeBoundedPaginator,
    at_millis,
    at_seconds,
    exact_ms,
    human_ms,
    shown,
)
from activity.management.commands.activity_export import COLUMNS, iter_csv
from activity.models import ModelEvent, Node, RequestLog
from scheduling.models import ModelDefinition
from scheduling.nodes import serves_text

#: the most rows a filtered changelist counts exactly; beyond it, "COUNT_CAP" is shown.
COUNT_CAP = 10_000
#: the most distinct values a model/band filter lists.
DISTINCT_CAP = 200


class EstimatedCountPaginator(Paginator):
    """`count` without COUNT(*) over a big table.

    Counts at most COUNT_CAP rows (`SELECT count(*) FROM (… LIMIT cap)`); when that hits the cap
    and the queryset is unfiltered, uses PostgreSQL's row estimate for the table instead.
    """

    @cached_property
    def count(self) -> int:
        qs = cast(QuerySet[Any], self.object_list)  # the admin pages a queryset, always
        capped = qs.order_by()[:COUNT_CAP].count()
        if capped < COUNT_CAP:
            return capped
        if not qs.query.where:
            estimate = self._estimate(qs)
            if estimate is not None:
                return max(estimate, COUNT_CAP)
        return COUNT_CAP

    @staticmethod
    def _estimate(qs) -> int | None:
        return partitions.estimate_rows(qs.model._meta.db_table, qs.db)  # over the partitions


def distinct_indexed(column: str, using: str, table: str = RequestLog._meta.db_table
                     ) -> list[str]:
    """Distinct non-empty values of an indexed column by a loose index scan (a recursive CTE that
    jumps from one value to the next through the index): O(distinct values), not O(rows)."""
    sql = (
        f"WITH RECURSIVE t(v, n) AS ("
        f" SELECT min({column}), 1 FROM {table} WHERE {column} > ''"
        f" UNION ALL"
        f" SELECT (SELECT min({column}) FROM {table} WHERE {column} > t.v), t.n + 1"
        f" FROM t WHERE t.v IS NOT NULL AND t.n < %s"
        f") SELECT v FROM t WHERE v IS NOT NULL"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(sql, [DISTINCT_CAP])
        return [row[0] for row in cursor.fetchall()]


class DistinctIndexedFilter(admin.SimpleListFilter):
    """A list filter on a string column with its choices found by a loose index scan."""

    column = ""

    def lookups(self, request, model_admin):
        qs = model_admin.get_queryset(request)
        return [(v, v) for v in distinct_indexed(self.column, qs.db, qs.model._meta.db_table)]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{self.column: self.value()})
        return queryset


class ModelFilter(DistinctIndexedFilter):
    title = "model"
    parameter_name = "model"
    column = "model"


class NodeFilter(DistinctIndexedFilter):
    title = "node"
    parameter_name = "node"
    column = "node"


class BandFilter(DistinctIndexedFilter):
    title = "band"
    parameter_name = "band"
    column = "band"


class StatusFilter(admin.SimpleListFilter):
    """Status classes and the codes the proxy itself answers with: a fixed list, because
    `status_code` has no index and `SELECT DISTINCT` would read the whole table."""

    title = "status code"
    parameter_name = "status"
    CLASSES = {"2xx": (200, 300), "3xx": (300, 400), "4xx": (400, 500), "5xx": (500, 600)}
    CODES = ("200", "400", "401", "404", "429", "502", "503", "504")

    def lookups(self, request, model_admin):
        return [*((c, c) for c in self.CLASSES), *((c, c) for c in self.CODES),
                ("none", "none")]

    def queryset(self, request, queryset):
        value = self.value()
        if value in self.CLASSES:
            lo, hi = self.CLASSES[value]
            return queryset.filter(status_code__gte=lo, status_code__lt=hi)
        if value == "none":
            return queryset.filter(status_code__isnull=True)
        if value and value.isdigit():
            return queryset.filter(status_code=int(value))
        return queryset


class EndpointFilter(admin.SimpleListFilter):
    """The kinds of call the proxy records (`activity/endpoints.py`): a fixed list, because
    `endpoint` has no index; "none" finds the rows older than migration 0006, which have ''."""

    title = "endpoint"
    parameter_name = "endpoint"

    def lookups(self, request, model_admin):
        return [*((e, e) for e in endpoints.ALL), ("none", "none")]

    def queryset(self, request, queryset):
        value = self.value()
        if value == "none":
            return queryset.filter(endpoint="")
        if value in endpoints.ALL:
            return queryset.filter(endpoint=value)
        return queryset


class RequestLogPaginator(TimeBoundedPaginator, EstimatedCountPaginator):
    time_field = "received_at"


ALL_FIELDS = [f.name for f in RequestLog._meta.concrete_fields]
#: the request log's time and duration fields, each shown by a `<field>_shown` column
TIMES = ("received_at", "dispatched_at", "first_byte_at", "finished_at")
DURATIONS = ("queue_wait_ms", "swap_ms", "ttft_ms", "duration_ms")


class ReadOnlyLog(admin.ModelAdmin):
    """What the request log and the model events share: read-only (analysts read rows; the
    writer is the only thing that creates them), and a search that takes a request id
    (exact) or an exact value of one of `search_other`'s columns (or, for an address, of
    `search_address`'s)."""

    search_other: tuple[str, ...] = ()
    #: inet columns, compared only with a term that is an address (PostgreSQL refuses others)
    search_address: tuple[str, ...] = ()

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            return queryset.filter(request_id=uuid.UUID(term)), False
        except ValueError:
            match = Q()
            for column in self.search_other:
                match |= Q(**{column: term})
            if self.search_address and _is_address(term):
                for column in self.search_address:
                    match |= Q(**{column: term})
            return queryset.filter(match), False


@admin.register(RequestLog)
class RequestLogAdmin(ReadOnlyLog):
    list_display = ("received", "model", "endpoint", "band", "priority_shown", "outcome",
                    "status_code", "queue_wait", "swap", "duration", "input_tokens",
                    "output_tokens", "tps", "client", "node")
    list_filter = (ModelFilter, EndpointFilter, BandFilter, "outcome", StatusFilter, "stream",
                   NodeFilter)
    date_hierarchy = "received_at"
    search_fields = ("request_id", "model", "client", "end_user", "client_ip", "node")
    search_help_text = ("a request id, or a model, client, end user, client address or node "
                        "(all exact)")
    ordering = ("-received_at", "-id")
    sortable_by = ()
    list_per_page = 100
    show_full_result_count = False
    paginator = RequestLogPaginator
    actions = ("export_csv",)
    readonly_fields = (*ALL_FIELDS, "score_breakdown",
                       *(f"{f}_shown" for f in (*TIMES, *DURATIONS)))
    fieldsets = (
        (None, {"fields": ("request_id", "node", "entry_node", "outcome", "status_code",
                           "error", "client", "client_ip", "end_user", "user_agent")}),
        ("Request", {"fields": ("method", "path", "endpoint", "model_requested", "model",
                                "stream", "upstream_retries")}),
        ("Scheduling", {"fields": ("scheduler", "priority_asked", "priority", "band", "score",
                                   "score_breakdown", "score_parts")}),
        ("Timing", {"fields": tuple(f"{f}_shown" for f in (*TIMES, *DURATIONS))}),
        ("Tokens", {"fields": ("input_tokens", "cached_tokens", "output_tokens",
                               "output_tokens_counted", "draft_tokens", "draft_accepted_tokens",
                               "prompt_tps", "generation_tps")}),
        # the aliases: rows older than migration 0006 hold only these, with their backend's
        # meaning (docs/activity.md, "Token counts across backends")
        ("Token aliases", {"fields": ("prompt_tokens", "completion_tokens"),
                           "classes": ("collapse",)}),
        ("Row", {"fields": ("id",)}),
    )

    search_other = ("model", "client", "end_user", "node")
    search_address = ("client_ip",)

    # the list: seconds and human durations; a row's page: milliseconds and exact values
    received = shown("received_at", "received at", at_seconds)
    queue_wait = shown("queue_wait_ms", "queue wait", human_ms)
    swap = shown("swap_ms", "swap", human_ms)
    duration = shown("duration_ms", "duration", human_ms)
    received_at_shown = shown("received_at", "received at", at_millis)
    dispatched_at_shown = shown("dispatched_at", "dispatched at", at_millis)
    first_byte_at_shown = shown("first_byte_at", "first byte at", at_millis)
    finished_at_shown = shown("finished_at", "finished at", at_millis)
    queue_wait_ms_shown = shown("queue_wait_ms", "queue wait", exact_ms)
    swap_ms_shown = shown("swap_ms", "swap", exact_ms)
    ttft_ms_shown = shown("ttft_ms", "time to first token", exact_ms)
    duration_ms_shown = shown("duration_ms", "duration", exact_ms)

    @admin.display(description="gen. tok/s")
    def tps(self, obj: RequestLog) -> str | None:
        return None if obj.generation_tps is None else f"{obj.generation_tps:.1f}"

    @admin.display(description="priority")
    def priority_shown(self, obj: RequestLog) -> str:
        """The applied priority, with what was asked when the key's range clamped it: the
        clamp is what an operator looking at a slow request wants to see first."""
        if obj.priority_asked is not None and obj.priority_asked != obj.priority:
            return f"{obj.priority} (asked {obj.priority_asked})"
        return str(obj.priority)

    @admin.display(description="score breakdown")
    def score_breakdown(self, obj: RequestLog) -> str:
        parts = obj.score_parts or {}
        if not parts:
            return "—"
        terms = [(name, parts.get(name)) for name in ("priority", "affinity", "aging")]
        total = obj.score
        if total is None:
            total = sum(float(v or 0) for _, v in terms)
        text = " + ".join(f"{name} {_num(v)}" for name, v in terms) + f" = score {_num(total)}"
        seq = parts.get("seq")
        if seq is not None:
            text += f" (arrival #{seq})"
        return format_html("<code>{}</code>", text)

    @admin.action(description="Export selected as CSV")
    def export_csv(self, request, queryset):
        rows = queryset.order_by("received_at", "id").values_list(*COLUMNS).iterator(
            chunk_size=2000)
        response = StreamingHttpResponse(iter_csv(rows), content_type="text/csv; charset=utf-8")
        stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
        response["Content-Disposition"] = f'attachment; filename="activity-{stamp}.csv"'
        return response


def _is_address(term: str) -> bool:
    try:
        ipaddress.ip_address(term)
    except ValueError:
        return False
    return True


def _num(value) -> str:
    if value is None:
        return "?"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@admin.register(ModelEvent)
class ModelEventAdmin(ReadOnlyLog):
    """The model events, newest first: read-only like the request log, and as cheap on a big
    table (no exact count, no column sorting, the model filter by a loose index scan)."""

    list_display = ("when", "model", "kind", "reason", "pid", "duration", "detail",
                    "request_id", "node")
    list_filter = (ModelFilter, "kind", "reason", NodeFilter)
    date_hierarchy = "at"
    search_fields = ("request_id", "model", "node")
    search_help_text = "a request id, a model id or a node (all exact)"
    ordering = ("-at", "-id")  # the `at` btree (activity_me_time) reads it in order
    sortable_by = ()
    list_per_page = 100
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    fields = ("at_shown", "node", "model", "kind", "reason", "pid", "duration_ms_shown",
              "detail", "request_id", "id")
    readonly_fields = fields

    search_other = ("model", "node")

    when = shown("at", "at", at_seconds)
    duration = shown("duration_ms", "duration", human_ms)
    at_shown = shown("at", "at", at_millis)
    duration_ms_shown = shown("duration_ms", "duration", exact_ms)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """The fleet: every node that writes to this database, with its status computed at the
    database's clock, the one the heartbeats are written by (up while its heartbeat is at most
    GPUPROXY_FLEET_DOWN_SECONDS old). Read-only: each row is its node's own, rewritten every
    second. A row that is down or stopped may be deleted (a node retired or renamed); an up one
    may not, since its node would only write it again within a second."""

    list_display = ("node", "status", "heartbeat_age", "serves", "loaded_models",
                    "queue_depth", "in_flight_total", "version", "listen")
    fields = ("node", "status", "heartbeat_at", "started_at", "pid", "version", "listen",
              "loaded", "queue", "in_flight")
    readonly_fields = fields
    list_display_links = None
    sortable_by = ()

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        if not super().has_delete_permission(request, obj):
            return False
        return obj is None or self.status(obj) != fleet.UP

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(db_now=Now())  # one clock for the page

    def get_list_display(self, request):
        read: dict[str, list[tuple[str, list[str]]]] = {}

        @admin.display(description="serves")
        def serves(obj: Node) -> str:
            """The models placed on it (scheduling/nodes.py), read once per page."""
            if "placements" not in read:
                read["placements"] = list(ModelDefinition.objects.filter(
                    enabled=True).values_list("model_id", "nodes"))
            return serves_text(obj.node, ((m, n or []) for m, n in read["placements"]))

        return tuple(serves if name == "serves" else name for name in self.list_display)

    @admin.display(description="serves")
    def serves(self, obj: Node) -> str:
        """What the system check looks up; the list shows `get_list_display`'s column."""
        return serves_text(obj.node, ModelDefinition.objects.filter(enabled=True).values_list(
            "model_id", "nodes"))

    @staticmethod
    def _now(obj: Node) -> dt.datetime:
        return getattr(obj, "db_now", None) or fleet.database_now()

    @admin.display(description="status")
    def status(self, obj: Node) -> str:
        return fleet.status(obj, self._now(obj))

    @admin.display(description="heartbeat")
    def heartbeat_age(self, obj: Node) -> str:
        return f"{max(0.0, (self._now(obj) - obj.heartbeat_at).total_seconds()):.1f} s ago"

    @admin.display(description="loaded")
    def loaded_models(self, obj: Node) -> str:
        return ", ".join(obj.loaded or []) or "-"

    @admin.display(description="queued")
    def queue_depth(self, obj: Node) -> int:
        return fleet.queue_depth(obj.queue)

    @admin.display(description="in flight")
    def in_flight_total(self, obj: Node) -> int:
        return sum(int(n) for n in (obj.in_flight or {}).values())
