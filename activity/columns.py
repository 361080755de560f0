"""What each column of the analysts' tables means: the one place it is written.

Analysts read `activity_requestlog` and `activity_modelevent` with SQL, so a column's meaning
belongs in the database itself (`COMMENT ON`, shown by psql's `\\d+` and by every SQL client)
as much as in `docs/activity.md`. Both come from here: `described` puts each column's text on
its model field as `db_comment` (Django writes the `COMMENT ON` in a migration, so
`makemigrations --check` catches a text changed without one) and as the admin's help text, and
`gpuproxy activity_columns --write` renders the tables of `docs/activity.md` (a test fails when
the file and this module disagree). A field with no entry here, or an entry for no field, is an
error at import, so a new column cannot land undocumented.

Texts are Markdown, as they appear in the docs; the database gets them without the markup.

Changing a text: edit it here, run `gpuproxy activity_columns --write`, then write the migration
as `0010_column_comments` is written (`makemigrations` for the state operations, the database
getting only `COMMENT ON`): Django's plain AlterField would also re-set the column's type, which
PostgreSQL refuses on a partition key (`received_at`, `at`) and which locks the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Column:
    name: str
    meaning: str
    null: str  # when the value is NULL: "never", "—" for a text column ('' instead), or the cases
    unit: str = ""  # shown after the type in the docs: "ms", "tokens/s"

    @property
    def comment(self) -> str:
        """The column's `COMMENT ON`: its meaning, its unit, and when it is NULL (or `''`)."""
        text = plain(self.meaning) + (f" (unit: {self.unit})" if self.unit else "")
        null = plain(self.null)
        if null == "—":
            return text
        if null.startswith("— (") and null.endswith(")"):
            return f"{text}; {null[3:-1]}"
        if null.startswith("never"):
            return f"{text}; never NULL{null[len('never'):]}"
        return f"{text}; NULL when {null}"


@dataclass(frozen=True)
class Table:
    name: str
    about: str  # the table's own comment
    columns: tuple[Column, ...]

    @property
    def comment(self) -> str:
        return plain(self.about)

    def column(self, name: str) -> Column:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(name)


REQUEST_LOG = Table(
    "activity_requestlog",
    "One row per request the proxy received (served, rejected, cancelled, failed): the "
    "scheduler's decision, the timings and the token counts. See docs/activity.md.",
    (
        Column('id',
               'row id, increasing in insertion order',
               null='never'),
        Column('request_id',
               "the request's id (indexed)",
               null='never'),
        Column('received_at',
               'the proxy received the request',
               null='never'),
        Column('dispatched_at',
               "the scheduler granted it (a slot on a ready upstream); a peer's model: when it "
               'was sent to the peer',
               null='never dispatched: rejected, unknown model, cancelled while queued, start '
                    'failed…'),
        Column('first_byte_at',
               "the upstream's first response byte",
               null='no response byte came'),
        Column('finished_at',
               'the request ended (last byte relayed, or refused)',
               null='never in practice (set when the record is closed)'),
        Column('method',
               'HTTP method',
               null='—'),
        Column('path',
               'request path, e.g. `/v1/chat/completions`',
               null='—'),
        Column('model_requested',
               'the `model` the client asked for (an alias, maybe)',
               null="— (`''` when the body had none)"),
        Column('model',
               "the resolved model id; a peer's model as `<peer>/<model>`",
               null="— (`''` when it did not resolve)"),
        Column('status_code',
               'the HTTP status the client got',
               null='not recorded'),
        Column('outcome',
               'how the request ended: one of the set below',
               null='never'),
        Column('priority',
               "the effective priority (model priority + `X-LlamaSwap-Priority`), after the key's"
               ' range clamped it (`docs/scheduling.md`, "Trusted priority")',
               null='never (0 by default)'),
        Column('priority_asked',
               'the priority the request asked for (`X-LlamaSwap-Priority`, else `service_tier` '
               "mapped), before the clamp; differs from `priority` when the key's range clamped "
               'it',
               null='it asked for none (no header, an empty or unparseable one, no known tier)'),
        Column('band',
               'the priority band (`interactive`, `normal`, `batch`; `docs/scheduling.md`)',
               null='—'),
        Column('score',
               "the scheduler's score at dispatch (higher goes first)",
               null='not dispatched, or a scheduler without scores'),
        Column('score_parts',
               'the score\'s breakdown: `{"priority", "affinity", "aging", "seq"}` (seq = arrival '
               'sequence), and `"budget_override": true` when the affinity budget gave the '
               'model its affinity (serial: a request of it had lost picks to affinity for the '
               'budget)',
               null='not dispatched'),
        Column('queue_wait_ms',
               "time from arrival to the scheduler's grant (includes any model load waited for; "
               "for a trusted peer's request, from its arrival at that peer: "
               '`docs/scheduling.md`, "Priority across peers")',
               null='not dispatched (except `cancelled_queued`: the time until the client left)',
               unit='ms'),
        Column('swap_ms',
               'time this request waited for a model load (swap) before it could run',
               null='the request waited for no load',
               unit='ms'),
        Column('duration_ms',
               'received → finished: the whole request as the client saw it',
               null='never in practice',
               unit='ms'),
        Column('ttft_ms',
               'dispatched → first byte: time to first token as the upstream delivered it',
               null='not dispatched, or no byte came',
               unit='ms'),
        Column('stream',
               'the client asked for a streamed (SSE) response',
               null='never'),
        Column('input_tokens',
               'every prompt token, cached ones included, whatever the backend (*Token counts* '
               'below)',
               null='the upstream did not report them, or the row is older than migration 0006'),
        Column('cached_tokens',
               'the part of `input_tokens` read from the prompt cache',
               null='not reported'),
        Column('output_tokens',
               'generated tokens; for a stream that ended without a count (the client left, the '
               'upstream died) the `data:` events relayed, see `output_tokens_counted`',
               null='not reported, nothing relayed, or older than 0006'),
        Column('output_tokens_counted',
               'true: `output_tokens` is the count of events relayed, not a number the upstream '
               'reported',
               null='never (false on older rows)'),
        Column('draft_tokens',
               'speculative decoding: tokens the draft model proposed (llama.cpp '
               '`timings.draft_n`, vLLM `metrics.speculative_decoding.num_draft_tokens`)',
               null='no draft model, or not reported'),
        Column('draft_accepted_tokens',
               'of those, the ones the target model accepted',
               null='as `draft_tokens` (both or neither)'),
        Column('prompt_tokens',
               'alias of `input_tokens` (written with the same value since migration 0006; before'
               ' it, llama.cpp rows held its *uncached* `prompt_n`)',
               null='as `input_tokens`'),
        Column('completion_tokens',
               'alias of `output_tokens` (same value since 0006)',
               null='as `output_tokens`'),
        Column('prompt_tps',
               'prompt processing speed (llama.cpp `timings`, vLLM `metrics`)',
               null='not reported',
               unit='tokens/s'),
        Column('generation_tps',
               'generation speed',
               null='not reported',
               unit='tokens/s'),
        Column('scheduler',
               "the policy that decided (`serial`, `fifo`); `peer` for a peer's model asked for "
               'by name, which no scheduler sees',
               null='—'),
        Column('client',
               "the API key's name, else the client's address (`client_ip`)",
               null='—'),
        Column('client_ip',
               "the client's address: the TCP peer, or, when the peer is one of "
               '`GPUPROXY_TRUSTED_PROXIES`, the rightmost address of '
               '`Forwarded`/`X-Forwarded-For` that is not a trusted proxy (`docs/security.md`, '
               '"Client addresses behind a reverse proxy")',
               null='no TCP peer address (a Unix socket)'),
        Column('end_user',
               "the body's `user` (OpenAI's end-user id), else `metadata.user_id` (Anthropic), "
               "first 255 characters; a value that is the request's own key or starts with `sk-` "
               'is not kept',
               null="— (`''` when the body names none)"),
        Column('endpoint',
               "the kind of call, from the path (`activity/endpoints.py`, the metrics' `endpoint`"
               ' label): `chat`, `completions`, `responses`, `messages`, `embeddings`, `rerank`, '
               '`infill`, … `upstream` for `/upstream/…`, `other`',
               null="— (`''` on rows older than 0006)"),
        Column('user_agent',
               "the client's User-Agent (first 300 characters)",
               null='—'),
        Column('error',
               "the error message given to the client, if any: the proxy's own words and the "
               "failing exception's type, never an exception's text (which can hold the headers "
               'sent upstream)',
               null="— (`''` on success)"),
        Column('upstream_retries',
               'times the request was sent again on a fresh connection: its reused upstream '
               'connection was closed or reset within 100 ms, before any answer (the server had '
               'closed it unread). 0 or 1; only inference paths',
               null='never (0)'),
        Column('node',
               'the node that served the request: its `GPUPROXY_NODE` (default the host name; '
               'indexed with `received_at`)',
               null="— (`''` on rows older than 0012, or written by another client)"),
        Column('entry_node',
               'the node the request entered the fleet by, when another node forwarded it '
               'here (docs/fleet.md, "Forwarding between nodes"); `node` served it',
               null="— (`''`: it entered here, or the row is older than 0015)"),
    ),
)

MODEL_EVENT = Table(
    "activity_modelevent",
    "One row per thing that happened to a model's process: load, ready, unload, idle unload, "
    "crash, start failure, restart. See docs/activity.md, \"Model events\".",
    (
        Column('id',
               'row id, increasing in insertion order',
               null='never'),
        Column('at',
               'when it happened (indexed, alone and with `model` or `kind`)',
               null='never'),
        Column('model',
               'the model id',
               null='never'),
        Column('kind',
               'what happened: one of the kinds below',
               null='never'),
        Column('reason',
               'why, as far as the proxy knows: one of the reasons below',
               null="— (`''` when unknown)"),
        Column('pid',
               "the process's pid",
               null='no process was spawned (a start that failed to spawn), or a `restart` row'),
        Column('duration_ms',
               'what it took: see the kind',
               null='`load` and `restart` rows',
               unit='ms'),
        Column('request_id',
               'the request that caused a load (the first of those waiting for it): its '
               '`activity_requestlog.request_id`, on the `load`, `ready` and `start_failed` rows;'
               " no foreign key (the request's row is written by another writer, maybe later)",
               null='not caused by a request (an unload, a crash, a restart), or a load asked '
                    'without one (`/api/models/load/{model}`)'),
        Column('detail',
               'the exit status (`code 0`, `signal SIGKILL`), how a start failed (`exited, code '
               '1`, `timeout`, `spawn`, `port_in_use`), the model a swap made room for (`for b`),'
               ' `restart`; never a command line or an environment, which can hold secrets',
               null='—'),
        Column('node',
               'the node whose process it was: its `GPUPROXY_NODE` (indexed with `at`)',
               null="— (`''` on rows older than 0012, or written by another client)"),
    ),
)

CAPTURE = Table(
    "activity_capture",
    "One request's capture for GET /api/captures/{id} (captureBuffer): headers redacted, "
    "compressed; the oldest deleted first. See docs/activity.md, \"Captures\".",
    (
        Column("id", "row id", null="never"),
        Column("request_id", "the captured request: its `activity_requestlog.request_id` "
               "(unique; no foreign key)", null="never"),
        Column("size", "the size of `data`", null="never", unit="bytes"),
        Column("data", "the capture: a length-prefixed JSON header (path, headers) and the "
               "bodies, zlib-compressed (`activity/captures.py` unpacks it)", null="never"),
    ),
)

NODE = Table(
    "activity_node",
    "One row per gpuproxy node (GPUPROXY_NODE) on this database: its heartbeat and what it "
    "serves, rewritten about once a second by the node's serve. See docs/fleet.md.",
    (
        Column("node", "the node's `GPUPROXY_NODE` (the key)", null="—"),
        Column("state", "what the node last said of itself: `running`, or `stopped` once it "
               "stopped cleanly; a running node whose `heartbeat_at` is older than "
               "`GPUPROXY_FLEET_DOWN_SECONDS` is down", null="—"),
        Column("heartbeat_at", "the node's last write, by the database's clock (now() at the "
               "write)", null="never"),
        Column("started_at", "when this serve started", null="never"),
        Column("pid", "the pid of the node's scheduler process", null="never"),
        Column("version", "the gpuproxy version the node runs (`/api/version`'s)", null="—"),
        Column("listen", "the address the node serves on, `host:port` as given to `--listen`",
               null="—"),
        Column("url", "where the other nodes reach this one to forward a request to it: "
               "`GPUPROXY_ADVERTISE`, else derived from `--listen`", null="— (`''` on rows "
               "older than 0015: never forwarded to)"),
        Column("loaded", "the models whose processes are ready, as a JSON list of ids",
               null="never"),
        Column("queue", "the requests waiting per model and band: `{model: {band: {\"depth\": "
               "n, \"oldest_wait_s\": s}}}`, only bands with a request waiting",
               null="never"),
        Column("in_flight", "the requests being served per model: `{model: n}`, only models "
               "with one", null="never"),
    ),
)

TABLES = (REQUEST_LOG, MODEL_EVENT, CAPTURE, NODE)


def plain(markdown: str) -> str:
    """The text without its Markdown: `code` and *emphasis* marks dropped, links' text kept."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", text)
    return text.replace("`", "")


ModelClass = TypeVar("ModelClass", bound=type)


def described(table: Table) -> Callable[[ModelClass], ModelClass]:
    """A model decorator: each field's `db_comment` and help text from `table`, and an
    ImproperlyConfigured at import when a column and its description do not pair up."""

    def describe(model: ModelClass) -> ModelClass:
        meta = model._meta  # type: ignore[attr-defined]
        fields = {field.column: field for field in meta.concrete_fields}
        named = [column.name for column in table.columns]
        missing = sorted(set(fields) - set(named))
        extra = sorted(set(named) - set(fields))
        if meta.db_table != table.name or missing or extra or len(named) != len(set(named)):
            raise ImproperlyConfigured(
                f"activity/columns.py's {table.name} does not describe {meta.db_table}'s "
                f"columns: missing {missing}, extra {extra}; add or remove the entries there "
                f"(then `gpuproxy activity_columns --write` and `makemigrations`)")
        for column in table.columns:
            field = fields[column.name]
            field.db_comment = column.comment
            field.help_text = plain(column.meaning)
        return model

    return describe
