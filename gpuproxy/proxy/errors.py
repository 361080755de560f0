"""The OpenAI error envelope: every error this proxy answers has this one shape, so every
client library shows its message (`{"error": {"message", "type", "param", "code"}}`).

Built here only: the proxy consumer, Django's views (`decorators.json_error`), the edge's
refusals on the request head (edge.py), the exposure policy and the guard all call it.
"""

from __future__ import annotations

import json


def error_body(message: str, type_: str = "invalid_request_error",
               code: str | None = None, param: str | None = None) -> bytes:
    """`param` names the request parameter at fault, where there is one."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                 "code": code}}).encode()
