"""Captures: a request's path, headers and body and its answer's headers and body, kept for
`GET /api/captures/{id}` (llama-swap's `captureBuffer`), off unless `captureBuffer` > 0.

Why it is built this way:

- **In the database, not in memory** (llama-swap keeps them in its process's memory): with
  `serve --workers N` the request and the GET may land in different request processes, and
  the table is the one place both see. Table `activity_capture`, keyed by the activity row's
  `request_id`, so the writer need not know the row's id (its COPY returns none): the GET
  finds the row by id, then its capture.
- **Written by the activity writer's thread in the same batch as its row**: the request only
  hands a `Pending` over with the row (O(1)); redaction, compression (zlib, the stdlib's; not
  llama-swap's zstd+CBOR, which would be a dependency) and the insert all happen off the
  request's path. A capture write that fails is logged and dropped, never retried: the rows
  of its batch are written already.
- **Bounded**: the compressed captures together stay within `captureBuffer` MB, the oldest
  deleted first after each batch; a response body is teed into memory only up to the same
  budget (past it the capture is dropped, as llama-swap drops one too large for its cache).
- **Off costs nothing per chunk**: the consumer checks the catalog's `capture_buffer_mb` once
  per request, and `_capture is None` as the answer starts and as the row goes; the relay
  tees by wrapping its feed only when capturing.
- **No secret**: `Authorization`, `Proxy-Authorization`, `Cookie`, `Set-Cookie` and
  `X-Api-Key` read `[REDACTED]`, as llama-swap writes it; a gpuproxy key is read from no
  other header (`auth.authorize`, `auth.credential_drop`). Captures hold prompts and
  answers: admin keys only (docs/security.md).
- **llama-swap's shape**: per-route masks (no audio or image bodies), a failed (non-200)
  request keeps its request side and response headers only, bodies in the JSON as base64
  (Go's `[]byte`), header names in Go's canonical form with their first value.
"""

from __future__ import annotations

import base64
import json
import logging
import struct
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("activity.captures")

# The key under which a row handed to the writer carries its capture.
ROW_KEY = "capture"
REDACTED = "[REDACTED]"
SENSITIVE = frozenset({b"authorization", b"proxy-authorization", b"cookie", b"set-cookie",
                       b"x-api-key", b"x-csrftoken",
                       b"x-gpuproxy-fleet"})  # the fleet's key (gpuproxy/proxy/fleet_forward)

REQ_HEADERS, REQ_BODY, RESP_HEADERS, RESP_BODY = 1, 2, 4, 8
ALL = REQ_HEADERS | REQ_BODY | RESP_HEADERS | RESP_BODY
# llama-swap's captureFieldsByPath (internal/server/captures.go): routes with binary bodies.
MASKS = {
    "/v1/audio/speech": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/v1/audio/voices": REQ_HEADERS | RESP_HEADERS | RESP_BODY,
    "/v1/audio/transcriptions": REQ_HEADERS | RESP_HEADERS | RESP_BODY,
    "/v1/images/generations": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/v1/images/edits": REQ_HEADERS | RESP_HEADERS,
    "/sdapi/v1/txt2img": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/sdapi/v1/img2img": REQ_HEADERS | RESP_HEADERS,
}
_META_LENGTH = struct.Struct(">I")

Headers = Iterable[tuple[bytes, bytes]]


class Pending:
    """One request's capture as the request goes: filled by the consumer, packed on the
    writer's thread (`pack`)."""

    __slots__ = ("budget", "mask", "over", "req_body", "req_headers", "req_path",
                 "resp_chunks", "resp_headers", "resp_size")

    def __init__(self, budget_mb: int, req_path: str, route: str, req_headers: Headers,
                 req_body: bytes) -> None:
        """`route`: the model-dispatched path whose mask applies (without `/upstream/<m>`)."""
        self.budget = budget_mb * 1024 * 1024
        self.mask = MASKS.get(route, ALL)
        self.req_path = req_path
        self.req_headers = list(req_headers) if self.mask & REQ_HEADERS else None
        self.req_body = req_body if self.mask & REQ_BODY else None
        self.resp_headers: list[tuple[bytes, bytes]] | None = None
        self.resp_chunks: list[bytes] = []
        self.resp_size = 0
        # more than the budget: no capture (its compressed form would not fit either, nearly)
        self.over = self.req_body is not None and len(self.req_body) > self.budget

    def tee(self, feed: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """`feed`, also keeping each chunk of the answer (up to the budget)."""
        if not self.mask & RESP_BODY:
            return feed

        def both(chunk: bytes) -> None:
            feed(chunk)
            if not self.over:
                self.resp_size += len(chunk)
                if self.resp_size > self.budget:
                    self.over = True
                    self.resp_chunks = []
                else:
                    self.resp_chunks.append(chunk)

        return both

    def pack(self, status: int) -> bytes | None:
        """The capture compressed (on the writer's thread), or None when over the budget.
        A failed request (not 200) keeps its request side and response headers only."""
        if self.over:
            return None
        resp_body = (b"".join(self.resp_chunks)
                     if self.mask & RESP_BODY and status == 200 else None)
        meta = {
            "req_path": self.req_path,
            "req_headers": header_map(self.req_headers),
            "resp_headers": (header_map(self.resp_headers, drop=b"content-encoding")
                             if self.mask & RESP_HEADERS and self.resp_headers is not None
                             else None),
            "req_body": -1 if self.req_body is None else len(self.req_body),
            "resp_body": -1 if resp_body is None else len(resp_body),
        }
        head = json.dumps(meta).encode()
        packed = zlib.compress(b"".join((_META_LENGTH.pack(len(head)), head,
                                         self.req_body or b"", resp_body or b"")))
        return packed if len(packed) <= self.budget else None


def header_map(headers: Headers | None, drop: bytes = b"") -> dict[str, str] | None:
    """Headers as llama-swap's capture has them: Go's canonical names (`Content-Type`), the
    first value of each, secrets `[REDACTED]`."""
    if headers is None:
        return None
    out: dict[str, str] = {}
    for raw_name, value in headers:
        name = raw_name.lower()
        if name == drop:
            continue
        key = "-".join(part.capitalize() for part in name.decode("latin-1").split("-"))
        if key not in out:
            out[key] = REDACTED if name in SENSITIVE else value.decode("latin-1")
    return out


def unpack(data: bytes) -> dict[str, Any]:
    """A stored capture as `GET /api/captures/{id}` answers it (llama-swap's JSON)."""
    raw = zlib.decompress(data)
    (n,) = _META_LENGTH.unpack_from(raw)
    meta = json.loads(raw[4:4 + n])
    at = 4 + n
    bodies: dict[str, str | None] = {}
    for key in ("req_body", "resp_body"):
        length = meta[key]
        if length < 0:
            bodies[key] = None
        else:
            bodies[key] = base64.b64encode(raw[at:at + length]).decode()
            at += length
    return {"req_path": meta["req_path"], "req_headers": meta["req_headers"],
            "req_body": bodies["req_body"], "resp_headers": meta["resp_headers"],
            "resp_body": bodies["resp_body"]}


def store(rows: list[dict[str, Any]], using: str) -> None:
    """On the writer's thread, after the rows are in: their captures, then the oldest
    captures out until the rest fit the newest budget. Errors are logged, not raised."""
    from django.db import connections, transaction

    from activity.models import Capture

    found = [(row, row[ROW_KEY]) for row in rows if ROW_KEY in row]
    if not found:
        return
    try:
        made = []
        for row, pending in found:
            blob = pending.pack(row["status_code"])
            if blob is not None:
                made.append(Capture(request_id=row["request_id"], size=len(blob), data=blob))
        budget = found[-1][1].budget
        conn = connections[using]
        table = conn.ops.quote_name(Capture._meta.db_table)
        with transaction.atomic(using=using):
            Capture.objects.using(using).bulk_create(made, ignore_conflicts=True)
            with conn.cursor() as cursor:
                # the newest first, summed: from the first that goes past the budget on, out
                cursor.execute(
                    f"DELETE FROM {table} WHERE id <= (SELECT id FROM (SELECT id, SUM(size) "
                    f"OVER (ORDER BY id DESC) AS total FROM {table}) AS newest WHERE total > %s "
                    f"ORDER BY id DESC LIMIT 1)", [budget])
    except Exception as exc:  # a capture is never worth a row: the rows are written already
        logger.warning("activity writer: %d captures not stored (%s: %s)", len(found),
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def find(log_id: int) -> dict[str, Any] | None:
    """The capture of activity row `log_id`, or None (never stored, or evicted)."""
    from activity.models import Capture, RequestLog

    request_id = (RequestLog.objects.filter(id=log_id)
                  .values_list("request_id", flat=True).first())
    if request_id is None:
        return None
    data = Capture.objects.filter(request_id=request_id).values_list("data", flat=True).first()
    if data is None:
        return None
    return {"id": log_id, **unpack(bytes(data))}


def having(request_ids: Iterable[uuid.UUID]) -> set[uuid.UUID]:
    """Which of these activity rows have a capture (the activity listing's `has_capture`)."""
    from activity.models import Capture

    return set(Capture.objects.filter(request_id__in=list(request_ids))
               .values_list("request_id", flat=True))
