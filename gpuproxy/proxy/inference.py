"""Reading an inference request: which model it wants, whether it streams, and the body to send.

Plain functions over bytes and dicts, no Django, so the proxy path pays for nothing it does not
use: the JSON body is parsed once, and re-encoded only when a filter or `useModelName` changed
it. Multipart bodies (audio transcriptions, image edits) are scanned for their `model` field
without decoding the files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate, dropwhile
from typing import Any
from urllib.parse import parse_qs, urlencode

# The inference paths llama-swap dispatches by model (plus its versionless `/v/...` aliases).
JSON_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/v1/rerank", "/v1/reranking", "/rerank", "/reranking", "/infill", "/completion",
    "/v1/messages", "/v1/messages/count_tokens", "/v1/audio/speech", "/v1/audio/voices",
    "/v1/images/generations",
})
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/images/edits"})
# Model-dispatched reads, GET only, the model in `?model=` (llama-swap's `modelGetRoutes`; a
# POST to llama-server's `/props` changes the server, which llama-swap does not route either).
# Not logged: a page polling a model's props is not an inference request (llama-swap records
# none of them either).
GET_ONLY_PATHS = frozenset({"/props"})
VERSIONLESS = {"/v/" + p[len("/v1/"):]: p for p in JSON_PATHS if p.startswith("/v1/")}
INFERENCE_PATHS = JSON_PATHS | FORM_PATHS | GET_ONLY_PATHS | frozenset(VERSIONLESS)
# What ProxyConsumer answers (routing.py): the inference paths, the model list, `/upstream/...`.
PROXY_PATTERN = "^(" + "|".join(sorted(
    p.lstrip("/").replace(".", r"\.") for p in INFERENCE_PATHS | {"/v1/models", "/models"}
)) + r")$|^upstream/"

# The deepest JSON nesting accepted in a body (the body's own object is level 1).
MAX_JSON_DEPTH = 512

_NOT_TEXT = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_BOUNDARY = re.compile(rb'boundary="?([^";]+)"?', re.I)
_DISPOSITION_NAME = re.compile(rb'name="([^"]*)"', re.I)


class BadRequest(Exception):
    """The client's request cannot be proxied; `status` and `code` for the OpenAI envelope."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass
class Parsed:
    model: str  # as requested (an id, an alias or unknown)
    stream: bool
    body: bytes
    json_body: dict[str, Any] | None = None
    form_kind: str = ""  # "multipart" | "urlencoded" | ""
    boundary: bytes = b""


def content_type(headers: dict[bytes, bytes]) -> bytes:
    return headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()


def parse(method: str, path: str, query: str, headers: dict[bytes, bytes], body: bytes
          ) -> Parsed:
    """Find the model and the stream flag; raise BadRequest with what to fix."""
    ctype = content_type(headers)
    params = parse_qs(query) if query else {}
    query_model = (params.get("model") or [""])[0]
    query_stream = (params.get("stream") or [""])[0].lower() == "true"
    if ctype == b"multipart/form-data":
        m = _BOUNDARY.search(headers.get(b"content-type", b""))
        if not m:
            raise BadRequest(400, "multipart body without a boundary in Content-Type")
        boundary = m.group(1)
        fields = multipart_fields(body, boundary, {b"model", b"stream"})
        model = fields.get(b"model", b"").decode(errors="replace") or query_model
        stream = fields.get(b"stream", b"").lower() == b"true" or query_stream
        parsed = Parsed(model, stream, body, form_kind="multipart", boundary=boundary)
    elif ctype == b"application/x-www-form-urlencoded":
        form = parse_qs(body.decode(errors="replace"))
        model = (form.get("model") or [""])[0] or query_model
        stream = (form.get("stream") or [""])[0].lower() == "true" or query_stream
        parsed = Parsed(model, stream, body, form_kind="urlencoded")
    elif body.strip() or method in ("POST", "PUT", "PATCH"):
        data = loads(body)
        if not isinstance(data, dict):
            raise BadRequest(400, "the request body must be a JSON object", "invalid_json")
        model = data.get("model", query_model)
        if not isinstance(model, str):
            raise BadRequest(400, "`model` must be a string", "invalid_model")
        stream = data.get("stream") is True or query_stream
        parsed = Parsed(model, stream, body, json_body=data)
    else:
        parsed = Parsed(query_model, query_stream, body)
    if not parsed.model:
        raise BadRequest(400, "no model given: set `model` in the JSON body, the form, or "
                              "?model=", "missing_model")
    if _NOT_TEXT.search(parsed.model):
        # No model is named so; and a lone surrogate cannot even be stored in the activity
        # log (UTF-8 refuses it), nor NUL in PostgreSQL text.
        raise BadRequest(400, f"`model` {parsed.model!r} contains a control character or a "
                              "lone surrogate", "invalid_model")
    return parsed


# A JSON string (its closing quote optional, so an unterminated one ends the scan instead of
# being retried from every later quote: linear time).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DELTA = [0] * 256
_DELTA[ord("[")] = _DELTA[ord("{")] = 1
_DELTA[ord("]")] = _DELTA[ord("}")] = -1


def too_deep(text: str, limit: int) -> bool:
    """Whether `text` nests arrays and objects more than `limit` levels deep (`{}` is one
    level); brackets inside strings do not count. Linear and in C throughout: strings go in
    one regex pass, everything but brackets in one `translate`, and the running depth stops
    at the first level past `limit`."""
    brackets = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass").translate(
        None, _NOT_BRACKETS)
    return next(dropwhile(limit.__ge__, accumulate(map(_DELTA.__getitem__, brackets))),
                None) is not None


def loads(body: bytes) -> Any:
    """The JSON document in `body`, or BadRequest: not JSON (also numbers over Python's
    4300-digit limit), or nested deeper than MAX_JSON_DEPTH.

    The stdlib parser recurses once per level and would raise RecursionError near 1000
    levels (less on a deep stack), so the depth is checked first: cheaply, as a body with
    fewer brackets than the limit cannot be too deep."""
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"the request body is not valid JSON: {exc}",
                         "invalid_json") from None
    if (body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
            and too_deep(text, MAX_JSON_DEPTH)):
        raise BadRequest(400, "the request body nests JSON arrays and objects more than "
                              f"{MAX_JSON_DEPTH} levels deep, the most accepted",
                         "json_too_deep")
    try:
        return json.loads(text)
    except RecursionError:  # not reachable within MAX_JSON_DEPTH; never a 500 regardless
        raise BadRequest(400, "the request body nests JSON too deeply", "json_too_deep"
                         ) from None
    except ValueError as exc:  # JSONDecodeError, or an integer over int()'s digit limit
        raise BadRequest(400, f"the request body is not valid JSON: {exc}",
                         "invalid_json") from None


def multipart_fields(body: bytes, boundary: bytes, names: set[bytes]) -> dict[bytes, bytes]:
    """The values of small text fields `names`; file parts are skipped, never decoded."""
    out: dict[bytes, bytes] = {}
    for part in body.split(b"--" + boundary):
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        m = _DISPOSITION_NAME.search(head)
        if m and m.group(1) in names:
            out[m.group(1)] = value.removesuffix(b"\r\n")
    return out


def replace_multipart_field(body: bytes, boundary: bytes, name: bytes, value: bytes) -> bytes:
    parts = body.split(b"--" + boundary)
    for i, part in enumerate(parts):
        head, sep, _old = part.partition(b"\r\n\r\n")
        m = _DISPOSITION_NAME.search(head) if sep else None
        if m and m.group(1) == name:
            parts[i] = head + sep + value + b"\r\n"
    return (b"--" + boundary).join(parts)


def apply_filters(parsed: Parsed, *, requested: str, use_model_name: str,
                  strip_params: tuple[str, ...], set_params: dict[str, Any],
                  set_params_by_id: dict[str, dict[str, Any]],
                  vllm_priority: int | None = None) -> bytes:
    """The body to send upstream: llama-swap's filters, `model` always protected; with
    `vllm_priority`, our priority in vLLM's `priority` field (negated: vLLM serves lower
    values first), unless the client set one itself."""
    by_id = set_params_by_id.get(requested) or {}
    if parsed.json_body is not None:
        add_priority = vllm_priority is not None and "priority" not in parsed.json_body
        if not (use_model_name or strip_params or set_params or by_id or add_priority):
            return parsed.body
        data = dict(parsed.json_body)
        if add_priority and vllm_priority is not None:
            data["priority"] = -vllm_priority
        for key in strip_params:
            if key != "model":
                data.pop(key, None)
        for params in (set_params, by_id):
            for key, value in params.items():
                if key != "model":
                    data[key] = value
        if use_model_name:
            data["model"] = use_model_name
        return json.dumps(data, separators=(",", ":")).encode()
    if use_model_name and parsed.form_kind == "multipart":
        return replace_multipart_field(parsed.body, parsed.boundary, b"model",
                                       use_model_name.encode())
    if use_model_name and parsed.form_kind == "urlencoded":
        form = parse_qs(parsed.body.decode(errors="replace"), keep_blank_values=True)
        form["model"] = [use_model_name]
        return urlencode(form, doseq=True).encode()
    return parsed.body
