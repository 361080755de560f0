"""The error envelopes: every error this proxy answers has one of two shapes, built here only,
so every client library shows its message.

- OpenAI's, `{"error": {"message", "type", "param", "code"}}`, everywhere but:
- Anthropic's, `{"type": "error", "error": {"type", "message"}}`, on Anthropic's own paths
  (`/v1/messages`, `/v1/messages/count_tokens`): the Anthropic SDK reads only that shape, and
  shows a bare status without the message otherwise. The status is unchanged; the type is
  Anthropic's for the status (theirs are one per status, ours are finer: the `code`, which
  their shape has no room for, stays in the OpenAI form only). An upstream's own error body is
  relayed as it is, whatever its shape: it is not ours to rewrite.

The proxy consumer, Django's views (`decorators.json_error`), the edge's refusals on the
request head (edge.py), the exposure policy and the guard all call this module.
"""

from __future__ import annotations

import json

# With llama-swap's versionless aliases (`/v/messages`, gpuproxy/proxy/inference.py VERSIONLESS).
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens", "/v/messages",
                             "/v/messages/count_tokens"})

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors"); any other 4xx is the
# request's fault, any other 5xx ours.
_ANTHROPIC_TYPE = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}


def error_body(message: str, type_: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> bytes:
    """`param` names the request parameter at fault, where there is one."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                 "code": code}}).encode()


def anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPE:
        return _ANTHROPIC_TYPE[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": anthropic_type(status),
                                                  "message": message}}).encode()


def error_body_for(path: str, status: int, message: str,
                   type_: str = "invalid_request_error", code: str | None = None) -> bytes:
    """The envelope the client on `path` reads (see the module's docstring)."""
    if path in ANTHROPIC_PATHS:
        return anthropic_error_body(status, message)
    return error_body(message, type_, code)


def for_path(path: str, status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error `body` of ours in the shape the client on `path` reads: for the
    callers that build the OpenAI one first (the proxy consumer's many refusals)."""
    if path not in ANTHROPIC_PATHS:
        return body
    return anthropic_error_body(status, json.loads(body)["error"]["message"])
