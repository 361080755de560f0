"""The activity tables' comments (`COMMENT ON`), from `activity/columns.py`.

Only the comments change in the database: Django's own AlterField would also re-set each
column's type (`ALTER COLUMN ... TYPE`), which PostgreSQL refuses on a partition key
(`received_at`, `at`: migration 0009) and which locks the table for nothing. So Django's state
takes the operations below as they are, and the database gets one `COMMENT ON` per changed
comment, read from those same operations (the text is frozen here). SQLite has no comments.
A later change of a text in `activity/columns.py` needs a migration written the same way.
"""

from django.db import migrations, models

STATE = [
    migrations.AlterModelTableComment(
        name='capture',
        table_comment='One request\'s capture for GET /api/captures/{id} (captureBuffer): headers redacted, compressed; the oldest deleted first. See docs/activity.md, "Captures".',
    ),
    migrations.AlterModelTableComment(
        name='modelevent',
        table_comment='One row per thing that happened to a model\'s process: load, ready, unload, idle unload, crash, start failure, restart. See docs/activity.md, "Model events".',
    ),
    migrations.AlterModelTableComment(
        name='requestlog',
        table_comment="One row per request the proxy received (served, rejected, cancelled, failed): the scheduler's decision, the timings and the token counts. See docs/activity.md.",
    ),
    migrations.AlterField(
        model_name='capture',
        name='data',
        field=models.BinaryField(db_comment='the capture: a length-prefixed JSON header (path, headers) and the bodies, zlib-compressed (activity/captures.py unpacks it); never NULL', help_text='the capture: a length-prefixed JSON header (path, headers) and the bodies, zlib-compressed (activity/captures.py unpacks it)'),
    ),
    migrations.AlterField(
        model_name='capture',
        name='id',
        field=models.BigAutoField(db_comment='row id; never NULL', help_text='row id', primary_key=True, serialize=False),
    ),
    migrations.AlterField(
        model_name='capture',
        name='request_id',
        field=models.UUIDField(db_comment='the captured request: its activity_requestlog.request_id (unique; no foreign key); never NULL', help_text='the captured request: its activity_requestlog.request_id (unique; no foreign key)', unique=True),
    ),
    migrations.AlterField(
        model_name='capture',
        name='size',
        field=models.IntegerField(db_comment='the size of data (unit: bytes); never NULL', help_text='the size of data'),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='at',
        field=models.DateTimeField(db_comment='when it happened (indexed, alone and with model or kind); never NULL', help_text='when it happened (indexed, alone and with model or kind)'),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='detail',
        field=models.CharField(blank=True, db_comment='the exit status (code 0, signal SIGKILL), how a start failed (exited, code 1, timeout, spawn, port_in_use), the model a swap made room for (for b), restart; never a command line or an environment, which can hold secrets', help_text='the exit status (code 0, signal SIGKILL), how a start failed (exited, code 1, timeout, spawn, port_in_use), the model a swap made room for (for b), restart; never a command line or an environment, which can hold secrets', max_length=500),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='duration_ms',
        field=models.FloatField(blank=True, db_comment='what it took: see the kind (unit: ms); NULL when load and restart rows', help_text='what it took: see the kind', null=True),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='id',
        field=models.BigAutoField(db_comment='row id, increasing in insertion order; never NULL', help_text='row id, increasing in insertion order', primary_key=True, serialize=False),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='kind',
        field=models.CharField(choices=[('load', 'load'), ('ready', 'ready'), ('unload', 'unload'), ('idle_unload', 'idle_unload'), ('crash', 'crash'), ('start_failed', 'start_failed'), ('restart', 'restart')], db_comment='what happened: one of the kinds below; never NULL', help_text='what happened: one of the kinds below', max_length=12),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='model',
        field=models.CharField(db_comment='the model id; never NULL', help_text='the model id', max_length=255),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='pid',
        field=models.IntegerField(blank=True, db_comment="the process's pid; NULL when no process was spawned (a start that failed to spawn), or a restart row", help_text="the process's pid", null=True),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='reason',
        field=models.CharField(blank=True, choices=[('request', 'request'), ('swap', 'swap'), ('ttl', 'ttl'), ('admin', 'admin'), ('config', 'config'), ('crash', 'crash'), ('shutdown', 'shutdown')], db_comment="why, as far as the proxy knows: one of the reasons below; '' when unknown", help_text='why, as far as the proxy knows: one of the reasons below', max_length=8),
    ),
    migrations.AlterField(
        model_name='modelevent',
        name='request_id',
        field=models.UUIDField(blank=True, db_comment="the request that caused a load (the first of those waiting for it): its activity_requestlog.request_id, on the load, ready and start_failed rows; no foreign key (the request's row is written by another writer, maybe later); NULL when not caused by a request (an unload, a crash, a restart), or a load asked without one (/api/models/load/{model})", help_text="the request that caused a load (the first of those waiting for it): its activity_requestlog.request_id, on the load, ready and start_failed rows; no foreign key (the request's row is written by another writer, maybe later)", null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='band',
        field=models.CharField(blank=True, db_comment='the priority band (interactive, normal, batch; docs/scheduling.md)', help_text='the priority band (interactive, normal, batch; docs/scheduling.md)', max_length=16),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='cached_tokens',
        field=models.IntegerField(blank=True, db_comment='the part of input_tokens read from the prompt cache; NULL when not reported', help_text='the part of input_tokens read from the prompt cache', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='client',
        field=models.CharField(blank=True, db_comment="the API key's name, else the client's address (client_ip)", help_text="the API key's name, else the client's address (client_ip)", max_length=255),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='client_ip',
        field=models.GenericIPAddressField(blank=True, db_comment='the client\'s address: the TCP peer, or, when the peer is one of GPUPROXY_TRUSTED_PROXIES, the rightmost address of Forwarded/X-Forwarded-For that is not a trusted proxy (docs/security.md, "Client addresses behind a reverse proxy"); NULL when no TCP peer address (a Unix socket)', help_text='the client\'s address: the TCP peer, or, when the peer is one of GPUPROXY_TRUSTED_PROXIES, the rightmost address of Forwarded/X-Forwarded-For that is not a trusted proxy (docs/security.md, "Client addresses behind a reverse proxy")', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='completion_tokens',
        field=models.IntegerField(blank=True, db_comment='alias of output_tokens (same value since 0006); NULL when as output_tokens', help_text='alias of output_tokens (same value since 0006)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='dispatched_at',
        field=models.DateTimeField(blank=True, db_comment="the scheduler granted it (a slot on a ready upstream); a peer's model: when it was sent to the peer; never NULL dispatched: rejected, unknown model, cancelled while queued, start failed…", help_text="the scheduler granted it (a slot on a ready upstream); a peer's model: when it was sent to the peer", null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='draft_accepted_tokens',
        field=models.IntegerField(blank=True, db_comment='of those, the ones the target model accepted; NULL when as draft_tokens (both or neither)', help_text='of those, the ones the target model accepted', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='draft_tokens',
        field=models.IntegerField(blank=True, db_comment='speculative decoding: tokens the draft model proposed (llama.cpp timings.draft_n, vLLM metrics.speculative_decoding.num_draft_tokens); NULL when no draft model, or not reported', help_text='speculative decoding: tokens the draft model proposed (llama.cpp timings.draft_n, vLLM metrics.speculative_decoding.num_draft_tokens)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='duration_ms',
        field=models.FloatField(blank=True, db_comment='received → finished: the whole request as the client saw it (unit: ms); never NULL in practice', help_text='received → finished: the whole request as the client saw it', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='end_user',
        field=models.CharField(blank=True, db_comment="the body's user (OpenAI's end-user id), else metadata.user_id (Anthropic), first 255 characters; a value that is the request's own key or starts with sk- is not kept; '' when the body names none", db_default='', default='', help_text="the body's user (OpenAI's end-user id), else metadata.user_id (Anthropic), first 255 characters; a value that is the request's own key or starts with sk- is not kept", max_length=255),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='endpoint',
        field=models.CharField(blank=True, db_comment="the kind of call, from the path (activity/endpoints.py, the metrics' endpoint label): chat, completions, responses, messages, embeddings, rerank, infill, … upstream for /upstream/…, other; '' on rows older than 0006", db_default='', default='', help_text="the kind of call, from the path (activity/endpoints.py, the metrics' endpoint label): chat, completions, responses, messages, embeddings, rerank, infill, … upstream for /upstream/…, other", max_length=32),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='error',
        field=models.TextField(blank=True, db_comment="the error message given to the client, if any: the proxy's own words and the failing exception's type, never an exception's text (which can hold the headers sent upstream); '' on success", help_text="the error message given to the client, if any: the proxy's own words and the failing exception's type, never an exception's text (which can hold the headers sent upstream)"),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='finished_at',
        field=models.DateTimeField(blank=True, db_comment='the request ended (last byte relayed, or refused); never NULL in practice (set when the record is closed)', help_text='the request ended (last byte relayed, or refused)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='first_byte_at',
        field=models.DateTimeField(blank=True, db_comment="the upstream's first response byte; NULL when no response byte came", help_text="the upstream's first response byte", null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='generation_tps',
        field=models.FloatField(blank=True, db_comment='generation speed (unit: tokens/s); NULL when not reported', help_text='generation speed', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='id',
        field=models.BigAutoField(db_comment='row id, increasing in insertion order; never NULL', help_text='row id, increasing in insertion order', primary_key=True, serialize=False),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='input_tokens',
        field=models.IntegerField(blank=True, db_comment='every prompt token, cached ones included, whatever the backend (Token counts below); NULL when the upstream did not report them, or the row is older than migration 0006', help_text='every prompt token, cached ones included, whatever the backend (Token counts below)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='method',
        field=models.CharField(blank=True, db_comment='HTTP method', help_text='HTTP method', max_length=16),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='model',
        field=models.CharField(blank=True, db_comment="the resolved model id; a peer's model as <peer>/<model>; '' when it did not resolve", help_text="the resolved model id; a peer's model as <peer>/<model>", max_length=255),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='model_requested',
        field=models.CharField(blank=True, db_comment="the model the client asked for (an alias, maybe); '' when the body had none", help_text='the model the client asked for (an alias, maybe)', max_length=255),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='outcome',
        field=models.CharField(choices=[('ok', 'ok'), ('upstream_error', 'upstream error'), ('rejected_capacity', 'rejected capacity'), ('rejected_queue', 'rejected queue'), ('queue_timeout', 'queue timeout'), ('cancelled_queued', 'cancelled queued'), ('cancelled_inflight', 'cancelled inflight'), ('cancelled_by_admin', 'cancelled by admin'), ('start_failed', 'start failed'), ('upstream_died', 'upstream died'), ('upstream_stopped', 'upstream stopped'), ('bad_request', 'bad request'), ('unknown_model', 'unknown model'), ('unauthorized', 'unauthorized'), ('shutting_down', 'shutting down')], db_comment='how the request ended: one of the set below; never NULL', help_text='how the request ended: one of the set below', max_length=32),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='output_tokens',
        field=models.IntegerField(blank=True, db_comment='generated tokens; for a stream that ended without a count (the client left, the upstream died) the data: events relayed, see output_tokens_counted; NULL when not reported, nothing relayed, or older than 0006', help_text='generated tokens; for a stream that ended without a count (the client left, the upstream died) the data: events relayed, see output_tokens_counted', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='output_tokens_counted',
        field=models.BooleanField(db_comment='true: output_tokens is the count of events relayed, not a number the upstream reported; never NULL (false on older rows)', db_default=False, default=False, help_text='true: output_tokens is the count of events relayed, not a number the upstream reported'),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='path',
        field=models.CharField(blank=True, db_comment='request path, e.g. /v1/chat/completions', help_text='request path, e.g. /v1/chat/completions', max_length=1024),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='priority',
        field=models.BigIntegerField(db_comment='the effective priority (model priority + X-LlamaSwap-Priority), after the key\'s range clamped it (docs/scheduling.md, "Trusted priority"); never NULL (0 by default)', default=0, help_text='the effective priority (model priority + X-LlamaSwap-Priority), after the key\'s range clamped it (docs/scheduling.md, "Trusted priority")'),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='priority_asked',
        field=models.BigIntegerField(blank=True, db_comment="the priority the request asked for (X-LlamaSwap-Priority, else service_tier mapped), before the clamp; differs from priority when the key's range clamped it; NULL when it asked for none (no header, an empty or unparseable one, no known tier)", help_text="the priority the request asked for (X-LlamaSwap-Priority, else service_tier mapped), before the clamp; differs from priority when the key's range clamped it", null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='prompt_tokens',
        field=models.IntegerField(blank=True, db_comment='alias of input_tokens (written with the same value since migration 0006; before it, llama.cpp rows held its uncached prompt_n); NULL when as input_tokens', help_text='alias of input_tokens (written with the same value since migration 0006; before it, llama.cpp rows held its uncached prompt_n)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='prompt_tps',
        field=models.FloatField(blank=True, db_comment='prompt processing speed (llama.cpp timings, vLLM metrics) (unit: tokens/s); NULL when not reported', help_text='prompt processing speed (llama.cpp timings, vLLM metrics)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='queue_wait_ms',
        field=models.FloatField(blank=True, db_comment='time from arrival to the scheduler\'s grant (includes any model load waited for; for a trusted peer\'s request, from its arrival at that peer: docs/scheduling.md, "Priority across peers") (unit: ms); NULL when not dispatched (except cancelled_queued: the time until the client left)', help_text='time from arrival to the scheduler\'s grant (includes any model load waited for; for a trusted peer\'s request, from its arrival at that peer: docs/scheduling.md, "Priority across peers")', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='received_at',
        field=models.DateTimeField(db_comment='the proxy received the request; never NULL', help_text='the proxy received the request'),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='request_id',
        field=models.UUIDField(db_comment="the request's id (indexed); never NULL", db_index=True, help_text="the request's id (indexed)"),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='scheduler',
        field=models.CharField(blank=True, db_comment="the policy that decided (serial, fifo); peer for a peer's model asked for by name, which no scheduler sees", help_text="the policy that decided (serial, fifo); peer for a peer's model asked for by name, which no scheduler sees", max_length=32),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='score',
        field=models.FloatField(blank=True, db_comment="the scheduler's score at dispatch (higher goes first); NULL when not dispatched, or a scheduler without scores", help_text="the scheduler's score at dispatch (higher goes first)", null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='score_parts',
        field=models.JSONField(blank=True, db_comment='the score\'s breakdown: {"priority", "affinity", "aging", "seq"} (seq = arrival sequence); NULL when not dispatched', help_text='the score\'s breakdown: {"priority", "affinity", "aging", "seq"} (seq = arrival sequence)', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='status_code',
        field=models.IntegerField(blank=True, db_comment='the HTTP status the client got; NULL when not recorded', help_text='the HTTP status the client got', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='stream',
        field=models.BooleanField(db_comment='the client asked for a streamed (SSE) response; never NULL', default=False, help_text='the client asked for a streamed (SSE) response'),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='swap_ms',
        field=models.FloatField(blank=True, db_comment='time this request waited for a model load (swap) before it could run (unit: ms); NULL when the request waited for no load', help_text='time this request waited for a model load (swap) before it could run', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='ttft_ms',
        field=models.FloatField(blank=True, db_comment='dispatched → first byte: time to first token as the upstream delivered it (unit: ms); NULL when not dispatched, or no byte came', help_text='dispatched → first byte: time to first token as the upstream delivered it', null=True),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='upstream_retries',
        field=models.SmallIntegerField(db_comment='times the request was sent again on a fresh connection: its reused upstream connection was closed or reset within 100 ms, before any answer (the server had closed it unread). 0 or 1; only inference paths; never NULL (0)', db_default=0, default=0, help_text='times the request was sent again on a fresh connection: its reused upstream connection was closed or reset within 100 ms, before any answer (the server had closed it unread). 0 or 1; only inference paths'),
    ),
    migrations.AlterField(
        model_name='requestlog',
        name='user_agent',
        field=models.CharField(blank=True, db_comment="the client's User-Agent (first 300 characters)", help_text="the client's User-Agent (first 300 characters)", max_length=512),
    ),
]


def comment_on(apps, schema_editor, *, undo=False):
    if schema_editor.connection.vendor != "postgresql":
        return

    def text(value):
        return "NULL" if undo or value is None else schema_editor.quote_value(value)

    for op in STATE:
        if isinstance(op, migrations.AlterModelTableComment):
            table = apps.get_model("activity", op.name)._meta.db_table
            schema_editor.execute(
                f"COMMENT ON TABLE {schema_editor.quote_name(table)} IS {text(op.table_comment)}")
        else:
            meta = apps.get_model("activity", op.model_name)._meta
            column = meta.get_field(op.name).column
            schema_editor.execute(
                f"COMMENT ON COLUMN {schema_editor.quote_name(meta.db_table)}."
                f"{schema_editor.quote_name(column)} IS {text(op.field.db_comment)}")


def uncomment(apps, schema_editor):
    comment_on(apps, schema_editor, undo=True)


class Migration(migrations.Migration):

    dependencies = [
        ('activity', '0009_partition_by_month'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=STATE,
            database_operations=[migrations.RunPython(comment_on, uncomment)],
        ),
    ]
