"""What makes a request impossible to send upstream as it is, found before anything else is
done with it: the upstream client refuses control characters in the URL (httpx's
`InvalidURL`) and in header values (aiohttp, all but tab), while Twisted lets all but NUL, CR
and LF through in header values. A 400 that says which, not a 500 from deep in the relay."""

from __future__ import annotations

import re
from typing import Any

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES = re.compile(rb"[\x00-\x1f\x7f]")
_CONTROL_IN_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def malformed_request(scope: dict[str, Any]) -> tuple[str, str, str] | None:
    """(message, type, code) for the 400; None when nothing is wrong."""
    if _CONTROL.search(scope["path"]) or _CONTROL_BYTES.search(scope.get("query_string", b"")):
        return ("the path or query string contains a control character (percent-encoded "
                "%00-%1F or %7F in the path, or raw in the query)", "invalid_request_error",
                "invalid_url")
    if _CONTROL_IN_VALUE.search(b"".join([v for _, v in scope["headers"]])):
        return ("a request header value contains a control character other than tab "
                "(RFC 9110 5.5)", "invalid_request_error", "invalid_header")
    return None
