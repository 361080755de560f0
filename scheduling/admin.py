"""Admin for model definitions, groups, the settings singleton and API keys.

The live-apply machinery and the guarantees panel arrive with the admin issue; these pages
already validate with the same `clean()` rules as `import_config`.
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse

from scheduling.models import ApiKey, ModelDefinition, ModelGroup, ProxySettings


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(admin.ModelAdmin):
    list_display = ("model_id", "name", "enabled", "group", "proxy", "ttl", "concurrency_limit",
                    "parallel")
    list_filter = ("enabled", "group")
    search_fields = ("model_id", "name", "description")
    list_select_related = ("group",)
    fieldsets = (
        (None, {"fields": ("model_id", "enabled", "name", "description", "group", "aliases",
                           "unlisted")}),
        ("Process", {"fields": ("cmd", "cmd_stop", "env", "proxy", "port", "check_endpoint",
                                "ttl", "unload_timeout")}),
        ("Requests", {"fields": ("concurrency_limit", "parallel", "use_model_name",
                                 "strip_params", "set_params", "set_params_by_id",
                                 "send_loading_state", "fifo_priority")}),
        ("Listing", {"fields": ("metadata", "capabilities"), "classes": ("collapse",)}),
    )


class MemberInline(admin.TabularInline):
    model = ModelDefinition
    fields = ("model_id", "enabled")
    readonly_fields = ("model_id",)
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(ModelGroup)
class ModelGroupAdmin(admin.ModelAdmin):
    list_display = ("group_id", "swap", "exclusive", "persistent")
    inlines = [MemberInline]


@admin.register(ProxySettings)
class ProxySettingsAdmin(admin.ModelAdmin):
    """One change page: no add, no delete; the list redirects to the single row."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context=None):
        obj = ProxySettings.load()
        return HttpResponseRedirect(
            reverse("admin:scheduling_proxysettings_change", args=[obj.pk]))


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """The key is generated on creation, shown once in a message, and stored hashed."""

    list_display = ("name", "prefix", "created_at")
    readonly_fields = ("prefix", "created_at")
    fields = ("name", "prefix", "created_at")

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            key = ApiKey.generate()
            obj.set_key(key)
            super().save_model(request, obj, form, change)
            messages.warning(request, f"The new API key for {obj.name!r} is {key} — copy it "
                                      "now, it is stored hashed and cannot be shown again.")
        else:
            super().save_model(request, obj, form, change)
