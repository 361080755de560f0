"""`/dashboard/captures`: the recent requests that have a capture (`captureBuffer` > 0,
activity/captures.py), and one opened: its request and response headers (redacted as
stored) and bodies made readable here, once, rather than in the page's script (`body`).

`listing` and `detail` take the staff session, not an API key (dashboard/pages/common.py);
with captures off both say so, and the page says how to turn them on.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, JsonResponse

from dashboard.pages.common import is_staff, json_error, not_staff, render_page
from gpuproxy.shell import runtime

LISTED = 200  # the newest captures listed
NOT_KEPT = ("not kept: a failed (non-200) answer keeps no body, and routes with binary "
            "bodies (audio, images) keep none on that side")


@staff_member_required
async def page(request: HttpRequest) -> HttpResponse:
    catalog = (await runtime.port()).catalog
    return await render_page(request, "dashboard/captures.html",
                             {"buffer_mb": catalog.capture_buffer_mb})


def _piece(event: Any) -> str:
    """The text one streamed event adds to the answer: OpenAI's `choices[].delta.content`
    (or `.text`), Anthropic's `delta.text`; "" for anything else."""
    if not isinstance(event, dict):
        return ""
    out = []
    for choice in event.get("choices") or []:
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            out.append(text if isinstance(text, str) else "")
    delta = event.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("text"), str):
        out.append(delta["text"])
    return "".join(out)


def _sse(text: str) -> tuple[list[dict[str, Any]], str]:
    """The events of a text/event-stream body, each `data` on one line (JSON re-serialised,
    `[DONE]` and comments as they are), and the answer's text put back together."""
    events, pieces = [], []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data, comments = "message", [], []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if line.startswith(":"):
                comments.append(line[1:].strip())
            elif field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if not data and not comments:
            continue
        joined = "\n".join(data)
        try:
            parsed = json.loads(joined)
            shown, is_json = json.dumps(parsed, ensure_ascii=False), True
            pieces.append(_piece(parsed))
        except ValueError:
            shown, is_json = joined, False
        events.append({"event": name if data else "comment",
                       "data": shown if data else "\n".join(comments), "json": is_json})
    return events, "".join(pieces)


def body(encoded: str | None, headers: dict[str, str] | None) -> dict[str, Any]:
    """A stored body (base64, as `/api/captures` gives it) as the page shows it: `kind`
    none, empty, binary (with its size only), sse (its events, and the streamed answer's text
    put back together), json (pretty) or text."""
    if encoded is None:
        return {"kind": "none", "note": NOT_KEPT}
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return {"kind": "binary", "size": len(encoded), "note": "not base64"}
    content_type = ((headers or {}).get("Content-Type") or "").lower()
    if not raw:
        return {"kind": "empty", "size": 0}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"kind": "binary", "size": len(raw), "content_type": content_type}
    if "text/event-stream" in content_type or text.lstrip().startswith(("data:", "event:")):
        events, answer = _sse(text)
        return {"kind": "sse", "size": len(raw), "events": events, "answer": answer}
    try:
        pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return {"kind": "text", "size": len(raw), "text": text}
    return {"kind": "json", "size": len(raw), "text": pretty}


def present(capture: dict[str, Any]) -> dict[str, Any]:
    """`activity.captures.find`'s answer, its bodies made readable."""
    return {
        "id": capture["id"],
        "req_path": capture["req_path"],
        "request": {"headers": capture["req_headers"],
                    "body": body(capture["req_body"], capture["req_headers"])},
        "response": {"headers": capture["resp_headers"],
                     "body": body(capture["resp_body"], capture["resp_headers"])},
    }


def _recent() -> list[dict[str, Any]]:
    from activity.models import Capture, RequestLog

    ids = list(Capture.objects.order_by("-id").values_list("request_id", flat=True)[:LISTED])
    rows = (RequestLog.objects.filter(request_id__in=ids).order_by("-id")
            .values("id", "received_at", "model", "method", "path", "status_code", "outcome",
                    "stream", "duration_ms"))
    return [{**row, "received_at": row["received_at"].isoformat()} for row in rows]


async def may_read_captures(request: HttpRequest) -> bool:
    """Captures hold whole prompts and answers (over the API, admin keys only): a staff
    member needs the permission to view captures too (a superuser has it)."""
    user = await request.auser()
    return bool(await user.ahas_perm("activity.view_capture"))


def no_permission() -> HttpResponse:
    return json_error(403, "your account may not view captures: a superuser can grant it the "
                           "permission 'activity | capture | Can view capture' in the admin",
                      type_="permission_error", code="permission_required")


def _off() -> HttpResponse:
    return json_error(404, "capture not found: captures are off (captureBuffer: 0)",
                      code="capture_not_found")


async def listing(request: HttpRequest) -> HttpResponse:
    """The newest `LISTED` activity rows that have a capture, newest first."""
    if not await is_staff(request):
        return not_staff()
    if not await may_read_captures(request):
        return no_permission()
    if not (await runtime.port()).catalog.capture_buffer_mb:
        return _off()
    return JsonResponse({"enabled": True, "captures": await runtime.run_db(_recent)})


async def detail(request: HttpRequest, log_id: int) -> HttpResponse:
    """One capture, by its activity row's id."""
    from activity import captures

    if not await is_staff(request):
        return not_staff()
    if not await may_read_captures(request):
        return no_permission()
    if not (await runtime.port()).catalog.capture_buffer_mb:
        return _off()
    found = await runtime.run_db(lambda: captures.find(log_id))
    if found is None:
        return json_error(404, f"capture {log_id} not found: evicted by newer ones, or never "
                               "stored", code="capture_not_found")
    return JsonResponse(present(found))
