"""llama-swap's routing beyond groups, in the database: the matrix's sets, peers, selectors
and profiles (`routing.router.settings.matrix.sets`, `peers`, `selectors`, `profiles`).

Split from scheduling/models.py, which keeps the models, groups, settings and keys; the
matrix's `vars` and `evict_costs` and the active profile are fields of `ProxySettings`.
Validation that needs the other tables (a set naming an unknown model, a selector target
that is not a model) is the importer's and the admin's, through `scheduling/routing_checks.py`.
"""

from __future__ import annotations

from django.db import models

ID_MAX = 255


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
