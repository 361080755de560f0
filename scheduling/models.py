"""Model definitions, groups, proxy settings and API keys: the database form of a llama-swap config.

Validation lives in `clean()` so that the admin and `import_config` refuse the same things with
the same words. Field names follow Django style; each help text names the llama-swap key.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets

from django.core.exceptions import ValidationError
from django.db import models, transaction

from scheduling import affinity_budget
from scheduling.config_import import ConfigImport
from scheduling.nodes import ADMIN_ONLY, bad_node_name, placement_errors
from scheduling.priority_range import PriorityRange
from scheduling.routing_models import MatrixSet, Peer, Profile, Selector
from scheduling.slots import Slots, resolve_parallel
from scheduling.spec import UpstreamSpec, split_command

MODEL_ID_MAX = 255
DEFAULT_CONCURRENCY_LIMIT = 10
MIN_HEALTH_CHECK_TIMEOUT = 15
MAX_SWAP_AFFINITY_BONUS = 99
MIN_PERFORMANCE_INTERVAL = 1.0
DEFAULT_MAX_WAITING = 20_000
_ENV_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# defined in scheduling/routing_models.py and scheduling/config_import.py
__all__ = ["ConfigImport", "MatrixSet", "Peer", "Profile", "Selector"]


class ModelGroup(models.Model):
    """llama-swap `groups.<id>`: which models may run together.

    Models in no group form one implicit swap+exclusive group: one model at a time.
    """

    group_id = models.CharField(
        "group id", max_length=MODEL_ID_MAX, unique=True,
        help_text="`groups.<id>`: the group's name. `(default)` is reserved for the models in "
                  "no group.")
    swap = models.BooleanField(
        default=True, help_text="`swap`: only one member of this group runs at a time.")
    exclusive = models.BooleanField(
        default=True,
        help_text="`exclusive`: loading a member unloads the models of other (non-persistent) "
                  "groups.")
    persistent = models.BooleanField(
        default=False, help_text="`persistent`: other groups can never unload these members.")

    class Meta:
        ordering = ["group_id"]

    def __str__(self) -> str:
        return self.group_id


class ModelDefinition(models.Model):
    """llama-swap `models.<id>`: one upstream server and how requests reach it."""

    model_id = models.CharField("model id", max_length=MODEL_ID_MAX, unique=True,
                                help_text="`models.<id>`: the id clients send in `model`.")
    enabled = models.BooleanField(
        default=True,
        help_text="`enabled` (gpuproxy): off keeps the definition but never loads the model: "
                  "it is unloaded when idle and requests for it get 404.")
    name = models.CharField(max_length=255, blank=True,
                            help_text="`name`: a display name, shown in /v1/models.")
    description = models.TextField(blank=True,
                                   help_text="`description`: shown in /v1/models.")
    cmd = models.TextField(
        help_text="`cmd`: the command line, split like a shell would (never run by one). "
                  "Multi-line allowed; `#` lines are comments. `${PORT}` and `${MODEL_ID}` are "
                  "filled in at start.")
    cmd_stop = models.TextField(
        "cmd stop", blank=True,
        help_text="`cmdStop`: graceful stop command, `${PID}` allowed; empty = SIGTERM to the "
                  "process group.")
    proxy = models.CharField(
        max_length=500,
        help_text="`proxy`: the upstream server's base URL, where requests are sent, e.g. "
                  "http://127.0.0.1:5800 (llama-swap's default is http://localhost:${PORT}).")
    port = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="The port `${PORT}` stands for: allocated from `startPort` by import, "
                  "written into cmd and proxy. Empty while cmd or proxy still says `${PORT}` "
                  "= the proxy hands one out from `startPort`.")
    check_endpoint = models.CharField(
        max_length=500, default="/health",
        help_text="`checkEndpoint`: path that answers 200 when ready; `none` = ready at once.")
    ttl = models.IntegerField(
        default=-1, help_text="`ttl`: idle seconds before unload; -1 = global TTL; 0 = never.")
    unload_timeout = models.IntegerField(
        default=0, help_text="`unloadTimeout`: seconds between SIGTERM and SIGKILL on unload; "
                             "0 = the global value.")
    aliases = models.JSONField(
        default=list, blank=True,
        help_text='`aliases`: other names clients may send, a JSON list such as ["coder"]; '
                  "each unique across all models and never another model's id.")
    env = models.JSONField(
        default=list, blank=True,
        help_text='`env`: environment of the process, a JSON list of "NAME=value" strings, '
                  'e.g. ["CUDA_VISIBLE_DEVICES=0"].')
    unlisted = models.BooleanField(
        default=False, help_text="`unlisted`: hidden from /v1/models, still requestable.")
    use_model_name = models.CharField(
        max_length=255, blank=True,
        help_text="`useModelName`: the `model` value sent upstream instead of the id.")
    concurrency_limit = models.PositiveIntegerField(
        default=0,
        help_text="`concurrencyLimit`: requests admitted at once (queued + served); more get "
                  "429. 0 = not set: under serial no cap of its own (the queue caps in the "
                  f"proxy settings bound it); under fifo llama-swap's {DEFAULT_CONCURRENCY_LIMIT}.")
    parallel = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="`parallel` (gpuproxy): requests the upstream serves at once (its slots); "
                  "the rest wait in the proxy, where priority orders them. Empty = read from "
                  "cmd: llama-server's -np (without it, llama-server's auto: 4 slots), vLLM's "
                  "--max-num-seqs, SGLang's --max-running-requests, else 1; \"slots\" shows "
                  "the number and where it came from. At least 1 when set.")
    strip_params = models.CharField(
        max_length=1000, blank=True,
        help_text="`filters.stripParams`: comma-separated request keys removed before the "
                  "request is sent upstream, e.g. temperature, top_p (`model` is never removed).")
    set_params = models.JSONField(
        default=dict, blank=True,
        help_text='`filters.setParams`: a JSON object of keys forced into every request, e.g. '
                  '{"temperature": 0.2} (`model` is protected).')
    set_params_by_id = models.JSONField(
        default=dict, blank=True,
        help_text="`filters.setParamsByID`: a JSON object {requested id: params}; a request "
                  "for that id gets those params, and each id is also an alias of this model.")
    metadata = models.JSONField(
        default=dict, blank=True,
        help_text="`metadata`: any JSON object, shown under meta.llamaswap in /v1/models.")
    capabilities = models.JSONField(
        default=dict, blank=True,
        help_text="`capabilities`: what the model can do, a JSON object: `in`/`out` (text, "
                  "audio, image), `tools`, `reranker`, `context`.")
    send_loading_state = models.BooleanField(
        null=True, blank=True,
        help_text="`sendLoadingState`: stream loading progress; empty = the global setting.")
    stream_idle_timeout = models.PositiveIntegerField(
        default=600,
        help_text="`streamIdleTimeout` (gpuproxy extension): seconds without a byte from the "
                  "upstream, before the first token or mid-stream, after which the request "
                  "ends with an error (outcome upstream_died) and its slot is freed. Generous "
                  "by default: a long prompt on a slow GPU can take minutes to the first "
                  "token.")
    vllm_priority = models.BooleanField(
        "vLLM priority", default=False,
        help_text="`vllmPriority` (gpuproxy extension): the upstream is vLLM started with "
                  "`--scheduling-policy priority`; each request's priority is forwarded in "
                  "vLLM's `priority` body field (negated: lower is served first there) so the "
                  "engine orders parallel work the way the scheduler does. A `priority` the "
                  "client sent itself is kept.")
    nodes = models.JSONField(
        default=list, blank=True,
        help_text='`nodes` (gpuproxy extension): the fleet\'s nodes that run this model, by '
                  'their GPUPROXY_NODE names, a JSON list such as ["gpu-a", "gpu-b"]; empty = '
                  "every node. Other nodes never start it; they list it and name these nodes.")
    fifo_priority = models.IntegerField(
        default=0, help_text="`routing.scheduler.settings.fifo.priority`: higher is served "
                             "first while queued (fifo scheduler).")
    group = models.ForeignKey(ModelGroup, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="members",
                              help_text="`groups.<id>.members`: which group it runs in; "
                                        "empty = the implicit (default) group, one model at a "
                                        "time.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_id"]

    def __str__(self) -> str:
        return self.model_id

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if not self.model_id or self.model_id != self.model_id.strip():
            errors["model_id"] = "The model id must be non-empty, without surrounding spaces."
        try:
            split_command(self.cmd.replace("${PORT}", "0").replace("${MODEL_ID}", "m"))
        except ValueError as exc:
            errors["cmd"] = f"The command cannot be used: {exc}."
        if "${PID}" in self.cmd:
            errors["cmd"] = "`${PID}` is only allowed in cmd stop."
        if not self.proxy.startswith(("http://", "https://")):
            errors["proxy"] = "The proxy must be an http:// or https:// URL."
        if self.ttl < -1:
            errors["ttl"] = "The ttl must be -1 (global), 0 (never) or a number of seconds."
        if self.unload_timeout < 0:
            errors["unload_timeout"] = "The unload timeout cannot be negative."
        if self.parallel is not None and self.parallel < 1:
            errors["parallel"] = ("parallel must be at least 1 (0 would refuse every request); "
                                  "leave it empty to read it from cmd.")
        if not isinstance(self.aliases, list) or not all(
                isinstance(a, str) and a.strip() for a in self.aliases):
            errors["aliases"] = "Aliases must be a list of non-empty strings."
        if not isinstance(self.env, list) or not all(
                isinstance(e, str) and _ENV_ENTRY.match(e) for e in self.env):
            errors["env"] = 'env must be a list of "NAME=value" strings.'
        for name in ("set_params", "set_params_by_id", "metadata", "capabilities"):
            if not isinstance(getattr(self, name), dict):
                errors[name] = "Must be a JSON object."
        if (why := placement_errors(self.nodes)) is not None:
            errors["nodes"] = why[0].upper() + why[1:] + "."
        if errors:
            raise ValidationError(errors)
        self._clean_aliases_unique()

    def _clean_aliases_unique(self) -> None:
        """An alias may name only one model, and may not shadow a model id."""
        mine = set(self.aliases) | set(self.set_params_by_id or {})
        if self.model_id in mine:
            mine.discard(self.model_id)
        others = ModelDefinition.objects.exclude(pk=self.pk)
        clash = others.filter(model_id__in=mine).values_list("model_id", flat=True).first()
        if clash:
            raise ValidationError({"aliases": f"Alias {clash!r} is already a model id."})
        for other in others.only("model_id", "aliases", "set_params_by_id"):
            theirs = set(other.aliases) | set(other.set_params_by_id or {}) | {other.model_id}
            if self.model_id in theirs:
                raise ValidationError({"model_id": f"{self.model_id!r} is already an alias of "
                                                   f"model {other.model_id!r}."})
            dup = mine & theirs
            if dup:
                raise ValidationError({"aliases": f"Alias {sorted(dup)[0]!r} is already used by "
                                                  f"model {other.model_id!r}."})

    @property
    def slots(self) -> Slots:
        """The requests its upstream serves at once, and where that number comes from: the
        `parallel` written here, else the command (scheduling/slots.py). Read on every use, so
        an edited cmd is followed without anyone copying a number."""
        env = self.env if isinstance(self.env, list) else []
        return resolve_parallel(self.parallel, self.cmd, [e for e in env if isinstance(e, str)])

    def env_dict(self) -> dict[str, str]:
        return dict(entry.split("=", 1) for entry in self.env)

    def to_upstream_spec(self, settings: ProxySettings, port: int | None = None) -> UpstreamSpec:
        """Resolve this definition against the global settings into what the process needs.

        `port` fills a `${PORT}` left in the command (models added in admin); imported
        models already carry their allocated port in cmd and proxy.
        """
        port = port if port is not None else self.port

        def fill(text: str) -> str:
            text = text.replace("${MODEL_ID}", self.model_id)
            if port is not None:
                text = text.replace("${PORT}", str(port))
            return text

        ttl = settings.global_ttl if self.ttl == -1 else self.ttl
        return UpstreamSpec(
            model_id=self.model_id,
            cmd=fill(self.cmd),
            cmd_stop=fill(self.cmd_stop),
            proxy=fill(self.proxy),
            check_endpoint=self.check_endpoint,
            env=self.env_dict(),
            ttl=float(max(ttl, 0)),
            unload_timeout=float(self.unload_timeout or settings.unload_timeout),
            health_check_timeout=float(settings.health_check_timeout),
        )


class ProxySettings(PriorityRange):
    """The one row of global settings (pk=1), edited live in admin; `version` bumps on save."""

    SCHEDULERS = [("serial", "serial (priority + swap affinity + aging)"),
                  ("fifo", "fifo (llama-swap's first-come-first-served)")]

    scheduler = models.CharField(
        max_length=16, choices=SCHEDULERS, default="serial",
        help_text="`routing.scheduler.use`: serial (the default) orders requests by "
                  "priority, swap affinity and aging; fifo is llama-swap's own scheduler.")
    aging_divisor = models.FloatField(
        default=60.0,
        help_text="`routing.scheduler.settings.serial.agingDivisor`: seconds of waiting per "
                  "point of score, any number > 0 (0.5 is fine; default 60). Every time in "
                  "the guarantees scales with it.")
    swap_affinity_bonus = models.PositiveIntegerField(
        default=10,
        help_text="`routing.scheduler.settings.serial.swapAffinityBonus`: score bonus for the "
                  "loaded model, saving swaps; 0..99 so it never lifts a request into the next "
                  "band (default 10; 0 = strict arrival order within a band).")
    affinity_budget = models.CharField(
        max_length=16, blank=True, default="",
        help_text="`routing.scheduler.settings.serial.affinityBudget`: how long affinity may "
                  "hold a request back before it is ignored for it: auto "
                  f"({affinity_budget.AUTO_SWAPS:g} x its model's "
                  "measured swap cost; recommended), seconds, or empty (off, the default).")
    health_check_timeout = models.PositiveIntegerField(
        default=120, help_text="`healthCheckTimeout`: seconds a starting model has to answer "
                               "its check endpoint before the start fails "
                               f"(at least {MIN_HEALTH_CHECK_TIMEOUT}).")
    global_ttl = models.PositiveIntegerField(
        default=0, help_text="`globalTTL`: idle seconds before unload for models whose ttl is "
                             "-1; 0 = never.")
    unload_timeout = models.PositiveIntegerField(
        default=10, help_text="`unloadTimeout`: seconds a stopping model gets between SIGTERM "
                              "and SIGKILL, for models whose own unload timeout is 0.")
    start_port = models.PositiveIntegerField(
        default=5800, help_text="`startPort`: the first port import hands out for `${PORT}`, "
                                "one per model in model-id order.")
    send_loading_state = models.BooleanField(
        default=False, help_text="`sendLoadingState`: stream loading progress to waiting "
                                 "chat clients.")
    include_aliases_in_list = models.BooleanField(
        default=False, help_text="`includeAliasesInList`: list aliases in /v1/models.")
    performance_monitoring = models.BooleanField(
        default=True, help_text="The opposite of `performance.disabled`: sample CPU, memory "
                                "and GPU figures for /metrics; off leaves those series out.")
    performance_interval = models.FloatField(
        default=5.0, help_text="`performance.every`: seconds between performance samples "
                               "(at least 1; each runs nvidia-smi or rocm-smi).")
    capture_buffer_mb = models.PositiveIntegerField(
        default=0, help_text="`captureBuffer`: megabytes of memory for request/response "
                             "captures (/api/captures/ID); 0 keeps none. Bodies are kept as "
                             "sent, minus credentials: turn on only where that is acceptable.")
    preload = models.JSONField(
        default=list, blank=True,
        help_text='`hooks.on_startup.preload`: model ids or aliases loaded, in order, when the '
                  'proxy starts; a JSON list such as ["big-coder"].')
    max_waiting = models.PositiveIntegerField(
        default=DEFAULT_MAX_WAITING,
        help_text="`queue.maxWaiting` (gpuproxy): requests that may wait at once (queued or "
                  "behind a model load), all bands together; beyond it, 429 queue_full. "
                  "0 = no cap. The default lets a batch of 10,000 queue on an idle box, on one "
                  "model too: under serial a model's unset concurrencyLimit adds no cap.")
    max_waiting_interactive = models.PositiveIntegerField(
        default=0, help_text="`queue.maxWaitingPerBand.interactive`: 0 = no band cap.")
    max_waiting_normal = models.PositiveIntegerField(
        default=0, help_text="`queue.maxWaitingPerBand.normal`: 0 = no band cap.")
    max_waiting_batch = models.PositiveIntegerField(
        default=0, help_text="`queue.maxWaitingPerBand.batch`: 0 = no band cap; e.g. keep "
                             "batch from filling the whole queue.")
    queue_timeout = models.PositiveIntegerField(
        default=0,
        help_text="`queue.timeout` (gpuproxy): seconds a request may wait before it is "
                  "answered 503 queue_timeout, unless it sends its own "
                  "X-LlamaSwap-Queue-Timeout. 0 = wait as long as it takes.")
    ROUTERS = [("group", "group (groups: swap, exclusive, persistent)"),
               ("matrix", "matrix (sets of models that may run together)")]
    router = models.CharField(
        max_length=16, choices=ROUTERS, default="group",
        help_text="`routing.router.use`: what decides which models stop before another "
                  "loads: groups, or the matrix's sets.")
    matrix_vars = models.JSONField(
        default=dict, blank=True,
        help_text='`routing.router.settings.matrix.vars`: short names for model ids in set '
                  'expressions, e.g. {"g": "gemma-model"}.')
    matrix_evict_costs = models.JSONField(
        default=dict, blank=True,
        help_text='`routing.router.settings.matrix.evict_costs`: the cost of stopping a model '
                  '(a model id or var; 1 when absent), e.g. {"llama-70B": 30}.')
    importer_node = models.CharField(
        "importer node", max_length=63, blank=True,
        help_text="With several nodes on this database, the one whose `serve --config` "
                  "writes the definitions (its SIGHUP and -watch-config too); other nodes "
                  "refuse a file that differs from the database. Empty = the first node "
                  f"that imports claims it; `{ADMIN_ONLY}` = no node imports, the admin alone "
                  "writes them. A node that finds the importer down takes over.")
    active_profile = models.CharField(
        max_length=255, blank=True,
        help_text="The profile whose pins apply (`PUT /api/profiles/active`); empty = none.")
    version = models.PositiveIntegerField(default=0, editable=False)

    class Meta:
        verbose_name = "proxy settings"
        verbose_name_plural = "proxy settings"

    def __str__(self) -> str:
        return "Proxy settings"

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if not self.aging_divisor or self.aging_divisor <= 0:
            errors["aging_divisor"] = (
                "The aging divisor must be a positive number of seconds: at 0 or below, waiting "
                "would never raise a request's score and low priorities could starve.")
        if self.swap_affinity_bonus > MAX_SWAP_AFFINITY_BONUS:
            errors["swap_affinity_bonus"] = (
                f"The swap affinity bonus must be 0..{MAX_SWAP_AFFINITY_BONUS}: 100 or more "
                "would lift a request into the next priority band.")
        try:
            self.affinity_budget = affinity_budget.parse_budget(self.affinity_budget).text()
        except ValueError as exc:
            errors["affinity_budget"] = f"The affinity budget: {exc}."
        if self.health_check_timeout < MIN_HEALTH_CHECK_TIMEOUT:
            errors["health_check_timeout"] = (
                f"The health check timeout must be at least {MIN_HEALTH_CHECK_TIMEOUT} seconds.")
        interval = self.performance_interval
        if isinstance(interval, int | float) and not (
                math.isfinite(interval) and interval >= MIN_PERFORMANCE_INTERVAL):
            errors["performance_interval"] = (
                f"The performance interval must be at least {MIN_PERFORMANCE_INTERVAL:g} second: "
                "every sample runs nvidia-smi or rocm-smi, so sampling faster costs CPU without "
                "making the figures any more useful.")
        if not (1 <= self.start_port <= 65535):
            errors["start_port"] = "The start port must be 1..65535."
        if not isinstance(self.preload, list) or not all(
                isinstance(p, str) for p in self.preload):
            errors["preload"] = "preload must be a list of model ids."
        if self.importer_node not in ("", ADMIN_ONLY) and (
                why := bad_node_name(self.importer_node)) is not None:
            errors["importer_node"] = f"{why}; or empty, or {ADMIN_ONLY} for the admin only."
        errors.update(self.priority_range_errors())
        if errors:
            raise ValidationError(errors)

    def save(self, *args, **kwargs) -> None:
        self.pk = 1
        self.version += 1
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValidationError("The proxy settings cannot be deleted; edit them instead.")

    @classmethod
    def load(cls) -> ProxySettings:
        obj, _ = cls.objects.get_or_create(pk=1)
        return obj

    @classmethod
    def set_active_profile(cls, name: str, *, only_if: str | None = None
                           ) -> tuple[bool, str, int]:
        """Make `name` the active profile ("" for none): the one writer of the setting, for
        `PUT /api/profiles/active` and the admin's actions. Only that column is written,
        under a row lock, so a settings page saved from an older read cannot undo it, nor it
        the page. With `only_if`, only when the active one is that (a rename keeping it).
        Returns (whether the profile exists, the one active before, the settings version
        the running proxy shows once it routes by the result)."""
        with transaction.atomic():
            if name and not Profile.objects.filter(name=name).exists():
                return False, "", 0
            cls.load()  # the row exists from here on
            row = cls.objects.select_for_update().get(pk=1)
            before = row.active_profile
            if before != name and (only_if is None or before == only_if):
                row.active_profile = name
                row.save(update_fields=["active_profile", "version"])
            return True, before, row.version


def key_prefix(key: str) -> str:
    """What the admin shows of a key: enough to tell generated keys apart ("sk-gp-" and 4
    random characters), never more than a third of it, so a short imported key is not shown
    almost whole."""
    return key[:min(10, len(key) // 3)]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKey(PriorityRange):
    """A client credential; only its SHA-256 is stored, the key is shown once at creation."""

    name = models.CharField(max_length=100, unique=True,
                            help_text="Who uses this key; recorded as the client in the "
                                      "activity log. The key itself is generated on save and "
                                      "shown once.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False, blank=True,
                              help_text="The first characters, to recognise the key.")
    admin = models.BooleanField(
        default=False,
        help_text="Admin keys may also use the management API (load, unload, /api/queue, "
                  "/api/activity), /logs, /upstream/… and see each model's command in "
                  "/running. Other keys get inference, /v1/models, /metrics and /running "
                  "without commands. (`admin: true` under apiKeyHashes in a config.)")
    trusted_peer = models.BooleanField(
        "trusted peer", default=False,
        help_text="A gpuproxy or llama-swap that forwards to this one: its "
                  "X-LlamaSwap-Priority is taken as already applied and its "
                  "X-LlamaSwap-Arrived keeps the request's age. Other callers' arrival "
                  "headers are ignored. (`peer: true` under apiKeyHashes in a config.)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return self.name

    def set_key(self, key: str) -> None:
        if not key or any(c.isspace() for c in key):
            raise ValidationError("An API key must be non-empty and contain no spaces.")
        self.key_hash = hash_key(key)
        self.prefix = key_prefix(key)

    @staticmethod
    def generate() -> str:
        return "sk-gp-" + secrets.token_urlsafe(24)
