"""Issue 20 item 1: the token columns mean the same for every backend.

Each payload is shaped as its backend documents it, and the expected numbers are written from
that backend's documented semantics, not from the parser:

* llama.cpp: `usage.prompt_tokens` counts every prompt token; `timings.prompt_n` only the ones
  evaluated (not from the cache), `timings.cache_n` the cached ones; `draft_n` and
  `draft_n_accepted` with a draft model.
* OpenAI and vLLM: `usage.prompt_tokens` counts cached tokens too, and
  `prompt_tokens_details.cached_tokens` says how many; vLLM's
  `metrics.speculative_decoding` (with `--per-request-spec-decode-metrics`).
* Anthropic: `input_tokens` leaves out `cache_read_input_tokens` and
  `cache_creation_input_tokens`: the prompt is their sum.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from activity.record import RequestRecord
from activity.usage import Usage, UsageParser, parse_body

SSE = "text/event-stream"
JSON = "application/json"


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
                    for e in events)


def feed_split(content_type: str, body: bytes, cuts: list[int]) -> Usage:
    parser = UsageParser(content_type)
    points = [0, *sorted(cuts), len(body)]
    for a, b in itertools.pairwise(points):
        parser.feed(body[a:b])
    return parser.finish()


def columns(u: Usage) -> tuple:
    return (u.input_tokens, u.cached_tokens, u.output_tokens, u.draft_tokens,
            u.draft_accepted_tokens, u.output_counted)


# ---------------------------------------------------------------- llama.cpp

# The issue's own case: the client saw prompt_tokens=25 with 24 of them from the cache.
LLAMACPP_JSON = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"}}],
    "usage": {"prompt_tokens": 25, "completion_tokens": 8, "total_tokens": 33},
    "timings": {"cache_n": 24, "prompt_n": 1, "prompt_ms": 2.0, "prompt_per_second": 500.0,
                "predicted_n": 8, "predicted_ms": 100.0, "predicted_per_second": 80.0,
                "draft_n": 6, "draft_n_accepted": 4},
}


def test_llamacpp_json_counts_cached_prompt_tokens_as_input() -> None:
    got = parse_body(JSON, json.dumps(LLAMACPP_JSON).encode())
    assert columns(got) == (25, 24, 8, 6, 4, False)
    assert (got.prompt_tps, got.generation_tps) == (500.0, 80.0)
    # the old names are aliases of the new ones
    assert (got.prompt_tokens, got.completion_tokens) == (25, 8)


def test_llamacpp_stream_same_numbers() -> None:
    body = sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
               {"choices": [{"index": 0, "delta": {"content": " there"}}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": LLAMACPP_JSON["usage"], "timings": LLAMACPP_JSON["timings"]},
               "[DONE]")
    assert columns(parse_body(SSE, body)) == (25, 24, 8, 6, 4, False)


def test_llamacpp_native_completion_without_usage_adds_cache_n_to_prompt_n() -> None:
    # /completion sends timings only: 1 token evaluated + 24 from the cache = 25
    body = {"content": "x", "timings": {"prompt_n": 1, "cache_n": 24, "predicted_n": 3}}
    assert columns(parse_body(JSON, json.dumps(body).encode())) == (25, 24, 3, None, None,
                                                                     False)


def test_llamacpp_draft_needs_both_counts() -> None:
    body = {"usage": {"prompt_tokens": 2, "completion_tokens": 1},
            "timings": {"draft_n": 6}}  # accepted count missing: no rate from half an object
    got = parse_body(JSON, json.dumps(body).encode())
    assert (got.draft_tokens, got.draft_accepted_tokens) == (None, None)


# ---------------------------------------------------------------- OpenAI and vLLM

OPENAI_USAGE = {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920}}


def test_openai_json() -> None:
    body = {"object": "chat.completion", "choices": [], "usage": OPENAI_USAGE}
    assert columns(parse_body(JSON, json.dumps(body).encode())) == (2006, 1920, 300, None,
                                                                     None, False)


def test_openai_stream_with_include_usage() -> None:
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               {"choices": [{"index": 0, "delta": {"content": "a"}}]},
               {"choices": [], "usage": OPENAI_USAGE}, "[DONE]")
    assert columns(parse_body(SSE, body)) == (2006, 1920, 300, None, None, False)


def test_vllm_json_with_spec_decode_metrics() -> None:
    body = {"choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 50,
                                     "prompt_tokens_details": {"cached_tokens": 800}},
            "metrics": {"time_to_first_token_ms": 100.0, "mean_itl_ms": 10.0,
                        "speculative_decoding": {"num_draft_tokens": 60,
                                                 "num_accepted_draft_tokens": 45}}}
    got = parse_body(JSON, json.dumps(body).encode())
    assert columns(got) == (1000, 800, 50, 60, 45, False)
    # prompt speed: the 200 uncached tokens in 0.1 s (llama-swap's rule); 1 token per 10 ms
    assert (got.prompt_tps, got.generation_tps) == (2000.0, 100.0)


def test_vllm_stream() -> None:
    body = sse({"choices": [{"index": 0, "delta": {"content": "a"}}]},
               {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                         "prompt_tokens_details": {"cached_tokens": 32}}},
               "[DONE]")
    assert columns(parse_body(SSE, body)) == (40, 32, 1, None, None, False)


# ---------------------------------------------------------------- Anthropic

ANTHROPIC_USAGE = {"input_tokens": 50, "cache_creation_input_tokens": 1000,
                   "cache_read_input_tokens": 2000, "output_tokens": 7}


def test_anthropic_json_adds_the_cache_to_input_tokens() -> None:
    body = {"type": "message", "content": [], "usage": ANTHROPIC_USAGE}
    # 50 new + 1000 written to the cache + 2000 read from it; only the read ones are cached
    assert columns(parse_body(JSON, json.dumps(body).encode())) == (3050, 2000, 7, None, None,
                                                                     False)


def test_anthropic_stream() -> None:
    body = (b"event: message_start\n" + sse({"type": "message_start", "message": {
                "type": "message", "usage": {**ANTHROPIC_USAGE, "output_tokens": 1}}})
            + b"event: content_block_delta\n"
            + sse({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}})
            + b"event: message_delta\n"
            + sse({"type": "message_delta", "usage": {"output_tokens": 7}}))
    assert columns(parse_body(SSE, body)) == (3050, 2000, 7, None, None, False)


def test_anthropic_without_cache_fields() -> None:
    body = {"type": "message", "usage": {"input_tokens": 12, "output_tokens": 3}}
    assert columns(parse_body(JSON, json.dumps(body).encode())) == (12, None, 3, None, None,
                                                                     False)


# ---------------------------------------------------------------- cancelled streams

TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=40),
       st.lists(st.integers(min_value=0, max_value=40 * len(TOKEN)), max_size=30))
def test_a_stream_cut_before_its_usage_counts_the_events_relayed(n: int,
                                                                  cuts: list[int]) -> None:
    """However the reads split them, n token events relayed are n output tokens, marked as
    counted rather than reported."""
    body = TOKEN * n
    got = feed_split(SSE, body, [c for c in cuts if c <= len(body)])
    assert columns(got) == (None, None, n, None, None, True)


def test_done_and_reported_counts_are_not_counted_events() -> None:
    assert columns(parse_body(SSE, TOKEN * 3 + b"data: [DONE]\n\n")) == (None, None, 3, None,
                                                                         None, True)
    reported = TOKEN * 3 + sse({"usage": {"prompt_tokens": 4, "completion_tokens": 9}})
    assert columns(parse_body(SSE, reported)) == (4, None, 9, None, None, False)


def test_a_cut_json_answer_counts_nothing() -> None:
    assert parse_body(JSON, json.dumps(LLAMACPP_JSON).encode()[:40]) == Usage()


# ---------------------------------------------------------------- the row


def record(path: str = "/v1/chat/completions") -> RequestRecord:
    return RequestRecord("POST", path, "10.0.0.7", "ua")


def test_the_row_has_the_new_columns_and_the_aliases() -> None:
    rec = record()
    rec.usage = parse_body(JSON, json.dumps(LLAMACPP_JSON).encode())
    row = rec.row()
    assert {k: row[k] for k in ("input_tokens", "cached_tokens", "output_tokens",
                                "draft_tokens", "draft_accepted_tokens",
                                "output_tokens_counted", "prompt_tokens",
                                "completion_tokens")} == {
        "input_tokens": 25, "cached_tokens": 24, "output_tokens": 8, "draft_tokens": 6,
        "draft_accepted_tokens": 4, "output_tokens_counted": False, "prompt_tokens": 25,
        "completion_tokens": 8}
    assert (row["client_ip"], row["endpoint"], row["end_user"]) == ("10.0.0.7", "chat", "")


def test_a_row_without_usage_has_null_tokens() -> None:
    row = record().row()
    assert [row[k] for k in ("input_tokens", "output_tokens", "draft_tokens")] == [None] * 3
    assert row["output_tokens_counted"] is False


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/embeddings", "embeddings"), ("/v/chat/completions", "chat"),
    ("/upstream/m/props", "upstream"), ("/whatever", "other"), ("", "")])
def test_endpoint_column(path: str, expected: str) -> None:
    assert record(path).row()["endpoint"] == expected


def test_a_peer_that_is_not_an_address_has_no_client_ip() -> None:
    # a Unix socket's peer, a test client's name: the inet column would fail the whole batch
    assert RequestRecord("POST", "/v1/completions", "testclient", "").row()["client_ip"] is None
    assert RequestRecord("POST", "/v1/completions", "::1", "").row()["client_ip"] == "::1"


@pytest.mark.parametrize(("body", "headers", "expected"), [
    ({"user": "alice@example.com"}, {}, "alice@example.com"),
    ({"user": "  bob  "}, {}, "bob"),
    ({"metadata": {"user_id": "u-42"}}, {}, "u-42"),  # Anthropic
    ({"user": "x" * 300}, {}, "x" * 255),
    ({"user": 7}, {}, ""),
    ({"user": ""}, {}, ""),
    ({"user": "sk-proj-abc123"}, {}, ""),  # looks like a key: never kept
    ({"user": "tenant-key-1"}, {b"authorization": b"Bearer tenant-key-1"}, ""),
    ({"user": "tenant-key-1"}, {b"x-api-key": b"tenant-key-1"}, ""),
    # Basic with the key as the password: base64 of "anyone:tenant-key-1"
    ({"user": "tenant-key-1"}, {b"authorization": b"Basic YW55b25lOnRlbmFudC1rZXktMQ=="}, ""),
    ({"user": "tenant-key-1"}, {b"authorization": b"Basic not-base64!"}, "tenant-key-1"),
    ({"user": "tenant-a"}, {b"authorization": b"Bearer tenant-key-1"}, "tenant-a"),
    (None, {}, ""),
])
def test_end_user(body, headers, expected) -> None:
    rec = record()
    rec.note_request("m", True, body, headers)
    assert (rec.model_requested, rec.stream, rec.row()["end_user"]) == ("m", True, expected)
