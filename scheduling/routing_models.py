"""llama-swap's routing beyond groups, in the database: the matrix's sets, peers, selectors
and profiles (`routing.router.settings.matrix.sets`, `peers`, `selectors`, `profiles`).

Split from scheduling/models.py, which keeps the models, groups, settings and keys; the
matrix's `vars` and `evict_costs` and the active profile are fields of `ProxySettings`.
Validation that needs the other tables (a set naming an unknown model, a selector target
that is not a model) is the importer's and the admin's, through `scheduling/routing_checks.py`.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import models

from scheduling.core.matrix import MatrixError, parse_dsl
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import PEER_TIMEOUTS, SELECTOR_STRATEGIES
from scheduling.llamaswap.peers import check_peer_url

ID_MAX = 255


def _names(value: Any) -> bool:
    """A JSON list of non-blank strings."""
    return isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)


class MatrixSet(models.Model):
    """`routing.router.settings.matrix.sets.<name>`: one named set expression (the DSL:
    `&`, `|`, parentheses, `+ref`). Order matters: ties in eviction cost go to the set
    defined first."""

    name = models.CharField(
        max_length=ID_MAX, unique=True,
        help_text="`sets.<name>`: the set's name, as `+name` references it.")
    dsl = models.TextField(
        "expression",
        help_text="Models that may run together: `a & b` (together), `a | b` (either), "
                  "parentheses, `+other` (another set's expression). Every set also allows "
                  "its subsets; names are model ids or matrix vars.")
    position = models.PositiveIntegerField(
        default=0, help_text="Definition order: the cheaper set wins, ties go to the lower "
                             "position.")

    class Meta:
        ordering = ["position", "name"]
        verbose_name = "matrix set"

    def __str__(self) -> str:
        return f"{self.name}: {self.dsl}"

    def clean(self) -> None:
        """The expression's syntax; the names in it are checked against the models with the
        other sets by scheduling/routing_checks.py."""
        if not self.name.strip():
            raise ValidationError({"name": "A set needs a name."})
        try:
            parse_dsl(self.dsl or "")
        except MatrixError as exc:
            raise ValidationError({"dsl": f"set {self.name!r}: {exc}"}) from None


class Peer(models.Model):
    """`peers.<id>`: another server (a llama-swap, a gpuproxy, vLLM, a hosted API) whose
    models are forwarded to, never scheduled or swapped here."""

    PRIORITY_FORWARD = [
        ("header", "X-LlamaSwap-Priority and X-LlamaSwap-Arrived headers (gpuproxy, llama-swap)"),
        ("vllm", "vLLM's `priority` body field (lower runs first)"),
        ("service_tier", "OpenAI's `service_tier` body field"),
        ("none", "nothing"),
    ]

    peer_id = models.CharField(
        "peer id", max_length=ID_MAX, unique=True,
        help_text="`peers.<id>`: its models are addressable as `<id>/<model>`.")
    proxy = models.CharField(
        max_length=500, help_text="`proxy`: the peer's base URL; the request path is "
                                  "appended to it.")
    api_key = models.CharField(
        "API key", max_length=500, blank=True,
        help_text="`apiKey`: sent to the peer as `Authorization: Bearer` and `x-api-key`, "
                  "replacing the client's; empty sends none.")
    models_list = models.JSONField(
        "models", default=list,
        help_text='`models`: the model names the peer serves, e.g. ["llama-3.1-8b"].')
    strip_params = models.CharField(
        max_length=500, blank=True,
        help_text="`filters.stripParams`: comma-separated body keys removed before forwarding.")
    set_params = models.JSONField(
        default=dict, blank=True,
        help_text="`filters.setParams`: body keys set before forwarding (never `model`).")
    timeouts = models.JSONField(
        default=dict, blank=True,
        help_text="`timeouts`: seconds for `connect`, `keepalive`, `responseHeader` (60 by "
                  "default for a peer), `tlsHandshake`, `idleConn`; 0 disables one.")
    priority_forward = models.CharField(
        max_length=16, choices=PRIORITY_FORWARD, default="header",
        help_text="`priorityForward` (gpuproxy): how the request's applied priority travels "
                  "to the peer.")

    class Meta:
        ordering = ["peer_id"]

    def __str__(self) -> str:
        return self.peer_id

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if not self.peer_id.strip():
            errors["peer_id"] = "A peer needs an id: its models are addressed as <id>/<model>."
        try:
            check_peer_url((self.proxy or "").strip(), "proxy")
        except ConfigError as exc:
            errors["proxy"] = exc.message
        if any(c.isspace() for c in self.api_key or ""):
            errors["api_key"] = "The key contains a space or line break."
        if not self.models_list or not _names(self.models_list):
            errors["models_list"] = ('List the model names the peer serves, e.g. '
                                     '["llama-3.1-8b"]; peer models can not be empty.')
        if not isinstance(self.set_params, dict):
            errors["set_params"] = 'A mapping of body keys to values, e.g. {"top_p": 0.9}.'
        elif "model" in self.set_params:
            errors["set_params"] = "`model` is protected: it is always the peer's model name."
        timeouts = self.timeouts
        if not isinstance(timeouts, dict) or any(
                k not in PEER_TIMEOUTS or isinstance(v, bool) or not isinstance(v, int) or v < 0
                for k, v in timeouts.items()):
            errors["timeouts"] = ("Whole seconds (0 disables one) for "
                                  f"{', '.join(PEER_TIMEOUTS)}, e.g. {{\"responseHeader\": 120}}.")
        if errors:
            raise ValidationError(errors)


class Selector(models.Model):
    """`selectors.<id>`: a virtual model name that picks one of its targets per request."""

    STRATEGIES = [("warm", "warm: the first ready target, else one starting, else the first"),
                  ("pin", "pin: always the first target"),
                  ("spillover", "spillover: fill each target to N requests, then the next")]

    selector_id = models.CharField(
        "selector id", max_length=ID_MAX, unique=True,
        help_text="`selectors.<id>`: the name clients send in `model`.")
    strategy = models.CharField(max_length=16, choices=STRATEGIES,
                                help_text="`strategy`: how a target is picked.")
    targets = models.JSONField(
        default=list, help_text='`targets`: model ids, aliases or peer models, in order, '
                                'e.g. ["big-coder", "small-coder"].')
    spillover = models.PositiveIntegerField(
        default=1, help_text="`settings.spillover`: requests per target before the next "
                             "one is used (spillover only; at least 1).")
    name = models.CharField(max_length=255, blank=True, help_text="`name`: for /v1/models.")
    description = models.TextField(blank=True, help_text="`description`: for /v1/models.")
    unlisted = models.BooleanField(default=False,
                                   help_text="`unlisted`: left out of /v1/models.")
    metadata = models.JSONField(default=dict, blank=True,
                                help_text="`metadata`: shown in /v1/models.")

    class Meta:
        ordering = ["selector_id"]

    def __str__(self) -> str:
        return self.selector_id

    def clean(self) -> None:
        """The selector on its own; what its targets name is scheduling/routing_checks.py's."""
        errors: dict[str, str] = {}
        if not self.selector_id.strip():
            errors["selector_id"] = "A selector needs an id: the name clients send."
        if self.strategy not in SELECTOR_STRATEGIES:
            errors["strategy"] = (f"Unknown strategy {self.strategy!r} (valid: "
                                  f"{', '.join(SELECTOR_STRATEGIES)}).")
        if not self.targets or not _names(self.targets):
            errors["targets"] = ('List at least one target (a model, alias or peer model), '
                                 'e.g. ["big-coder", "small-coder"].')
        if self.strategy == "spillover" and (self.spillover or 0) < 1:
            errors["spillover"] = "A spillover selector needs spillover >= 1."
        if not isinstance(self.metadata, dict):
            errors["metadata"] = 'A mapping, e.g. {"purpose": "coding"}.'
        if errors:
            raise ValidationError(errors)


class Profile(models.Model):
    """`profiles.<name>`: model names pinned to other targets while the profile is active
    (one at a time, `ProxySettings.active_profile`)."""

    name = models.CharField(max_length=ID_MAX, unique=True,
                            help_text="`profiles.<name>`.")
    description = models.TextField(blank=True, help_text="`description`.")
    pins = models.JSONField(
        default=dict, blank=True,
        help_text='`pins`: requested name → target (a model, alias, peer model or selector); '
                  'null or "" disables the name (404), e.g. {"llm-code": "big-coder"}.')

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if not self.name.strip():
            raise ValidationError({"name": "A profile needs a name."})
        pins = self.pins
        if not isinstance(pins, dict) or not pins:
            raise ValidationError({"pins": 'At least one pin: requested name → target, e.g. '
                                           '{"llm-code": "big-coder"}; null disables a name.'})
        for name, target in pins.items():
            if not name.strip() or not (target is None or isinstance(target, str)):
                raise ValidationError({"pins": f"Pin {name!r}: names must not be blank, and a "
                                               "target is a name, \"\" or null."})
