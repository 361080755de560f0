"""activity.usage: token counts and speeds read from responses while they stream.

Expected numbers are written by hand from the fixtures. The fakellm tests feed the real bytes
of `python -m gpuproxy.testing.fakellm` (a subprocess on a free port) through the parser.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from activity import usage as usage_mod
from activity.usage import Usage, UsageParser, parse_body

SSE = "text/event-stream"
JSON = "application/json"
NONE = Usage(None, None, None, None, None)


def feed_all(content_type: str, chunks: list[bytes], **kw) -> Usage:
    parser = UsageParser(content_type, **kw)
    for chunk in chunks:
        parser.feed(chunk)
    return parser.finish()


def bytewise(body: bytes) -> list[bytes]:
    return [body[i : i + 1] for i in range(len(body))]


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(points)]


# ---------------------------------------------------------------- fixtures (hand-written)

OPENAI_STREAM = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":" world"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":31,"completion_tokens":2,"total_tokens":33,'
    b'"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
    b"data: [DONE]\n\n"
)
OPENAI_EXPECTED = Usage(31, 2, 16, None, None)

LLAMACPP_STREAM = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hi"}}],'
    b'"created":1,"id":"x","model":"m","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1,'
    b'"id":"x","model":"m","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":9,"prompt_tokens":40,"total_tokens":49},'
    b'"timings":{"cache_n":24,"prompt_n":16,"prompt_ms":12.5,"prompt_per_token_ms":0.78,'
    b'"prompt_per_second":1280.0,"predicted_n":9,"predicted_ms":150.0,'
    b'"predicted_per_token_ms":16.67,"predicted_per_second":60.0}}\n\n'
    b"data: [DONE]\n\n"
)

ANTHROPIC_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","type":"message",'
    b'"role":"assistant","content":[],"model":"claude","stop_reason":null,'
    b'"usage":{"input_tokens":25,"cache_creation_input_tokens":0,'
    b'"cache_read_input_tokens":10,"output_tokens":1}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
    b"\n\n"
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}'
    b"\n\n"
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":42}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)
# Anthropic's input_tokens leaves the cache out: 25 + 10 read + 0 written
ANTHROPIC_EXPECTED = Usage(35, 42, 10, None, None)

RESPONSES_STREAM = (
    b"event: response.created\n"
    b'data: {"type":"response.created","response":{"id":"resp_1","status":"in_progress",'
    b'"usage":null}}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","item_id":"m1","delta":"Hi"}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","response":{"id":"resp_1","status":"completed",'
    b'"usage":{"input_tokens":37,"input_tokens_details":{"cached_tokens":5},'
    b'"output_tokens":11,"output_tokens_details":{"reasoning_tokens":0},'
    b'"total_tokens":48}}}\n\n'
)


# ---------------------------------------------------------------- OpenAI chat stream


def test_openai_stream_whole() -> None:
    assert feed_all(SSE, [OPENAI_STREAM]) == OPENAI_EXPECTED


def test_openai_stream_one_byte_at_a_time() -> None:
    assert feed_all(SSE, bytewise(OPENAI_STREAM)) == OPENAI_EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(OPENAI_STREAM)), max_size=40))
def test_openai_stream_random_splits(cuts: list[int]) -> None:
    assert feed_all(SSE, split_at(OPENAI_STREAM, cuts)) == OPENAI_EXPECTED


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANTHROPIC_STREAM)), max_size=40))
def test_anthropic_crlf_stream_random_splits(cuts: list[int]) -> None:
    body = ANTHROPIC_STREAM.replace(b"\n", b"\r\n")
    assert feed_all(SSE, split_at(body, cuts)) == ANTHROPIC_EXPECTED


def test_content_type_parameters_and_case() -> None:
    assert feed_all("Text/Event-Stream; charset=utf-8", [OPENAI_STREAM]) == OPENAI_EXPECTED


def test_token_chunks_are_not_json_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_loads = json.loads

    def counting_loads(data, *args, **kwargs):
        calls.append(data)
        return real_loads(data, *args, **kwargs)

    monkeypatch.setattr(usage_mod.json, "loads", counting_loads)
    token = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
    parser = UsageParser(SSE)
    for _ in range(1000):
        parser.feed(token)
    parser.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1000}}\n\n')
    parser.feed(b"data: [DONE]\n\n")
    assert parser.finish() == Usage(3, 1000, None, None, None)
    assert len(calls) == 1


TOKEN_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


@pytest.fixture
def parsed_lines(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every SSE line the parser splits out and handles, in order."""
    lines: list[bytes] = []
    real = UsageParser._handle_line

    def counting(self: UsageParser, line: bytes) -> None:
        lines.append(line)
        real(self, line)

    monkeypatch.setattr(UsageParser, "_handle_line", counting)
    return lines


def test_token_events_split_anywhere_are_skipped_unparsed(parsed_lines: list[bytes]) -> None:
    """Reads split a fast stream's events anywhere (a chunk ends mid-event): the token
    events are still skipped by substring search, never split into lines; only the event
    that carries usage is."""
    lines, token = parsed_lines, TOKEN_EVENT
    body = token * 300 + (b'data: {"choices":[],"usage":{"prompt_tokens":3,'
                          b'"completion_tokens":300}}\n\ndata: [DONE]\n\n')
    parser = UsageParser(SSE)
    for i in range(0, len(body), 97):  # never on an event boundary for long
        parser.feed(body[i:i + 97])
    assert parser.finish() == Usage(3, 300, None, None, None)
    assert len(lines) <= 10, lines[:12]  # the chunks around the usage event only (605 before)


def test_a_read_of_many_events_parses_from_the_usage_event_on(
        parsed_lines: list[bytes]) -> None:
    """A fast upstream's whole stream often arrives in one read with the usage event in it:
    the token events before it are skipped all the same."""
    lines, token = parsed_lines, TOKEN_EVENT
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":300}}\n\n'
    parser = UsageParser(SSE)
    parser.feed(token * 300 + usage + token + b"data: [DONE]\n\n")
    assert parser.finish() == Usage(3, 300, None, None, None)
    assert len(lines) == 7, lines  # usage, one token event, [DONE], their blank lines, the end


def test_last_values_win_per_field() -> None:
    body = (
        b'data: {"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
        b'data: {"usage":{"prompt_tokens":6,"completion_tokens":2}}\n\n'
        b'data: {"usage":{"completion_tokens":3}}\n\n'
    )
    assert feed_all(SSE, [body]) == Usage(6, 3, None, None, None)


def test_sse_multiline_data_comments_and_fields() -> None:
    body = (
        b": keep-alive comment\n"
        b"id: 7\n"
        b"retry: 1000\n"
        b"event: done\n"
        b'data: {"usage":\n'
        b'data:{"prompt_tokens":4,\n'
        b'data:  "completion_tokens":8}}\n'
        b"\n"
    )
    assert feed_all(SSE, bytewise(body)) == Usage(4, 8, None, None, None)


def test_sse_bare_cr_line_endings() -> None:
    body = OPENAI_STREAM.replace(b"\n", b"\r")
    assert feed_all(SSE, bytewise(body)) == OPENAI_EXPECTED


def test_sse_crlf_line_endings_one_byte_at_a_time() -> None:
    body = OPENAI_STREAM.replace(b"\n", b"\r\n")
    assert feed_all(SSE, bytewise(body)) == OPENAI_EXPECTED


def test_sse_last_event_without_blank_line_is_still_read() -> None:
    body = b'data: {"usage":{"prompt_tokens":2,"completion_tokens":3}}'
    assert feed_all(SSE, [body]) == Usage(2, 3, None, None, None)


# ---------------------------------------------------------------- llama.cpp


def test_llamacpp_input_tokens_include_the_cached_ones() -> None:
    # usage says 40 prompt tokens (what the client saw), timings 16 evaluated + 24 from the
    # cache: the row has 40 input tokens, 24 of them cached (issue 20: it had 16 before)
    assert feed_all(SSE, bytewise(LLAMACPP_STREAM)) == Usage(40, 9, 24, 1280.0, 60.0)


def test_llamacpp_usage_counts_win_over_timings_in_any_order() -> None:
    body = (
        b'data: {"timings":{"prompt_n":3,"predicted_n":4,"prompt_per_second":30.5}}\n\n'
        b'data: {"usage":{"prompt_tokens":99,"completion_tokens":98}}\n\n'
    )
    assert feed_all(SSE, [body]) == Usage(99, 98, None, 30.5, None)


def test_llamacpp_non_streaming_json() -> None:
    body = json.dumps(
        {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            "timings": {
                "cache_n": 64,
                "prompt_n": 36,
                "prompt_per_second": 900.25,
                "predicted_n": 20,
                "predicted_per_second": 42.5,
            },
        }
    ).encode()
    assert parse_body("application/json; charset=utf-8", body) == Usage(100, 20, 64, 900.25,
                                                                          42.5)


def test_infill_array_uses_last_element() -> None:
    body = json.dumps(
        [
            {"index": 0, "content": "a", "timings": {"prompt_n": 1, "predicted_n": 1}},
            {
                "index": 1,
                "content": "b",
                "timings": {
                    "prompt_n": 50,
                    "predicted_n": 7,
                    "cache_n": 3,
                    "prompt_per_second": 500.0,
                    "predicted_per_second": 70.0,
                },
            },
        ]
    ).encode()
    # no usage in /infill: prompt_n (uncached) + cache_n
    assert feed_all(JSON, bytewise(body)) == Usage(53, 7, 3, 500.0, 70.0)


# ---------------------------------------------------------------- real fakellm bytes


@pytest.fixture(scope="module")
def fakellm() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", "0", "--tps", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "fakellm: model fake listening on http://H:P pid N"
        assert "listening on http://" in line, line
        base = line.split("listening on ", 1)[1].split()[0]
        assert "loaded" in proc.stdout.readline()
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _fetch(base: str, path: str, body: dict) -> tuple[str, list[bytes]]:
    with (
        httpx.Client(base_url=base, timeout=10) as client,
        client.stream("POST", path, json=body) as resp,
    ):
        assert resp.status_code == 200
        return resp.headers["content-type"], list(resp.iter_raw())


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "one two three four five"}]}


def _check_fakellm(got: Usage) -> None:
    # 5 prompt words, 7 tokens, fakellm's fixed 0.1 ms per prompt token, cache_n 0;
    # generation is paced at 200 tok/s so the measured speed is positive and at most 200.
    assert (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (5, 7, 0)
    assert got.prompt_tps == 10000.0
    assert got.generation_tps is not None
    assert 0 < got.generation_tps <= 200.0


def test_fakellm_chat_stream(fakellm: str) -> None:
    ctype, chunks = _fetch(
        fakellm, "/v1/chat/completions", {**CHAT, "max_tokens": 7, "stream": True}
    )
    assert ctype.startswith("text/event-stream")
    assert b"data: [DONE]" in b"".join(chunks)
    got = feed_all(ctype, chunks)
    _check_fakellm(got)
    assert feed_all(ctype, bytewise(b"".join(chunks))) == got


def test_fakellm_text_completion_stream(fakellm: str) -> None:
    body = {"model": "fake", "prompt": "one two three four five", "max_tokens": 7, "stream": True}
    ctype, chunks = _fetch(fakellm, "/v1/completions", body)
    _check_fakellm(feed_all(ctype, chunks))


def test_fakellm_chat_json(fakellm: str) -> None:
    ctype, chunks = _fetch(fakellm, "/v1/chat/completions", {**CHAT, "max_tokens": 7})
    assert ctype.startswith("application/json")
    got = feed_all(ctype, chunks)
    _check_fakellm(got)
    assert feed_all(ctype, bytewise(b"".join(chunks))) == got


def test_fakellm_truncated_stream_has_no_usage(fakellm: str) -> None:
    ctype, chunks = _fetch(
        fakellm, "/v1/chat/completions", {**CHAT, "max_tokens": 7, "stream": True}
    )
    whole = b"".join(chunks)
    cut = whole.index(b'"timings"') + 20  # the stream dies inside the final event
    # no count reported: the output is the data events relayed, the cut one included
    assert feed_all(ctype, [whole[:cut]]) == Usage(
        output_tokens=whole[:cut].count(b"data: "), output_counted=True)


def test_fakellm_embeddings_json(fakellm: str) -> None:
    ctype, chunks = _fetch(fakellm, "/v1/embeddings", {"model": "fake", "input": "a b c"})
    assert feed_all(ctype, chunks) == Usage(3, None, None, None, None)


# ---------------------------------------------------------------- other JSON shapes


def test_openai_non_streaming_json() -> None:
    body = (
        b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}'
    )
    assert feed_all(JSON, bytewise(body)) == Usage(12, 3, None, None, None)


def test_responses_api_json() -> None:
    body = (
        b'{"id":"resp_1","object":"response","status":"completed","output":[],'
        b'"usage":{"input_tokens":37,"input_tokens_details":{"cached_tokens":5},'
        b'"output_tokens":11,"total_tokens":48}}'
    )
    assert parse_body(JSON, body) == Usage(37, 11, 5, None, None)


def test_responses_api_stream() -> None:
    assert feed_all(SSE, bytewise(RESPONSES_STREAM)) == Usage(37, 11, 5, None, None)


def test_anthropic_stream() -> None:
    assert feed_all(SSE, bytewise(ANTHROPIC_STREAM)) == ANTHROPIC_EXPECTED


def test_anthropic_truncated_after_message_start_keeps_input_tokens() -> None:
    cut = ANTHROPIC_STREAM.index(b"event: message_delta") + 40
    assert feed_all(SSE, [ANTHROPIC_STREAM[:cut]]) == Usage(35, 1, 10, None, None)


def test_anthropic_json() -> None:
    body = (
        b'{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text",'
        b'"text":"Hi"}],"stop_reason":"end_turn","usage":{"input_tokens":14,'
        b'"cache_read_input_tokens":2,"output_tokens":6}}'
    )
    assert parse_body(JSON, body) == Usage(16, 6, 2, None, None)  # 14 + 2 read from the cache


def test_vllm_metrics() -> None:
    body = (
        b'{"choices":[],"usage":{"prompt_tokens":200,"completion_tokens":50},'
        b'"metrics":{"time_to_first_token_ms":100.0,"mean_itl_ms":20.0}}'
    )
    # 200 tokens in 0.1 s = 2000 tok/s; one token every 20 ms = 50 tok/s
    assert parse_body(JSON, body) == Usage(200, 50, None, 2000.0, 50.0)


def test_vllm_metrics_in_stream_before_usage() -> None:
    body = (
        b'data: {"metrics":{"time_to_first_token_ms":250,"mean_itl_ms":8}}\n\n'
        b'data: {"usage":{"prompt_tokens":500,"completion_tokens":10}}\n\n'
    )
    assert feed_all(SSE, [body]) == Usage(500, 10, None, 2000.0, 125.0)


def test_vllm_metrics_without_prompt_tokens() -> None:
    body = b'{"metrics":{"time_to_first_token_ms":100.0,"mean_itl_ms":0}}'
    assert parse_body(JSON, body) == NONE


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"not json",
        b"null",
        b"[]",
        b"[1, 2]",
        b'"usage"',
        b'{"usage": "lots"}',
        b'{"usage": {"prompt_tokens": -1, "completion_tokens": true, "input_tokens": "3"}}',
        b'{"usage": {"prompt_tokens": 1.5, "completion_tokens": NaN}}',
        b'{"timings": {"prompt_per_second": Infinity, "predicted_per_second": -4}}',
        b'{"usage": {"prompt_tokens_details": 7, "input_tokens_details": [1]}}',
        b'{"response": "x", "message": [1], "metrics": null}',
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,
        b'{"usage":{"prompt_tokens":12,"completion_tokens":3',
    ],
)
def test_malformed_json_gives_none(body: bytes) -> None:
    assert feed_all(JSON, [body]) == NONE
    assert feed_all(JSON, bytewise(body[:2000])) == NONE


@pytest.mark.parametrize(
    ("body", "events"),
    [
        (b"data: {\n\n", 1),
        (b'data: {"usage": {"prompt_tokens": 4\n\n', 1),
        (b'data: {"usage": nope}\n\ndata: [DONE]\n\n', 1),
        (b'data: ["usage"]\n\n', 1),
        (b'event: x\nid: 1\n: "usage"\n\n', 0),
        (b'usage: {"usage": {"prompt_tokens": 4}}\n\n', 0),
        (b"\x00\xff\r\r\n\n\r", 0),
        (b"data: " + b"[" * 100_000 + b' "usage"\n\n', 1),
    ],
)
def test_malformed_sse_gives_no_usage(body: bytes, events: int) -> None:
    """Nothing read; only the data events relayed are counted, as output of a stream that
    reported none."""
    expected = Usage(output_tokens=events, output_counted=True) if events else NONE
    assert feed_all(SSE, [body]) == expected


def test_truncated_openai_stream_counts_the_events_relayed() -> None:
    """Cut before its usage (the client left): role, Hello, world, finish and the cut usage
    event were relayed, so 5 output tokens counted, none reported."""
    cut = OPENAI_STREAM.index(b'"completion_tokens"')
    assert feed_all(SSE, bytewise(OPENAI_STREAM[:cut])) == Usage(output_tokens=5,
                                                                  output_counted=True)


def test_empty_response() -> None:
    assert UsageParser(SSE).finish() == NONE
    assert UsageParser(JSON).finish() == NONE


# ---------------------------------------------------------------- caps


def test_json_cap_exceeded_gives_none() -> None:
    body = b'{"usage":{"prompt_tokens":1,"completion_tokens":2}}'
    assert feed_all(JSON, bytewise(body), max_bytes=len(body)) == Usage(1, 2, None, None, None)
    assert feed_all(JSON, bytewise(body), max_bytes=len(body) - 1) == NONE


def test_default_json_cap_is_8_mib() -> None:
    usage = b'{"usage":{"prompt_tokens":1,"completion_tokens":2},"pad":"'
    fits = usage + b"x" * (8 * 1024 * 1024 - len(usage) - 2) + b'"}'
    assert len(fits) == 8 * 1024 * 1024
    assert feed_all(JSON, [fits[:100], fits[100:]]) == Usage(1, 2, None, None, None)
    assert feed_all(JSON, [fits[:-2] + b'x"}']) == NONE


def test_oversized_sse_event_is_skipped_and_later_events_still_count() -> None:
    big_line = b'data: {"usage":{"prompt_tokens":9},"pad":"' + b"x" * 500 + b'"}\n\n'
    big_event = b'data: {"usage":\ndata: {"prompt_tokens":8},"pad":"' + b"x" * 500 + b'"}\n\n'
    last = b'data: {"usage":{"completion_tokens":5}}\n\n'
    for oversized in (big_line, big_event):
        chunks = [*bytewise(oversized), last]
        assert feed_all(SSE, chunks, max_bytes=200) == Usage(None, 5, None, None, None)


# ---------------------------------------------------------------- API details


def test_usage_is_frozen_and_defaults_to_none() -> None:
    assert Usage() == NONE
    with pytest.raises(dataclasses.FrozenInstanceError):
        NONE.input_tokens = 1  # type: ignore[misc]


def test_finish_is_idempotent_and_later_feeds_are_ignored() -> None:
    parser = UsageParser(SSE)
    parser.feed(OPENAI_STREAM)
    assert parser.finish() == OPENAI_EXPECTED
    parser.feed(b'data: {"usage":{"prompt_tokens":1}}\n\n')
    assert parser.finish() == OPENAI_EXPECTED


def test_parse_body_sse_and_json() -> None:
    assert parse_body(SSE, ANTHROPIC_STREAM) == ANTHROPIC_EXPECTED
    assert parse_body("", b'{"usage":{"input_tokens":3,"output_tokens":4}}') == Usage(
        3, 4, None, None, None
    )


def test_accepts_bytearray_and_memoryview() -> None:
    half = len(OPENAI_STREAM) // 2
    chunks = [bytearray(OPENAI_STREAM[:half]), memoryview(OPENAI_STREAM[half:])]
    assert feed_all(SSE, chunks) == OPENAI_EXPECTED  # type: ignore[arg-type]


def test_crlf_split_between_cr_and_lf_is_not_a_blank_line() -> None:
    # If "\r" + "\n" arriving in two chunks counted as two line ends, the event would be cut
    # after its first data line and never decode.
    body = b'data: {"usage":\r\ndata: {"prompt_tokens":4,"completion_tokens":8}}\r\n\r\n'
    cut = body.index(b"\r\n") + 1
    assert feed_all(SSE, [body[:cut], body[cut:]]) == Usage(4, 8, None, None, None)
