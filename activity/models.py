"""The activity log: one row per request, written in batches by `activity.writer`.

The table and column names are a contract for analysts (`docs/activity.md`).
"""

from __future__ import annotations

from django.db import models

from activity import events, outcomes

END_USER_MAX = 255


class RequestLog(models.Model):
    id = models.BigAutoField(primary_key=True)
    request_id = models.UUIDField(db_index=True)

    received_at = models.DateTimeField()
    dispatched_at = models.DateTimeField(null=True, blank=True)
    first_byte_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    method = models.CharField(max_length=16, blank=True)
    path = models.CharField(max_length=1024, blank=True)
    model_requested = models.CharField(max_length=255, blank=True)
    model = models.CharField(max_length=255, blank=True, help_text="resolved model id")
    status_code = models.IntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=outcomes.MAX_LENGTH, choices=outcomes.CHOICES)

    # the scheduler's decision (scheduling.core.events.Dispatch)
    priority = models.BigIntegerField(default=0)
    priority_asked = models.BigIntegerField(
        null=True, blank=True,
        help_text="The priority the request asked for (X-LlamaSwap-Priority, else service_tier) "
                  "before its key's range clamped it into `priority`; NULL: it asked for none.")
    band = models.CharField(max_length=16, blank=True)
    score = models.FloatField(null=True, blank=True)
    score_parts = models.JSONField(null=True, blank=True,
                                   help_text="{priority, affinity, aging, seq}")

    queue_wait_ms = models.FloatField(null=True, blank=True)
    swap_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)

    stream = models.BooleanField(default=False)
    # Token columns, one meaning for every backend (activity/usage.py, docs/activity.md).
    input_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="All prompt tokens, cached ones included, whatever the backend reported them "
                  "as (llama.cpp prompt_n + cache_n, OpenAI/vLLM prompt_tokens, Anthropic "
                  "input_tokens + cache_read + cache_creation)")
    output_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="Generated tokens; for a stream that ended without usage (cancelled), the "
                  "content events relayed (see output_tokens_counted)")
    output_tokens_counted = models.BooleanField(
        default=False, db_default=False,
        help_text="True: the upstream reported no output count, output_tokens is the number of "
                  "content events relayed to the client (one per token on llama.cpp and vLLM)")
    draft_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="Speculative-decoding tokens drafted (llama.cpp timings.draft_n); NULL: not "
                  "reported")
    draft_accepted_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="Drafted tokens the target model accepted (llama.cpp draft_n_accepted)")
    prompt_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="Alias of input_tokens since migration 0006 (before it: uncached tokens under "
                  "llama.cpp, see docs/activity.md)")
    completion_tokens = models.IntegerField(
        null=True, blank=True, help_text="Alias of output_tokens since migration 0006")
    cached_tokens = models.IntegerField(
        null=True, blank=True,
        help_text="Prompt tokens served from the prompt cache, part of input_tokens (llama.cpp "
                  "cache_n, OpenAI/vLLM prompt_tokens_details.cached_tokens, Anthropic "
                  "cache_read_input_tokens)")
    prompt_tps = models.FloatField(null=True, blank=True)
    generation_tps = models.FloatField(null=True, blank=True)

    scheduler = models.CharField(max_length=32, blank=True)
    client = models.CharField(max_length=255, blank=True,
                              help_text="API key name, else the remote address")
    client_ip = models.GenericIPAddressField(
        null=True, blank=True,
        help_text="The client's address: the TCP peer, or from X-Forwarded-For/Forwarded when "
                  "the peer is a trusted proxy (GPUPROXY_TRUSTED_PROXIES)")
    # db_default (as upstream_retries): rows another client writes without them get ''.
    end_user = models.CharField(
        max_length=END_USER_MAX, blank=True, default="", db_default="",
        help_text="The body's `user` field (OpenAI's end-user id, Anthropic metadata.user_id), "
                  "cut to 255 characters")
    endpoint = models.CharField(
        max_length=32, blank=True, default="", db_default="",
        help_text="The kind of call (chat, completions, embeddings...; activity/endpoints.py)")
    user_agent = models.CharField(max_length=512, blank=True)
    error = models.TextField(blank=True)
    # db_default too: rows written by another client (an older writer, a script) get 0. No
    # CHECK (>= 0): adding one would scan the whole table in the migration.
    upstream_retries = models.SmallIntegerField(
        default=0, db_default=0, help_text="times the request was sent again on a fresh "
        "connection because its reused one was closed before the upstream read it")

    class Meta:
        db_table = "activity_requestlog"
        ordering = ["-received_at"]
        # The time index is created by the migration: BRIN on PostgreSQL (10M rows, appended
        # in time order), a btree on SQLite, which has no BRIN.
        indexes = [
            models.Index(fields=["model", "received_at"], name="activity_rl_model_time"),
            models.Index(fields=["band", "received_at"], name="activity_rl_band_time"),
            models.Index(fields=["outcome"], name="activity_rl_outcome"),
        ]

    def __str__(self) -> str:
        return f"{self.received_at:%Y-%m-%d %H:%M:%S} {self.model or self.model_requested} " \
               f"{self.outcome}"


class Capture(models.Model):
    """One request's capture for `GET /api/captures/{id}` (activity/captures.py): compressed,
    its row's by `request_id`, the table bounded by `captureBuffer` MB (oldest out first)."""

    id = models.BigAutoField(primary_key=True)
    request_id = models.UUIDField(unique=True)
    size = models.IntegerField(help_text="compressed bytes")
    data = models.BinaryField()

    class Meta:
        db_table = "activity_capture"

    def __str__(self) -> str:
        return f"capture {self.request_id} ({self.size} bytes)"


class ModelEvent(models.Model):
    """One thing that happened to a model's process: a load, ready, unload, idle unload,
    crash, start failure or restart (`activity/events.py` has the kinds and reasons), written
    by the events writer off the event loop. `activity_modelevent`, like the app's other
    tables, so that `\\dt activity_*` lists every table analysts read."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(help_text="when it happened")
    model = models.CharField(max_length=255, help_text="the model id")
    kind = models.CharField(max_length=events.KIND_MAX_LENGTH, choices=events.KIND_CHOICES)
    reason = models.CharField(max_length=events.REASON_MAX_LENGTH, blank=True,
                              choices=events.REASON_CHOICES, help_text="why, as far as the "
                              "proxy knows; empty when it does not")
    pid = models.IntegerField(null=True, blank=True, help_text="the process's pid, once spawned")
    duration_ms = models.FloatField(null=True, blank=True,
                                    help_text="what it took: see the kind's description")
    # No foreign key: a request's row is written by another writer (and will live in a
    # partitioned table), and an event may come before it.
    request_id = models.UUIDField(null=True, blank=True,
                                  help_text="the request that caused a load, when known")
    detail = models.CharField(max_length=events.DETAIL_MAX, blank=True,
                              help_text="an exit status, the model a swap made room for; never "
                              "a command line or an environment")

    class Meta:
        db_table = "activity_modelevent"
        ordering = ["-at"]
        indexes = [
            models.Index(fields=["model", "at"], name="activity_me_model_time"),
            models.Index(fields=["kind", "at"], name="activity_me_kind_time"),
            models.Index(fields=["at"], name="activity_me_time"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.model} {self.kind}"
