"""Admin for llama-swap's routing beyond groups: matrix sets, peers, selectors, profiles, and the
routing fields of the settings page; the "Managed by FILE" banner every change page shares.

Every form runs the importer's rules across tables (scheduling/routing_checks.py) with its row
in place of the saved one, so the admin refuses what an import refuses, in the same words. A
matrix set is checked as it is typed: the change page's script (scheduling/matrix_check.js)
posts the expression to `check_view`, which answers scheduling/matrix_check.py's verdict; the
form runs the same check on save. A peer's API key is a secret the admin can replace but never
read back: the page has a "leave blank to keep" password field and the lists say only whether
one is set. Saves reach a running proxy through the scheduling signals, like every other table.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponseRedirect, JsonResponse
from django.urls import path, reverse
from django.utils.html import escape

from scheduling import routing_checks
from scheduling.catalog import url_host
from scheduling.llamaswap.errors import ConfigError
from scheduling.matrix_check import check_set, json_types
from scheduling.models import ConfigImport, ModelDefinition, ProxySettings
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector


def managed_by(kind: str, name: str | None) -> str | None:
    """The config file that defines this row, if the last import's did: the admin says so,
    since the next import of a changed file puts the file's values back (`kind` is a key of
    ConfigImport.managed; `name` None for the settings, which every file defines)."""
    last = ConfigImport.last()
    if last is None:
        return None
    if name is not None and name not in last.managed.get(kind, []):
        return None
    return last.source_path


class ManagedBanner(admin.ModelAdmin):
    """Adds `managed_by` to the change page (templates/admin/scheduling/managed_banner.html).
    Help texts are text: they write llama-swap's keys as `peers.<id>`, which HTML swallows."""

    managed_kind = ""

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if field is not None and field.help_text:
            field.help_text = escape(field.help_text)
        return field

    def managed_name(self, obj) -> str | None:
        return None

    def render_change_form(self, request: HttpRequest, context, add=False, change=False,
                           form_url="", obj=None):
        if obj is not None and obj.pk is not None:
            context["managed_by"] = managed_by(self.managed_kind, self.managed_name(obj))
        return super().render_change_form(request, context, add, change, form_url, obj)


class RoutingChecked:
    """A form whose row the routing rules span (scheduling/routing_checks.py): once the row
    is built and valid on its own, the rules run on the database with it in place, as the
    importer runs them on a file. Their warnings (a name matching nothing yet) are kept for
    `RoutingAdmin` to show after the save."""

    routing_warnings: list[str]
    #: the row's name field (a rename replaces the old row in the check); "" for settings
    KEY = ""
    #: the form field a rule's key path points at: its segment (brackets dropped) -> field
    FIELD_OF: dict[str, str] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.routing_warnings = []
        instance = self.instance  # type: ignore[attr-defined]
        self.original_key: str | None = (getattr(instance, self.KEY)
                                         if self.KEY and instance.pk else None)

    def routing_field(self, exc: ConfigError) -> str | None:
        for segment in reversed(exc.path.split(".")):
            field = self.FIELD_OF.get(segment.split("[")[0])
            if field is not None:
                return field
        return None

    def _post_clean(self) -> None:
        super()._post_clean()  # type: ignore[misc]
        if self.errors:  # type: ignore[attr-defined]
            return
        try:
            self.routing_warnings = routing_checks.check_candidate(
                self.instance, original_key=self.original_key)  # type: ignore[attr-defined]
        except ConfigError as exc:
            field = self.routing_field(exc)
            message = exc.message if field else f"{exc.path}: {exc.message}"
            self.add_error(field, message)  # type: ignore[attr-defined]


class RoutingAdmin(ManagedBanner):
    """Shows a `RoutingChecked` form's warnings once the row is saved."""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        for warning in getattr(form, "routing_warnings", ()):
            messages.warning(request, warning)


def routing_without(kind: str, names: set[str]) -> str:
    """What deleting these matrix sets ("matrix_sets") or models ("models") would break in
    the routing, in the importer's words; "" when nothing (or when it was broken before)."""
    view = routing_checks.database_view()
    if kind == "matrix_sets":
        after = replace(view, matrix_sets=tuple(
            (n, d) for n, d in view.matrix_sets if n not in names))
    else:
        after = replace(view, models=view.models - names,
                        aliases={a: m for a, m in view.aliases.items() if m not in names})
    try:
        _check_all(view)
    except ConfigError:
        return ""
    try:
        _check_all(after)
    except ConfigError as exc:
        return f"{exc.path}: {exc.message}"
    return ""


def _check_all(view: routing_checks.RoutingView) -> None:
    """The rules, with the sets compiled under the group router too (as a set's own check
    does), so a switch to the matrix is never blocked by a delete made before it."""
    routing_checks.check(view)
    if view.router != "matrix" and view.matrix_sets:
        routing_checks.compile_matrix(replace(view, router="matrix"))


class DeleteGuard:
    """A delete that would leave the routing broken (a set another references, the last set
    of the matrix router, a model a set names) is refused, saying what to change first; the
    running proxy would otherwise drop its matrix and run every model alone."""

    guard_kind = ""  # "matrix_sets" | "models"

    def guard_names(self, objs: Any) -> set[str]:
        raise NotImplementedError

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None):
        obj = self.get_object(request, object_id)  # type: ignore[attr-defined]
        if obj is not None and (why := routing_without(self.guard_kind,
                                                      self.guard_names([obj]))):
            messages.error(request, f"{obj} was not deleted: without it, {why}. Change that "
                                    "first.")
            opts = obj._meta
            return HttpResponseRedirect(reverse(
                f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk]))
        return super().delete_view(request, object_id, extra_context)  # type: ignore[misc]

    def get_deleted_objects(self, objs: Any, request: HttpRequest):
        deleted, count, perms, protected = super().get_deleted_objects(  # type: ignore[misc]
            objs, request)
        if why := routing_without(self.guard_kind, self.guard_names(objs)):
            protected = [*protected, f"the routing: without them, {why}"]
        return deleted, count, perms, protected


class ModelDefinitionForm(forms.ModelForm):
    """Renaming a model a matrix set names would leave the set naming nothing: refused, as a
    delete is (`DeleteGuard`). Disabling it is not: the matrix compiles against every defined
    model, disabled ones too (Catalog.matrix_models)."""

    class Meta:
        model = ModelDefinition
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        saved_id = None if self.instance.pk is None else ModelDefinition.objects.filter(
            pk=self.instance.pk).values_list("model_id", flat=True).first()
        if saved_id is None or data.get("model_id", saved_id) == saved_id:
            return data
        if why := routing_without("models", {saved_id}):
            self.add_error("model_id", f"Without the id {saved_id}, {why}. Change that first.")
        return data


# ---- matrix sets -----------------------------------------------------------------------------

class MatrixSetForm(forms.ModelForm):
    class Meta:
        model = MatrixSet
        fields = ("name", "dsl", "position")
        widgets = {"dsl": forms.Textarea(attrs={"rows": 2, "cols": 80, "spellcheck": "false",
                                                "autocomplete": "off"})}

    def _post_clean(self) -> None:
        """After the model's own clean() (the syntax), the check the page ran as it was
        typed, on the set as it would be saved."""
        super()._post_clean()  # type: ignore[misc]
        if self.errors:
            return
        obj = self.instance
        result = check_set(obj.name, obj.dsl, obj.position or 0, obj.pk)
        if result.error:
            self.add_error("dsl", result.error)


@admin.register(MatrixSet)
class MatrixSetAdmin(DeleteGuard, RoutingAdmin):
    form = MatrixSetForm
    guard_kind = "matrix_sets"
    list_display = ("name", "position", "dsl")
    list_editable = ("position",)
    ordering = ("position", "name")
    search_fields = ("name", "dsl")
    managed_kind = "matrix_sets"

    def managed_name(self, obj: MatrixSet) -> str | None:
        return obj.name

    def guard_names(self, objs: Any) -> set[str]:
        return {o.name for o in objs}

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """A new set goes last: ties in eviction cost go to the sets defined before it."""
        initial: dict[str, Any] = dict(super().get_changeform_initial_data(request))
        last = MatrixSet.objects.order_by("-position").values_list("position", flat=True).first()
        initial.setdefault("position", 0 if last is None else last + 1)
        return initial

    def get_urls(self):
        check = path("check/", self.admin_site.admin_view(self.check_view),
                     name="scheduling_matrixset_check")
        return [check, *super().get_urls()]

    def check_view(self, request: HttpRequest) -> JsonResponse:
        """The as-you-type check: POST name, dsl, position, pk (the set being changed)."""
        if request.method != "POST":
            return JsonResponse(_error("POST the expression as form fields: name, dsl, "
                                       "position, pk", "method_not_allowed"), status=405)
        if not (self.has_add_permission(request) or self.has_change_permission(request)):
            return JsonResponse(_error("checking a matrix set needs the permission to add or "
                                       "change matrix sets", "permission_denied"), status=403)
        try:
            position = int(request.POST.get("position") or 0)
            pk = int(request.POST["pk"]) if request.POST.get("pk") else None
        except ValueError:
            return JsonResponse(_error("position and pk must be whole numbers",
                                       "invalid_value"), status=400)
        result = check_set(request.POST.get("name", ""), request.POST.get("dsl", ""),
                           position, pk)
        return JsonResponse(result.as_json())

    def render_change_form(self, request: HttpRequest, context, add=False, change=False,
                           form_url="", obj=None):
        context["check_url"] = reverse("admin:scheduling_matrixset_check")
        form = context["adminform"].form
        if obj is not None and not form.is_bound:
            context["set_check"] = check_set(obj.name, obj.dsl, obj.position, obj.pk)
        return super().render_change_form(request, context, add, change, form_url, obj)


def _error(message: str, code: str) -> dict[str, Any]:
    """The OpenAI-style error shape gpuproxy answers everywhere (gpuproxy/proxy/errors.py,
    which this layer may not import)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": code}}


# ---- peers -----------------------------------------------------------------------------------

KEY_SET = "set (hidden)"
KEY_NONE = "none"


class PeerForm(RoutingChecked, forms.ModelForm):
    """The key is write-only: the field is always empty on the page; blank keeps the saved key
    and `clear_api_key` removes it."""

    api_key = forms.CharField(
        label="API key", required=False, strip=True,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="`apiKey`: sent to the peer as `Authorization: Bearer` and `x-api-key` in "
                  "place of the client's. Leave blank to keep the saved key; it is never "
                  "shown again.")
    clear_api_key = forms.BooleanField(
        label="remove the saved API key", required=False,
        help_text="Send no key to the peer from now on.")

    KEY = "peer_id"
    FIELD_OF = {"models": "models_list", "proxy": "proxy"}

    class Meta:
        model = Peer
        fields = ("peer_id", "proxy", "api_key", "clear_api_key", "models_list",
                  "priority_forward", "strip_params", "set_params", "timeouts")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saved_key = self.instance.api_key if self.instance.pk else ""
        self.initial["api_key"] = ""
        if self.saved_key:
            self.fields["api_key"].widget.attrs["placeholder"] = "a key is saved; blank keeps it"

    def clean_api_key(self) -> str:
        typed = self.cleaned_data.get("api_key") or ""
        if any(c.isspace() for c in typed):
            raise ValidationError("An API key contains no spaces.")
        return typed

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if data.get("clear_api_key"):
            if data.get("api_key"):
                raise ValidationError({"clear_api_key": "Type a new key or remove the saved "
                                                        "one, not both."})
            data["api_key"] = ""
        elif not data.get("api_key"):
            data["api_key"] = self.saved_key  # what the instance is saved with
        models = data.get("models_list")
        if "models_list" in data and not (isinstance(models, list) and models and all(
                isinstance(m, str) and m for m in models)):
            self.add_error("models_list", 'models must be a non-empty list of model names, '
                                          'e.g. ["llama-3.1-8b"]')
        return data


@admin.register(Peer)
class PeerAdmin(RoutingAdmin):
    form = PeerForm
    list_display = ("peer_id", "host", "models_shown", "priority_forward", "key_state")
    search_fields = ("peer_id",)
    managed_kind = "peers"
    fieldsets = (
        (None, {"fields": ("peer_id", "proxy", "models_list", "priority_forward")}),
        ("API key", {"fields": ("api_key", "clear_api_key")}),
        ("Filters and timeouts", {"fields": ("strip_params", "set_params", "timeouts")}),
    )

    def managed_name(self, obj: Peer) -> str | None:
        return obj.peer_id

    def get_fieldsets(self, request: HttpRequest, obj: Peer | None = None) -> Any:
        """Staff who may only view get the key's state, never the key: Django would show a
        read-only `api_key` with the model's own value."""
        if obj is not None and not self.has_change_permission(request, obj):
            return ((None, {"fields": ("peer_id", "proxy", "models_list",
                                       "priority_forward")}),
                    ("API key", {"fields": ("key_state",)}),
                    ("Filters and timeouts", {"fields": ("strip_params", "set_params",
                                                         "timeouts")}))
        return super().get_fieldsets(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: Peer | None = None) -> Any:
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is not None and not self.has_change_permission(request, obj):
            fields += ("key_state",)
        return fields

    @admin.display(description="host")
    def host(self, obj: Peer) -> str:
        return url_host(obj.proxy)

    @admin.display(description="models")
    def models_shown(self, obj: Peer) -> str:
        return ", ".join(map(str, obj.models_list or []))

    @admin.display(description="API key")
    def key_state(self, obj: Peer) -> str:
        return KEY_SET if obj.api_key else KEY_NONE


# ---- selectors and profiles ------------------------------------------------------------------

class SelectorForm(RoutingChecked, forms.ModelForm):
    KEY = "selector_id"
    FIELD_OF = {"targets": "targets", "spillover": "spillover"}

    class Meta:
        model = Selector
        fields = "__all__"


class ProfileForm(RoutingChecked, forms.ModelForm):
    KEY = "name"
    FIELD_OF = {"pins": "pins"}

    class Meta:
        model = Profile
        fields = "__all__"


@admin.register(Selector)
class SelectorAdmin(RoutingAdmin):
    form = SelectorForm
    list_display = ("selector_id", "strategy", "targets_shown", "spillover", "unlisted")
    list_filter = ("strategy", "unlisted")
    search_fields = ("selector_id", "name", "description")
    managed_kind = "selectors"
    fieldsets = (
        (None, {"fields": ("selector_id", "strategy", "targets", "spillover")}),
        ("Listing", {"fields": ("name", "description", "unlisted", "metadata")}),
    )

    def managed_name(self, obj: Selector) -> str | None:
        return obj.selector_id

    @admin.display(description="targets")
    def targets_shown(self, obj: Selector) -> str:
        return " → ".join(map(str, obj.targets or []))


@admin.register(Profile)
class ProfileAdmin(RoutingAdmin):
    form = ProfileForm
    list_display = ("name", "active", "description", "pins_shown")
    search_fields = ("name", "description")
    managed_kind = "profiles"
    actions = ("activate", "deactivate")

    def managed_name(self, obj: Profile) -> str | None:
        return obj.name

    @admin.display(description="active", boolean=True)
    def active(self, obj: Profile) -> bool:
        return obj.name == ProxySettings.load().active_profile

    @admin.display(description="pins")
    def pins_shown(self, obj: Profile) -> str:
        pins = obj.pins if isinstance(obj.pins, dict) else {}
        return ", ".join(f"{k} → {v or '(disabled)'}" for k, v in pins.items())

    @admin.action(description="Make the selected profile the active one",
                  permissions=["change"])
    def activate(self, request: HttpRequest, queryset: QuerySet[Profile]) -> None:
        """The settings page's active profile, from the list (one profile at a time)."""
        names = list(queryset.values_list("name", flat=True))
        if len(names) != 1:
            messages.error(request, f"Select one profile to make active, not {len(names)}: "
                                    "one profile is active at a time.")
            return
        self._set_active(request, names[0])

    @admin.action(description="Deactivate profiles (no pins apply)", permissions=["change"])
    def deactivate(self, request: HttpRequest, queryset: QuerySet[Profile]) -> None:
        self._set_active(request, "")

    def _set_active(self, request: HttpRequest, name: str) -> None:
        ProxySettings.set_active_profile(name)  # the running proxy routes by it at once
        messages.success(request, f"Profile {name} is active: its pins apply to the next "
                                  "request." if name else "No profile is active now.")

    def save_model(self, request: HttpRequest, obj: Profile, form, change: bool) -> None:
        """A rename of the active profile keeps it active (the setting names it)."""
        old = Profile.objects.filter(pk=obj.pk).values_list("name", flat=True).first()
        super().save_model(request, obj, form, change)
        if change and old and old != obj.name:
            ProxySettings.set_active_profile(obj.name, only_if=old)


# ---- the settings page's routing fields ------------------------------------------------------

ROUTING_FIELDSET: Any = ("Routing", {  # a fieldset of ProxySettingsAdmin's
    "fields": ("router", "matrix_vars", "matrix_evict_costs", "active_profile"),
    "description": "The router decides which models stop before another loads. The matrix's "
                   "sets are edited under Matrix sets; the active profile's pins apply to "
                   "every request at once."})


class ProxySettingsForm(RoutingChecked, forms.ModelForm):
    """`active_profile` is a choice of the defined profiles; switching to the matrix router
    compiles the matrix first, so the proxy never runs one that does not."""

    active_profile = forms.ChoiceField(
        required=False, label="active profile",
        help_text="The profile whose pins apply (also `PUT /api/profiles/active`).")

    class Meta:
        model = ProxySettings
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choices = [("", "none")]
        choices += [(name, f"{name}: {description}" if description else name)
                    for name, description in Profile.objects.values_list("name", "description")]
        saved = self.instance.active_profile if self.instance.pk else ""
        if saved and saved not in {value for value, _ in choices}:
            choices.append((saved, f"{saved} (not defined: no pins apply)"))
        field = self.fields["active_profile"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = choices

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if {"matrix_vars", "matrix_evict_costs"} <= data.keys() and (
                wrong := json_types(data["matrix_vars"] or {}, data["matrix_evict_costs"] or {})):
            self.add_error("matrix_vars" if "vars" in wrong else "matrix_evict_costs", wrong)
        return data

    def routing_field(self, exc: ConfigError) -> str | None:
        if exc.path.startswith(routing_checks.MATRIX_PATH):
            if "var key" in exc.message:
                return "matrix_vars"
            return "matrix_evict_costs" if "evict_cost" in exc.message else "router"
        return None

