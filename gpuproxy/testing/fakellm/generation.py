"""The fake model itself: load state, slots, and chat/text completions, JSON or streamed.

It behaves like llama-server where the proxy cares: deterministic "tok0 tok1 ..." text paced by
`--tps`, `usage` and llama.cpp's `timings`, a slot marked busy while a prompt is held or
generated (what `/slots` reports), 503 "Loading model" until loaded. A streamed token costs one
small `bytes` formatting and one write, so the fake stays faster than the proxy it measures.
Every completion says who served it (`system_fingerprint` is `fakellm:MODEL:PORT`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gpuproxy.testing.fakellm.misbehave import Misbehaviour, hold_seconds
from gpuproxy.testing.fakellm.server import (
    DONE_EVENT,
    JSON_TYPE,
    LAST_CHUNK,
    SSE_TYPE,
    ClientGone,
    HttpError,
    HttpServer,
    Request,
    dumps,
    out,
    pause,
)

DEFAULT_MAX_TOKENS = 16


def word_count(value: Any) -> int:
    """Deterministic stand-in for a tokenizer: whitespace words in any nested text."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)  # a pre-tokenized prompt
        return sum(word_count(v) for v in value)
    if isinstance(value, dict):
        # chat messages ({"content": ...}) and content parts ({"type": "text", "text": ...})
        return word_count(value.get("content")) + word_count(value.get("text"))
    return 0


def max_tokens(body: dict[str, Any]) -> int:
    """`max_tokens`, `max_completion_tokens` or llama.cpp's `n_predict`; -1 means the default."""
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise HttpError(400, f"'{key}' must be an integer")
        if value == -1:
            return DEFAULT_MAX_TOKENS
        if value < 0:
            raise HttpError(400, f"'{key}' must be >= 0")
        return value
    return DEFAULT_MAX_TOKENS


class Generator(HttpServer):
    """An HTTP server with a model behind it; the route table is the subclass's."""

    def __init__(
        self, host: str, port: int, model: str, *, tps: float, misbehave: Misbehaviour
    ) -> None:
        super().__init__(host, port, model)
        self.tps = tps
        self.misbehave = misbehave
        self.loaded = False
        #: One flag per slot ever used: llama.cpp reports a fixed set, we grow it on demand.
        self.slots: list[bool] = [False]
        self.active_generations = 0
        self._request_seq = 0
        # Set once the port is known (it names the server), before the first request.
        self.fingerprint = ""
        self._model_json = b""
        self._fingerprint_json = b""

    def _unavailable(self) -> HttpError:
        return HttpError(503, "Loading model")

    async def _send_complete_or_crash(
        self, req: Request, writer: asyncio.StreamWriter, payload: bytes, crash: bool
    ) -> None:
        if crash:
            writer.write(
                self._head(
                    200,
                    JSON_TYPE,
                    length=len(payload),
                    keep_alive=req.keep_alive,
                    http10=req.http10,
                )
            )
            await self.misbehave.crash(writer, "after sending the response headers")
        await self._send_json(writer, 200, payload, keep_alive=req.keep_alive, http10=req.http10)

    def _acquire_slot(self) -> int:
        for i, busy in enumerate(self.slots):
            if not busy:
                self.slots[i] = True
                break
        else:
            i = len(self.slots)
            self.slots.append(True)
        self.active_generations += 1
        return i

    def _release_slot(self, slot: int) -> None:
        self.slots[slot] = False
        self.active_generations -= 1

    async def _generate(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        chat: bool,
        prompt_tokens: int,
    ) -> None:
        """Chat and text completions: deterministic "tok0 tok1 ..." text, paced by --tps.

        The slot is taken before the hold, as llama-server marks a slot busy while it processes
        the prompt, so a held request already shows `is_processing: true` in /slots.
        """
        n_tokens = max_tokens(body)
        stream = bool(body.get("stream"))
        hold = hold_seconds(req, body)
        if not self.loaded:
            await pause(reader, hold)
            raise self._unavailable()
        crash = self.misbehave.count_completion_request()
        prompt_tokens = max(prompt_tokens, 1)
        slot = self._acquire_slot()
        try:
            await pause(reader, hold)
            gate = req.headers.get("x-fake-gate")
            if gate:
                await self.misbehave.wait_gate(reader, gate)
            self._request_seq += 1
            if stream:
                await self._stream(req, reader, writer, chat, n_tokens, prompt_tokens, crash)
            else:
                await self._complete(req, reader, writer, chat, n_tokens, prompt_tokens, crash)
        except ClientGone as exc:
            out(f"fakellm: client went away after {exc.tokens} tokens")
            raise
        except ConnectionError:
            out("fakellm: client went away after 0 tokens")
            raise ClientGone from None
        finally:
            self._release_slot(slot)

    def _timings(self, prompt_tokens: int, n_tokens: int, predicted_s: float) -> dict[str, Any]:
        """llama.cpp's `timings` block; prompt time is a fixed, deterministic 0.1 ms per token."""
        prompt_ms = prompt_tokens * 0.1
        predicted_ms = predicted_s * 1000.0
        return {
            "cache_n": 0,
            "prompt_n": prompt_tokens,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": 0.1,
            "prompt_per_second": 10000.0,
            "predicted_n": n_tokens,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / n_tokens, 3) if n_tokens else 0.0,
            "predicted_per_second": round(n_tokens / predicted_s, 3) if predicted_s > 0 else 0.0,
        }

    @staticmethod
    def _usage(prompt_tokens: int, n_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_tokens,
            "total_tokens": prompt_tokens + n_tokens,
        }

    async def _complete(
        self,
        req: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        chat: bool,
        n_tokens: int,
        prompt_tokens: int,
        crash: bool,
    ) -> None:
        """Non-streaming: sleep n/tps as if generating, then answer in one JSON document."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.tps > 0:
            await pause(reader, n_tokens / self.tps)
        elapsed = loop.time() - started
        text = "".join([f"tok{i} " for i in range(n_tokens)])
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            ident, obj = f"chatcmpl-fake-{self._request_seq}", "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            ident, obj = f"cmpl-fake-{self._request_seq}", "text_completion"
        payload = dumps(
            {
                "id": ident,
                "object": obj,
                "created": created,
                "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [choice],
                "usage": self._usage(prompt_tokens, n_tokens),
                "timings": self._timings(prompt_tokens, n_tokens, elapsed),
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)

    async def _stream(
        self,
        req: Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        chat: bool,
        n_tokens: int,
        prompt_tokens: int,
        crash: bool,
    ) -> int:
        """SSE over chunked encoding, one event per token; returns the number of tokens sent.

        Each event is `prefix + token + suffix` with prefix and suffix built once per request,
        so a token costs one bytes formatting and one write. `drain()` after each write is
        cheap unless the socket is backed up, and it is what raises when the client is gone.
        """
        chunked = not req.http10
        keep_alive = req.keep_alive and chunked
        created = int(time.time())
        if chat:
            ident = f"chatcmpl-fake-{self._request_seq}"
            obj = "chat.completion.chunk"
        else:
            ident = f"cmpl-fake-{self._request_seq}"
            obj = "text_completion"
        common = (
            b'{"id":"%s","object":"%s","created":%d,"model":%s,"system_fingerprint":%s,'
            b'"choices":[{"index":0,'
            % (ident.encode(), obj.encode(), created, self._model_json, self._fingerprint_json)
        )
        if chat:
            prefix = b"data: " + common + b'"delta":{"content":"'
            suffix = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            prefix = b"data: " + common + b'"text":"'
            suffix = b'","logprobs":null,"finish_reason":null}]}\n\n'
        fixed = len(prefix) + len(suffix)

        def frame(event: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(event), event) if chunked else event

        writer.write(
            self._head(200, SSE_TYPE, length=None, keep_alive=keep_alive, http10=req.http10)
        )
        if chat:
            writer.write(
                frame(
                    b"data: "
                    + common
                    + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                    b'"finish_reason":null}]}\n\n'
                )
            )
        await writer.drain()

        stop_at = n_tokens // 2 if crash else n_tokens
        loop = asyncio.get_running_loop()
        started = loop.time()
        interval = 1.0 / self.tps if self.tps > 0 else 0.0
        for i in range(stop_at):
            if interval:
                await self._pause_tokens(reader, started + (i + 1) * interval - loop.time(), i)
            elif reader.at_eof():
                raise ClientGone(i)
            tok = b"tok%d " % i
            if chunked:
                writer.write(b"%x\r\n%s%s%s\r\n" % (fixed + len(tok), prefix, tok, suffix))
            else:
                writer.write(prefix + tok + suffix)
            try:
                await writer.drain()
            except ConnectionError:
                raise ClientGone(i) from None
            if not interval and i & 63 == 63:
                await asyncio.sleep(0)  # let other connections run during a long fast burst
        if crash:
            await self.misbehave.crash(writer, f"after streaming {stop_at} of {n_tokens} tokens")
        elapsed = loop.time() - started

        tail = b'"finish_reason":"length"}],"usage":%s,"timings":%s}\n\n' % (
            dumps(self._usage(prompt_tokens, n_tokens)),
            dumps(self._timings(prompt_tokens, n_tokens, elapsed)),
        )
        if chat:
            final = b"data: " + common + b'"delta":{},"logprobs":null,' + tail
        else:
            final = b"data: " + common + b'"text":"","logprobs":null,' + tail
        writer.write(frame(final) + frame(DONE_EVENT) + (LAST_CHUNK if chunked else b""))
        try:
            await writer.drain()
        except ConnectionError:
            raise ClientGone(n_tokens) from None
        req.keep_alive = keep_alive  # an HTTP/1.0 stream ends when the connection does
        return n_tokens

    async def _pause_tokens(self, reader: asyncio.StreamReader, seconds: float, sent: int) -> None:
        try:
            await pause(reader, seconds)
        except ClientGone:
            raise ClientGone(sent) from None
