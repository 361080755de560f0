"""Admin for model definitions, groups, the settings singleton and API keys: the pages that
drive the running proxy.

Validation is the models' `clean()`, shared with `import_config`, so the admin refuses what an
import refuses, in the same words. Saved changes reach the running proxy on commit (the
scheduling signals); the model actions (load, unload, restart) act on the proxy that serves
this admin, through `gpuproxy.shell.control`, and never wait for a load to finish: one can take
minutes, and an admin request must not hold a worker that long.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from scheduling import admin_defaults
from scheduling import live as control
from scheduling.admin_routing import (  # the routing pages register themselves on import
    ROUTING_FIELDSET,
    DeleteGuard,
    ManagedBanner,
    ModelDefinitionForm,
    ProxySettingsForm,
    RoutingAdmin,
)
from scheduling.catalog import url_host
from scheduling.guarantees import guarantees, parse_number
from scheduling.models import ApiKey, ConfigImport, ModelDefinition, ModelGroup, ProxySettings
from scheduling.nodes import placement_text

logger = logging.getLogger("gpuproxy.admin")

#: how long an action waits for the proxy's answer: long enough to report a refusal the proxy
#: gives at once (unknown model, a start that fails immediately), far shorter than a load.
ACTION_WAIT_SECONDS = 0.2

NOT_RUNNING = "the proxy is not running in this process"
NOT_IN_CATALOG = ("not in the running proxy's definitions yet: a saved change reaches it "
                  "within seconds")

MODEL_LIVE_NOTE = (
    "Saved changes apply to the running proxy at once: a changed model restarts as soon as it "
    "is idle (a request in flight is never cut off), a new one can be requested right away, and "
    "a disabled one stops when idle.")
SETTINGS_LIVE_NOTE = (
    "Saved changes apply to the running proxy at once: the waiting requests are re-ranked with "
    "the new values, without a restart and without losing a request.")


@dataclass(frozen=True)
class LiveView:
    """What the proxy in this process said about its models, read once per page."""

    running: bool
    models: dict[str, control.ModelLive] = field(default_factory=dict)

    @classmethod
    def read(cls) -> LiveView:
        if not control.running():
            return cls(False)
        return cls(True, control.live_models())


def describe_live(obj: ModelDefinition, live: LiveView, *,
                  full: bool = False) -> str | SafeString:
    """ "ready", "ready · 2 in flight", "ready · restart needed", "stopped", or a dash that
    says (on hover) why nothing is known. A failed start says why: on hover in the list, in
    full on the change page (`full`)."""
    if not live.running:
        return format_html('<span title="{}">—</span>', NOT_RUNNING)
    state = live.models.get(obj.model_id)
    if state is None:
        if not obj.enabled:
            return "disabled"
        return format_html('<span title="{}">—</span>', NOT_IN_CATALOG)
    parts = [state.state]
    if state.in_flight:
        parts.append(f"{state.in_flight} in flight")
    if state.restart_needed:
        parts.append("restart needed")
    text = " · ".join(parts)
    if state.state == "failed" and state.last_error:
        if full:
            return f"{text}: {state.last_error}"
        return format_html('<span title="{}">{}</span>', state.last_error, text)
    return text


def _request_live(request: HttpRequest) -> LiveView:
    live = getattr(request, "_gpuproxy_live", None)
    if live is None:
        live = LiveView.read()
        setattr(request, "_gpuproxy_live", live)  # noqa: B010 (a cache on the request)
    return live


def _failure(exc: BaseException) -> str:
    """A SchedulingError carries its user-facing message; anything else is unexpected."""
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else f"{type(exc).__name__}: {exc}"


def _log_late_failure(what: str) -> Callable[[concurrent.futures.Future], None]:
    """The admin page has already answered by the time a slow load fails: the log keeps it."""

    def done(future: concurrent.futures.Future) -> None:
        if not future.cancelled() and (exc := future.exception()) is not None:
            logger.error("admin: %s failed: %s", what, _failure(exc))

    return done


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(DeleteGuard, ManagedBanner):
    form = ModelDefinitionForm
    # "live_state" and "ttl_shown" are replaced per request by columns that read the proxy
    # and the settings once per page. Narrow enough for a 1366 px screen between the admin's
    # two sidebars: the name and group under the id, "disabled" as the live state, the
    # upstream as host:port, the defaults in words that wrap, the slots' reason on hover.
    list_display = ("model_shown", "live_state", "placement", "upstream", "ttl_shown",
                    "concurrency", "slots_short")
    list_filter = ("enabled", "group")
    search_fields = ("model_id", "name", "description")
    list_select_related = ("group",)
    readonly_fields = ("live_state", "slots")
    actions = ("load_models", "unload_models", "restart_models")
    managed_kind = "models"
    guard_kind = "models"
    fieldsets = (
        ("Identity", {"fields": ("model_id", "live_state", "enabled", "name", "description",
                                 "aliases", "unlisted", "group", "nodes")}),
        ("Process", {
            "fields": ("cmd", "cmd_stop", "env", "proxy", "port", "check_endpoint", "ttl",
                       "unload_timeout"),
            "description": "Editing cmd is running a program on this box, as the user the proxy "
                           "runs as: only staff with the change permission can. After a save, "
                           "the process restarts with the new definition as soon as it is "
                           "idle."}),
        ("Requests and scheduling", {"fields": ("concurrency_limit", "parallel", "slots",
                                                "send_loading_state", "fifo_priority")}),
        ("Filters", {"fields": ("use_model_name", "strip_params", "set_params",
                                "set_params_by_id")}),
        ("Listing", {"fields": ("metadata", "capabilities"), "classes": ("collapse",)}),
    )

    def managed_name(self, obj: ModelDefinition) -> str | None:
        return obj.model_id

    def guard_names(self, objs) -> set[str]:
        return {o.model_id for o in objs}

    def get_fieldsets(self, request: HttpRequest, obj: ModelDefinition | None = None):
        if obj is not None:
            return self.fieldsets
        # a model being added has no live state yet
        return tuple((name, {**opts, "fields": tuple(f for f in opts["fields"]
                                                     if f != "live_state")})
                     for name, opts in self.fieldsets)

    def get_list_display(self, request: HttpRequest):
        @admin.display(description="live state")
        def live_state(obj: ModelDefinition) -> str | SafeString:
            if not obj.enabled:
                return "disabled"
            return describe_live(obj, _request_live(request))

        @admin.display(description="ttl", ordering="ttl")
        def ttl_shown(obj: ModelDefinition) -> str:
            settings = getattr(request, "_gpuproxy_settings", None) or ProxySettings.load()
            return admin_defaults.ttl(obj.ttl, settings.global_ttl)

        columns = {"live_state": live_state, "ttl_shown": ttl_shown}
        # "nodes" only once some model is placed: else every model runs on every node, and
        # the column would say "all" on each row of a single box's page
        placed = ModelDefinition.objects.exclude(nodes=[]).exists()
        return tuple(columns.get(name, name) for name in self.list_display
                     if placed or name != "placement")

    def changelist_view(self, request: HttpRequest, extra_context=None):
        # one read of the proxy and the settings for the whole page, not one per row
        setattr(request, "_gpuproxy_live", LiveView.read())  # noqa: B010
        setattr(request, "_gpuproxy_settings", ProxySettings.load())  # noqa: B010
        return super().changelist_view(request, extra_context)

    @admin.display(description="model", ordering="model_id")
    def model_shown(self, obj: ModelDefinition) -> SafeString:
        lines = [format_html("{}", obj.model_id)]
        if obj.name and obj.name != obj.model_id:
            lines.append(format_html('<span class="quiet">{}</span>', obj.name))
        if obj.group is not None:  # list_select_related: no query per row
            lines.append(format_html('<span class="quiet">group {}</span>', obj.group.group_id))
        return format_html_join(mark_safe("<br>"), "{}", ((line,) for line in lines))

    @admin.display(description="nodes")
    def placement(self, obj: ModelDefinition) -> str:
        """Which nodes of the fleet run it: "all", or their names (docs/fleet.md)."""
        return placement_text(obj.nodes if isinstance(obj.nodes, list) else ())

    @admin.display(description="upstream", ordering="proxy")
    def upstream(self, obj: ModelDefinition) -> SafeString:
        """host:port, the whole URL on hover: the scheme and `${PORT}` templates made the
        column the widest on the page."""
        return format_html('<span title="{}">{}</span>', obj.proxy, url_host(obj.proxy))

    @admin.display(description="slots")
    def slots_short(self, obj: ModelDefinition) -> SafeString:
        """The number, where it came from on hover (and in full on the model's page): the
        reason is a sentence, and as a column it made the list too wide for a laptop."""
        slots = obj.slots
        return format_html('<span title="{}">{}</span>', slots.source, slots.parallel)

    @admin.display(description="concurrency", ordering="concurrency_limit")
    def concurrency(self, obj: ModelDefinition) -> str:
        return admin_defaults.concurrency(obj.concurrency_limit)

    @admin.display(description="slots")
    def slots(self, obj: ModelDefinition | None) -> str:
        """What the serial scheduler sends the upstream at once, and why: an empty `parallel`
        is read from cmd, and a wrong reading would idle slots or queue requests upstream,
        out of priority's reach, so the admin shows it next to the field."""
        if obj is None or obj.pk is None:
            return "read from cmd when saved, unless parallel is set"
        slots = obj.slots
        return f"{slots.parallel} · {slots.source}"

    @admin.display(description="ttl", ordering="ttl")
    def ttl_shown(self, obj: ModelDefinition) -> str:
        """What the system check (admin.E108) looks up; a list page shows
        `get_list_display`'s column, which reads the settings once per page."""
        return admin_defaults.ttl(obj.ttl, ProxySettings.load().global_ttl)

    @admin.display(description="live state")
    def live_state(self, obj: ModelDefinition | None) -> str | SafeString:
        if obj is None or obj.pk is None:
            return "—"
        return describe_live(obj, LiveView.read(), full=True)

    def render_change_form(self, request: HttpRequest, context, add=False, change=False,
                           form_url="", obj=None):
        context["live_note"] = MODEL_LIVE_NOTE
        return super().render_change_form(request, context, add, change, form_url, obj)

    @admin.action(description="Load selected models", permissions=["change"])
    def load_models(self, request: HttpRequest, queryset: QuerySet[ModelDefinition]) -> None:
        ids = []
        for obj in queryset.order_by("model_id"):
            if obj.enabled:
                ids.append(obj.model_id)
            else:
                messages.error(request, f"Model {obj.model_id} is disabled, so it cannot be "
                                        "loaded: enable it and save first.")
        if not ids:
            return
        try:
            futures = {control.load(model_id): model_id for model_id in ids}
        except control.ProxyNotRunning as exc:
            messages.error(request, str(exc))
            return
        concurrent.futures.wait(futures, timeout=ACTION_WAIT_SECONDS)
        started = []
        for future, model_id in futures.items():
            if not future.done():
                future.add_done_callback(_log_late_failure(f"loading {model_id}"))
                started.append(model_id)
            elif (error := future.exception()) is not None:
                messages.error(request, f"Model {model_id} could not be loaded: "
                                        f"{_failure(error)}")
            else:
                messages.success(request, f"Model {model_id} is ready.")
        if started:
            messages.info(request, f"Loading {', '.join(started)} started: it can take minutes; "
                                   "the live state column shows when it is ready.")

    @admin.action(description="Unload selected models", permissions=["change"])
    def unload_models(self, request: HttpRequest, queryset: QuerySet[ModelDefinition]) -> None:
        ids = list(queryset.order_by("model_id").values_list("model_id", flat=True))
        self._act(request, lambda: control.unload(ids), f"unloading {', '.join(ids)}",
                  done=f"Stopped {', '.join(ids)}.",
                  pending=f"Stopping {', '.join(ids)}: each gets its unload timeout to exit "
                          "cleanly; the live state column shows when it has.")

    @admin.action(description="Restart selected models when idle", permissions=["change"])
    def restart_models(self, request: HttpRequest, queryset: QuerySet[ModelDefinition]) -> None:
        ids = list(queryset.order_by("model_id").values_list("model_id", flat=True))
        message = (f"Restart requested for {', '.join(ids)}: a running model restarts as soon "
                   "as it is idle (requests in flight finish first); a stopped one starts with "
                   "its next request.")
        self._act(request, lambda: control.restart(ids), f"restarting {', '.join(ids)}",
                  done=message, pending=message)

    def _act(self, request: HttpRequest, submit: Callable[[], concurrent.futures.Future],
             what: str, *, done: str, pending: str) -> None:
        try:
            future = submit()
        except control.ProxyNotRunning as exc:
            messages.error(request, str(exc))
            return
        try:
            future.result(timeout=ACTION_WAIT_SECONDS)
        except concurrent.futures.TimeoutError:
            future.add_done_callback(_log_late_failure(what))
            messages.info(request, pending)
        except Exception as exc:
            logger.warning("admin: %s failed: %s", what, _failure(exc))
            messages.error(request, f"Failed {what}: {_failure(exc)}")
        else:
            messages.success(request, done)


class MemberInline(admin.TabularInline):
    model = ModelDefinition
    fields = ("model_id", "enabled")
    readonly_fields = ("model_id",)
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(ModelGroup)
class ModelGroupAdmin(ManagedBanner):
    list_display = ("group_id", "swap", "exclusive", "persistent")
    inlines = [MemberInline]
    managed_kind = "groups"

    def managed_name(self, obj: ModelGroup) -> str | None:
        return obj.group_id


@admin.register(ProxySettings)
class ProxySettingsAdmin(RoutingAdmin):
    """One change page: no add, no delete; the list redirects to the single row.

    The page shows what the scheduler values guarantee (scheduling/guarantees.py), rendered
    here and kept current as the admin types by scheduling/guarantees.js.
    """

    form = ProxySettingsForm
    readonly_fields = ("version", "defaults_in_force")
    fieldsets = (
        ("Scheduler", {"fields": ("scheduler", "aging_divisor", "swap_affinity_bonus",
                                  "affinity_budget")}),
        ("Models", {"fields": ("health_check_timeout", "global_ttl", "unload_timeout",
                               "start_port", "send_loading_state", "preload")}),
        ("Queue", {"fields": ("max_waiting", "max_waiting_interactive", "max_waiting_normal",
                              "max_waiting_batch", "queue_timeout"),
                   "description": "Bounds on waiting requests: beyond a cap, 429 queue_full; "
                                  "past its deadline, 503 queue_timeout. Under serial, a model "
                                  "without a concurrencyLimit of its own has no cap beyond "
                                  "these, so all of them can wait on one model; a model's "
                                  "explicit concurrencyLimit still applies (429 "
                                  "concurrency_limit), and fifo keeps llama-swap's 10 per "
                                  "model."}),
        ("Trusted priority", {"fields": ("priority_min", "priority_max", "priority_default"),
                              "description": "The range for keys without their own (each "
                                             "value a key leaves empty) and for requests "
                                             "without a key; all empty: unclamped."}),
        ROUTING_FIELDSET,
        ("Listing", {"fields": ("include_aliases_in_list",)}),
        ("Performance monitoring", {"fields": ("performance_monitoring",
                                               "performance_interval")}),
        ("Captures", {"fields": ("capture_buffer_mb",)}),
        ("Fleet", {"fields": ("importer_node",),
                   "description": "Several nodes on one database: which one imports its "
                                  "config file (docs/fleet.md, \"Shared definitions and "
                                  "placement\")."}),
        ("What 0 and empty mean now", {
            "fields": ("defaults_in_force",),
            "description": "The saved values above that stand for a default or for no "
                           "limit, and what each does with the values saved."}),
        ("Version", {"fields": ("version",),
                     "description": "Counts the saves; every save bumps it."}),
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    @admin.display(description="in force")
    def defaults_in_force(self, obj: ProxySettings | None) -> SafeString:
        lines = admin_defaults.settings_meanings(obj or ProxySettings.load())
        return format_html('<ul class="defaults-in-force" data-testid="defaults-in-force">{}'
                           "</ul>", format_html_join("", "<li>{}</li>", ((x,) for x in lines)))

    def changelist_view(self, request: HttpRequest, extra_context=None):
        obj = ProxySettings.load()
        return HttpResponseRedirect(
            reverse("admin:scheduling_proxysettings_change", args=[obj.pk]))

    def render_change_form(self, request: HttpRequest, context, add=False, change=False,
                           form_url="", obj=None):
        # the values being edited: what was typed when a POST is shown again with its errors,
        # the saved ones otherwise
        form = context["adminform"].form
        context["guarantees"] = guarantees(
            parse_number(str(form["aging_divisor"].value())),
            parse_number(str(form["swap_affinity_bonus"].value())),
            str(form["affinity_budget"].value() or ""))
        context["scheduler_value"] = form["scheduler"].value()
        context["live_note"] = SETTINGS_LIVE_NOTE
        return super().render_change_form(request, context, add, change, form_url, obj)


@admin.register(ApiKey)
class ApiKeyAdmin(ManagedBanner):
    """The key is generated on creation, shown once in a message, and stored hashed: no page
    can show it again, because nothing but its SHA-256 and first characters is kept."""

    list_display = ("name", "prefix", "admin", "trusted_peer", "priority_min", "priority_max",
                    "priority_default", "created_at")
    list_filter = ("admin", "trusted_peer")
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created_at")
    fields = ("name", "admin", "trusted_peer", "priority_min", "priority_max",
              "priority_default", "prefix", "created_at")
    managed_kind = "api_keys"

    def managed_name(self, obj: ApiKey) -> str | None:
        return obj.key_hash

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            key = ApiKey.generate()
            obj.set_key(key)
            super().save_model(request, obj, form, change)
            messages.warning(request, f"The new API key for {obj.name!r} is {key} — copy it "
                                      "now, it is stored hashed and cannot be shown again.")
        else:
            super().save_model(request, obj, form, change)


@admin.register(ConfigImport)
class ConfigImportAdmin(admin.ModelAdmin):
    """The last import, to see at a glance which file the database follows and when it was
    read; written only by an import (`import_config`, `serve -config`), never here."""

    list_display = ("source_path", "imported_at", "content_hash")
    fields = ("source_path", "files", "imported_at", "content_hash", "managed")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
