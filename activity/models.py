"""The activity log: one row per request, written in batches by `activity.writer`.

The table and column names are a contract for analysts (`docs/activity.md`); what each column
means is written once, in `activity/columns.py`, which `described` puts on the fields.

On PostgreSQL `activity_requestlog` and `activity_modelevent` are partitioned by month on
`received_at` and `at` (migration 0009; Django's state does not know). Adding, removing or
altering other columns and indexes works as usual; altering or renaming the partition key, a
unique constraint without it, a foreign key to these tables and a concurrent index do not:
PostgreSQL refuses them on a partitioned table, and `activity/partitions.py` names the key and
the partitions. Write such a change by hand, as 0009 and 0010 are.
"""

from __future__ import annotations

from django.db import models

from activity import events, outcomes
from activity.columns import CAPTURE, MODEL_EVENT, NODE, REQUEST_LOG, described

END_USER_MAX = 255
NODE_MAX = 63  # GPUPROXY_NODE's longest (gpuproxy/settings.py)


@described(REQUEST_LOG)
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
    model = models.CharField(max_length=255, blank=True)
    status_code = models.IntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=outcomes.MAX_LENGTH, choices=outcomes.CHOICES)

    # the scheduler's decision (scheduling.core.events.Dispatch)
    priority = models.BigIntegerField(default=0)
    priority_asked = models.BigIntegerField(null=True, blank=True)
    band = models.CharField(max_length=16, blank=True)
    score = models.FloatField(null=True, blank=True)
    score_parts = models.JSONField(null=True, blank=True)

    queue_wait_ms = models.FloatField(null=True, blank=True)
    swap_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)

    stream = models.BooleanField(default=False)
    # Token columns, one meaning for every backend (activity/usage.py, docs/activity.md).
    input_tokens = models.IntegerField(null=True, blank=True)
    output_tokens = models.IntegerField(null=True, blank=True)
    output_tokens_counted = models.BooleanField(default=False, db_default=False)
    draft_tokens = models.IntegerField(null=True, blank=True)
    draft_accepted_tokens = models.IntegerField(null=True, blank=True)
    prompt_tokens = models.IntegerField(null=True, blank=True)
    completion_tokens = models.IntegerField(null=True, blank=True)
    cached_tokens = models.IntegerField(null=True, blank=True)
    prompt_tps = models.FloatField(null=True, blank=True)
    generation_tps = models.FloatField(null=True, blank=True)

    scheduler = models.CharField(max_length=32, blank=True)
    client = models.CharField(max_length=255, blank=True)
    client_ip = models.GenericIPAddressField(null=True, blank=True)
    # db_default (as upstream_retries): rows another client writes without them get ''.
    end_user = models.CharField(max_length=END_USER_MAX, blank=True, default="", db_default="")
    endpoint = models.CharField(max_length=32, blank=True, default="", db_default="")
    user_agent = models.CharField(max_length=512, blank=True)
    error = models.TextField(blank=True)
    # db_default too: rows written by another client (an older writer, a script) get 0. No
    # CHECK (>= 0): adding one would scan the whole table in the migration.
    upstream_retries = models.SmallIntegerField(
        default=0, db_default=0)
    # The writer's GPUPROXY_NODE; '' from an older writer or another client (db_default).
    node = models.CharField(max_length=NODE_MAX, blank=True, default="", db_default="")
    entry_node = models.CharField(max_length=NODE_MAX, blank=True, default="", db_default="")

    class Meta:
        db_table = "activity_requestlog"
        db_table_comment = REQUEST_LOG.comment
        ordering = ["-received_at"]
        # The time index is created by the migration: BRIN on PostgreSQL (10M rows, appended
        # in time order), a btree on SQLite, which has no BRIN.
        indexes = [
            models.Index(fields=["model", "received_at"], name="activity_rl_model_time"),
            models.Index(fields=["band", "received_at"], name="activity_rl_band_time"),
            models.Index(fields=["outcome"], name="activity_rl_outcome"),
            models.Index(fields=["node", "received_at"], name="activity_rl_node_time"),
        ]

    def __str__(self) -> str:
        return f"{self.received_at:%Y-%m-%d %H:%M:%S} {self.model or self.model_requested} " \
               f"{self.outcome}"


@described(CAPTURE)
class Capture(models.Model):
    """One request's capture for `GET /api/captures/{id}` (activity/captures.py): compressed,
    its row's by `request_id`, the table bounded by `captureBuffer` MB (oldest out first)."""

    id = models.BigAutoField(primary_key=True)
    request_id = models.UUIDField(unique=True)
    size = models.IntegerField()
    data = models.BinaryField()

    class Meta:
        db_table = "activity_capture"
        db_table_comment = CAPTURE.comment

    def __str__(self) -> str:
        return f"capture {self.request_id} ({self.size} bytes)"


@described(MODEL_EVENT)
class ModelEvent(models.Model):
    """One thing that happened to a model's process: a load, ready, unload, idle unload,
    crash, start failure or restart (`activity/events.py` has the kinds and reasons), written
    by the events writer off the event loop. `activity_modelevent`, like the app's other
    tables, so that `\\dt activity_*` lists every table analysts read."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField()
    model = models.CharField(max_length=255)
    kind = models.CharField(max_length=events.KIND_MAX_LENGTH, choices=events.KIND_CHOICES)
    reason = models.CharField(max_length=events.REASON_MAX_LENGTH, blank=True,
                              choices=events.REASON_CHOICES)
    pid = models.IntegerField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    # No foreign key: a request's row is written by another writer (and will live in a
    # partitioned table), and an event may come before it.
    request_id = models.UUIDField(null=True, blank=True)
    detail = models.CharField(max_length=events.DETAIL_MAX, blank=True)
    node = models.CharField(max_length=NODE_MAX, blank=True, default="", db_default="")

    class Meta:
        db_table = "activity_modelevent"
        db_table_comment = MODEL_EVENT.comment
        ordering = ["-at"]
        indexes = [
            models.Index(fields=["model", "at"], name="activity_me_model_time"),
            models.Index(fields=["kind", "at"], name="activity_me_kind_time"),
            models.Index(fields=["at"], name="activity_me_time"),
            models.Index(fields=["node", "at"], name="activity_me_node_time"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.model} {self.kind}"


@described(NODE)
class Node(models.Model):
    """One row per node of a fleet sharing this database, rewritten (an UPSERT) about once a
    second by that node's serve (gpuproxy/shell/fleet.py): the fleet view reads who is up,
    what each has loaded and how long its queues are without asking the nodes themselves.
    Not partitioned: it holds as many rows as there are nodes."""

    node = models.CharField(max_length=NODE_MAX, primary_key=True)
    state = models.CharField(max_length=16, default="running")
    heartbeat_at = models.DateTimeField()
    started_at = models.DateTimeField()
    pid = models.IntegerField()
    version = models.CharField(max_length=64, blank=True)
    listen = models.CharField(max_length=255, blank=True)
    url = models.CharField(max_length=255, blank=True, default="", db_default="")
    loaded = models.JSONField(default=list)
    queue = models.JSONField(default=dict)
    in_flight = models.JSONField(default=dict)

    class Meta:
        db_table = "activity_node"
        db_table_comment = NODE.comment
        ordering = ["node"]

    def __str__(self) -> str:
        return self.node
