"""Token counts and speeds read from an upstream response while it streams to the client.

Standard library only (no Django, no asyncio): the proxy calls `UsageParser.feed` with every
raw response chunk it relays and `UsageParser.finish` once the response is over.

Parity with llama-swap's activity log (reference notes §5.2):

* ``text/event-stream`` is parsed incrementally: events are split on blank lines (``\\n``,
  ``\\r\\n`` or ``\\r`` line endings), only ``data:`` lines count, ``[DONE]`` is skipped. An
  event is json-decoded only if its bytes mention ``"usage"``, ``"timings"`` or ``"metrics"``,
  so the token-by-token chunks of a stream cost a substring search and nothing more. The last
  value seen for each field wins (fields absent from a later event keep their earlier value,
  which is how Anthropic's ``message_start`` input tokens combine with ``message_delta``'s
  output tokens).
* Any other (JSON) response is accumulated up to a cap (8 MiB by default) and parsed at
  `finish`; past the cap the parser gives up and reports nothing.
* Usage objects are read from ``usage``, ``response.usage`` (Responses API) and
  ``message.usage`` (Anthropic ``message_start``).

Token counts have ONE meaning whatever the backend (issue 20; the table in docs/activity.md),
unlike llama-swap, whose ``input_tokens`` is llama.cpp's uncached ``prompt_n`` but vLLM's
cached-inclusive ``prompt_tokens``, so that a sum over models adds unlike things:

* ``input_tokens``: every prompt token, cached ones included. OpenAI, vLLM and llama.cpp's
  ``usage.prompt_tokens`` (and the Responses API's ``input_tokens``) already count them;
  Anthropic's ``input_tokens`` leaves out ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``, which are added; llama.cpp's ``timings`` (the native
  ``/completion`` has no usage) give ``prompt_n`` (uncached) + ``cache_n``.
* ``cached_tokens``: the part of ``input_tokens`` read from a prompt cache: llama.cpp's
  ``timings.cache_n``, else ``prompt_tokens_details``/``input_tokens_details.cached_tokens``,
  else Anthropic's ``cache_read_input_tokens``.
* ``output_tokens``: ``completion_tokens|output_tokens``, else llama.cpp's ``predicted_n``.
  A stream that ends with no count (the client left, the upstream died) gets the number of
  ``data:`` events it relayed (``output_counted``): one per token for llama.cpp and vLLM, plus
  the role and finish events of a chat stream, so an upper bound of the GPU work wasted.
* ``draft_tokens``/``draft_accepted_tokens``: llama.cpp's ``timings.draft_n`` and
  ``draft_n_accepted``, vLLM's ``metrics.speculative_decoding`` (``num_draft_tokens``,
  ``num_accepted_draft_tokens``, with ``--per-request-spec-decode-metrics``); both or neither,
  as llama-swap reads them, so an acceptance rate never comes from half an object.
* Speeds: llama.cpp's ``prompt_per_second``/``predicted_per_second``, else vLLM's
  ``metrics``: prompt speed = uncached prompt tokens / ``time_to_first_token_ms`` (as
  llama-swap computes it), generation speed = 1000 / ``mean_itl_ms``.
* A JSON array (llama.cpp ``/infill``) is read through its last element.

The body must be the decoded bytes (no gzip). Malformed input never raises: unknown values
are None.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_JSON_BYTES", "Usage", "UsageParser", "parse_body"]

#: Largest non-streaming body (or single SSE event) that is kept for parsing.
DEFAULT_MAX_JSON_BYTES = 8 * 1024 * 1024

_MARKERS = (b'"usage"', b'"timings"', b'"metrics"')


@dataclass(frozen=True, slots=True)
class Usage:
    """What a response said about itself; None means unknown."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_tps: float | None = None
    generation_tps: float | None = None
    draft_tokens: int | None = None
    draft_accepted_tokens: int | None = None
    #: output_tokens is the count of events relayed, not a number the upstream reported
    output_counted: bool = False

    # The columns' names before issue 20, kept as aliases (docs/activity.md).
    @property
    def prompt_tokens(self) -> int | None:
        return self.input_tokens

    @property
    def completion_tokens(self) -> int | None:
        return self.output_tokens


def _int(value: Any) -> int | None:
    """A non-negative integer count, or None (bools, negatives, fractions, NaN are rejected)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value.is_integer():
        return int(value)
    return None


def _float(value: Any) -> float | None:
    """A finite non-negative number as a float, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) and result >= 0 else None


def _first(*values: Any) -> int | None:
    for value in values:
        result = _int(value)
        if result is not None:
            return result
    return None


def _sub(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


class UsageParser:
    """Feed it the raw response chunks as relayed; `finish` returns the `Usage`."""

    def __init__(self, content_type: str, *, max_bytes: int = DEFAULT_MAX_JSON_BYTES) -> None:
        ctype = (content_type or "").lower()
        self._sse = "text/event-stream" in ctype
        self._max = max_bytes
        self._result: Usage | None = None
        # usage-level values (OpenAI / Responses / Anthropic), last seen wins per field
        self._u_prompt: int | None = None
        self._u_completion: int | None = None
        self._u_cached: int | None = None
        # Anthropic's cache counts, which its input_tokens leaves out
        self._u_cache_read: int | None = None
        self._u_cache_creation: int | None = None
        # llama.cpp timings: counts where usage has none, and the speeds
        self._t_prompt: int | None = None
        self._t_completion: int | None = None
        self._t_cached: int | None = None
        self._t_prompt_tps: float | None = None
        self._t_generation_tps: float | None = None
        self._draft: tuple[int, int] | None = None  # (drafted, accepted)
        # vLLM metrics
        self._m_ttft_ms: float | None = None
        self._m_generation_tps: float | None = None
        self._events = 0  # SSE events with data relayed, [DONE] aside
        # SSE state: a held-back trailing "\r", the unterminated line, the current event
        self._cr = False
        self._line = b""
        self._skip_line = False
        self._data: list[bytes] = []
        self._data_size = 0
        self._pending = b""  # an unfinished event, skipped so far (`_feed_sse`)
        # JSON state
        self._chunks: list[bytes] = []
        self._size = 0
        self._overflow = False

    # ------------------------------------------------------------------ input

    def feed(self, chunk: bytes) -> None:
        """Take the next raw chunk; it may split lines, events and JSON anywhere."""
        if not chunk or self._result is not None:
            return
        if self._sse:
            self._feed_sse(bytes(chunk))
        elif not self._overflow:
            self._size += len(chunk)
            if self._size > self._max:
                self._overflow = True
                self._chunks = []
            else:
                self._chunks.append(bytes(chunk))

    def finish(self) -> Usage:
        """End of the response: parse what is pending and return the numbers (idempotent)."""
        if self._result is None:
            try:
                if self._sse:
                    # Lenient about a last event with no blank line after it; a truncated one
                    # simply fails to decode.
                    if self._pending:
                        pending, self._pending = self._pending, b""
                        self._parse_sse(pending)
                    self._cr = False
                    self._end_line()
                    self._dispatch()
                elif not self._overflow and self._chunks:
                    self._apply_document(b"".join(self._chunks))
            except Exception:  # never let a parsing bug reach the proxy
                pass
            self._chunks = []
            self._data = []
            self._line = b""
            self._result = self._build()
        return self._result

    # ------------------------------------------------------------------ SSE

    def _feed_sse(self, chunk: bytes) -> None:
        if not (self._cr or self._line or self._data or self._skip_line or self._data_size):
            # At an event boundary: the bytes since it (`_pending`, the start of an event
            # not yet ended) and this chunk. When none of them carries usage, every whole
            # event in them is skipped unparsed and only the unfinished one is kept: the
            # token chunks of a stream, nearly every chunk, wherever the reads split them.
            # Three substring searches instead of a line split per chunk (BENCHMARKS.md).
            # A read that holds the usage event (often most of a fast stream's events at
            # once) is parsed from the event boundary before the first marker on.
            pending = self._pending
            buf = pending + chunk if pending else chunk
            self._pending = b""
            if b"\r" not in buf:
                if (_MARKERS[0] not in buf and _MARKERS[1] not in buf
                        and _MARKERS[2] not in buf):  # three searches, nearly every chunk
                    end = buf.rfind(b"\n\n")
                    rest = buf[end + 2:] if end >= 0 else buf
                    if len(rest) <= self._max:
                        if end >= 0:
                            self._count_skipped(buf, end + 2)
                        self._pending = rest
                        return
                else:
                    first = min(at for at in map(buf.find, _MARKERS) if at >= 0)
                    end = buf.rfind(b"\n\n", 0, first)
                    if end >= 0:
                        self._count_skipped(buf, end + 2)
                        buf = buf[end + 2:]
            chunk = buf
        self._parse_sse(chunk)

    def _count_skipped(self, buf: bytes, end: int) -> None:
        """Count the whole events in `buf[:end]`, which the fast path skips unparsed: one per
        blank line (a comment-only event counts too: llama.cpp and vLLM send none)."""
        self._events += buf.count(b"\n\n", 0, end) - buf.count(b"data: [DONE]", 0, end)

    def _parse_sse(self, chunk: bytes) -> None:
        """The line-by-line parser, from wherever the last chunk left it."""
        if self._cr:
            chunk = b"\r" + chunk
            self._cr = False
        if chunk.endswith(b"\r"):  # may be the first half of a "\r\n"
            chunk = chunk[:-1]
            self._cr = True
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            self._extend_line(chunk)
            return
        self._extend_line(lines[0])
        self._end_line()
        for line in lines[1:-1]:
            self._handle_line(line)
        self._extend_line(lines[-1])

    def _extend_line(self, part: bytes) -> None:
        if not part or self._skip_line:
            return
        if len(self._line) + len(part) > self._max:
            self._line = b""
            self._skip_line = True
        else:
            self._line += part

    def _end_line(self) -> None:
        line, skipped = self._line, self._skip_line
        self._line = b""
        self._skip_line = False
        if skipped:
            self._drop_event()
        else:
            self._handle_line(line)

    def _handle_line(self, line: bytes) -> None:
        if not line:
            self._dispatch()
        elif line.startswith(b"data:"):
            value = line[6:] if line[5:6] == b" " else line[5:]
            self._data_size += len(value)
            if self._data_size > self._max:
                self._drop_event()  # this event's later data lines are ignored too
            else:
                self._data.append(value)
        # "event:", "id:", "retry:" and ":" comments carry nothing we need

    def _drop_event(self) -> None:
        """Forget an oversized event; the size stays over the cap until its blank line."""
        self._data = []
        self._data_size = self._max + 1

    def _dispatch(self) -> None:
        data = self._data
        self._data = []
        self._data_size = 0
        if not data:
            return
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if payload != b"[DONE]":
            self._events += 1
        if not (_MARKERS[0] in payload or _MARKERS[1] in payload or _MARKERS[2] in payload):
            return  # token chunks and [DONE] end here
        self._apply_document(payload)

    # ------------------------------------------------------------------ extraction

    def _apply_document(self, payload: bytes) -> None:
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return
        if isinstance(obj, list):  # /infill: the last element holds the timings
            obj = obj[-1] if obj else None
        if isinstance(obj, dict):
            self._apply(obj)

    def _apply(self, obj: dict[str, Any]) -> None:
        for usage in (
            obj.get("usage"),
            _sub(obj.get("response"), "usage"),
            _sub(obj.get("message"), "usage"),
        ):
            if isinstance(usage, dict):
                self._apply_usage(usage)
        timings = obj.get("timings")
        if isinstance(timings, dict):
            self._apply_timings(timings)
        metrics = obj.get("metrics")
        if isinstance(metrics, dict):
            self._apply_metrics(metrics)

    def _apply_usage(self, usage: dict[str, Any]) -> None:
        prompt = _first(usage.get("prompt_tokens"), usage.get("input_tokens"))
        completion = _first(usage.get("completion_tokens"), usage.get("output_tokens"))
        cached = _first(
            _sub(usage.get("input_tokens_details"), "cached_tokens"),
            _sub(usage.get("prompt_tokens_details"), "cached_tokens"),
        )
        cache_read = _int(usage.get("cache_read_input_tokens"))
        cache_creation = _int(usage.get("cache_creation_input_tokens"))
        if prompt is not None:
            self._u_prompt = prompt
        if completion is not None:
            self._u_completion = completion
        if cached is not None:
            self._u_cached = cached
        if cache_read is not None:
            self._u_cache_read = cache_read
        if cache_creation is not None:
            self._u_cache_creation = cache_creation

    def _apply_timings(self, timings: dict[str, Any]) -> None:
        prompt = _int(timings.get("prompt_n"))
        completion = _int(timings.get("predicted_n"))
        cached = _int(timings.get("cache_n"))
        prompt_tps = _float(timings.get("prompt_per_second"))
        generation_tps = _float(timings.get("predicted_per_second"))
        if prompt is not None:
            self._t_prompt = prompt
        if completion is not None:
            self._t_completion = completion
        if cached is not None:
            self._t_cached = cached
        if prompt_tps is not None:
            self._t_prompt_tps = prompt_tps
        if generation_tps is not None:
            self._t_generation_tps = generation_tps
        drafted = _int(timings.get("draft_n"))
        accepted = _int(timings.get("draft_n_accepted"))
        if drafted is not None and accepted is not None:
            self._draft = (drafted, accepted)

    def _apply_metrics(self, metrics: dict[str, Any]) -> None:
        ttft = _float(metrics.get("time_to_first_token_ms"))
        if ttft is not None and ttft > 0:
            self._m_ttft_ms = ttft
        itl = _float(metrics.get("mean_itl_ms"))
        if itl is not None and itl > 0:
            self._m_generation_tps = 1000.0 / itl
        spec = metrics.get("speculative_decoding")
        if isinstance(spec, dict):
            drafted = _int(spec.get("num_draft_tokens"))
            accepted = _int(spec.get("num_accepted_draft_tokens"))
            if drafted is not None and accepted is not None:
                self._draft = (drafted, accepted)

    def _build(self) -> Usage:
        def pick(first: Any, then: Any) -> Any:
            return first if first is not None else then

        # Usage first (what the client saw), the timings where it has none.
        anthropic = self._u_cache_read is not None or self._u_cache_creation is not None
        prompt = self._u_prompt
        if prompt is not None and anthropic:  # its input_tokens excludes the cache's
            prompt += (self._u_cache_read or 0) + (self._u_cache_creation or 0)
        if prompt is None and self._t_prompt is not None:  # prompt_n is the uncached part
            prompt = self._t_prompt + (self._t_cached or 0)
        cached = pick(self._t_cached, pick(self._u_cached, self._u_cache_read))
        output = pick(self._u_completion, self._t_completion)
        counted = output is None and self._sse and self._events > 0
        if counted:
            output = self._events
        prompt_tps = self._t_prompt_tps
        if prompt_tps is None and self._m_ttft_ms is not None and prompt is not None:
            prompt_tps = max(prompt - (cached or 0), 0) * 1000.0 / self._m_ttft_ms
        draft = self._draft
        return Usage(
            input_tokens=prompt,
            output_tokens=output,
            cached_tokens=cached,
            prompt_tps=prompt_tps,
            generation_tps=pick(self._t_generation_tps, self._m_generation_tps),
            draft_tokens=draft[0] if draft else None,
            draft_accepted_tokens=draft[1] if draft else None,
            output_counted=counted,
        )


def parse_body(content_type: str, body: bytes, *, max_bytes: int = DEFAULT_MAX_JSON_BYTES) -> Usage:
    """`Usage` of a whole response body (SSE or JSON), in one call."""
    parser = UsageParser(content_type, max_bytes=max_bytes)
    parser.feed(body)
    return parser.finish()
