"""`FakeLLM`, the fake upstream as a whole: its lifecycle and what each path answers.

The route table is llama-server's (with and without `/v1`): health, models, slots, chat and text
completions (see `generation`), embeddings, rerank, transcriptions, plus two `/fake/` paths for
tests (open a gate, read the last body received). It binds before "loading", so the port is
taken while `/health` still answers 503 with llama.cpp's exact error shape, and exits 1 when
the port is busy. Every answer says who served it (`X-Fake-Served-By: NAME:PORT`, a top-level
`"model"` in every JSON object) so routing can be asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import math
import os
import struct
import time
from typing import Any

from gpuproxy.testing.fakellm.generation import Generator, word_count
from gpuproxy.testing.fakellm.misbehave import Misbehaviour
from gpuproxy.testing.fakellm.server import HttpError, Request, dumps, err, out

DEFAULT_MODEL = "fake"
EMBEDDING_DIMS = 8
FAKE_N_CTX = 4096  # what `/props` says the context is


def _embedding(text: str) -> list[float]:
    """A unit vector derived from a stable hash (never Python's randomised `hash`)."""
    digest = hashlib.blake2b(text.encode(), digest_size=2 * EMBEDDING_DIMS).digest()
    raw = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{EMBEDDING_DIMS}H", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def _relevance(query: str, document: str) -> float:
    """Word overlap with the query, plus a tiny stable tie-breaker so scores are distinct."""
    q = set(query.lower().split())
    d = set(document.lower().split())
    overlap = len(q & d) / len(q) if q else 0.0
    tie = hashlib.blake2b(document.encode(), digest_size=2).digest()
    return round(overlap * 0.9 + int.from_bytes(tie, "little") / 65535 * 0.1, 6)


def _doc_text(doc: Any) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict) and isinstance(text := doc.get("text"), str):
        return text
    raise HttpError(400, "documents must be strings or objects with a 'text' field")


class FakeLLM(Generator):
    """The server: configuration, load state, slots, and the answer of every path."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(
            args.host,
            args.port,
            args.model,
            tps=args.tps,
            misbehave=Misbehaviour(
                load_seconds=args.load_seconds,
                ignore_sigterm=args.ignore_sigterm,
                crash_after=args.crash_after,
                exit_on_start=args.exit_on_start,
            ),
        )
        self._started = time.time()
        self._stop: asyncio.Event | None = None

    # ----------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        """Bind, announce, "load", serve until a signal; returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.misbehave.install_signals(loop, self._stop)
        server = await self.listen()
        if server is None:
            return 1
        self._build_constants()
        out(
            f"fakellm: model {self.model} listening on http://{self.host}:{self.port} "
            f"pid {os.getpid()}"
        )
        if self.misbehave.exit_on_start is not None:
            err(f"fakellm: simulated start failure for model {self.model}")
            server.close()
            return self.misbehave.exit_on_start
        if self.misbehave.load_seconds > 0:
            loop.call_later(self.misbehave.load_seconds, self._mark_loaded)
        else:
            self._mark_loaded()
        await self._stop.wait()
        await self.close(server)
        return 0

    def _mark_loaded(self) -> None:
        self.loaded = True
        out(f"fakellm: model {self.model} loaded in {self.misbehave.load_seconds:g} s")

    def _build_constants(self) -> None:
        """Encode everything that depends only on the model and the bound port, once."""
        served_by = f"{self.model}:{self.port}"
        self.fingerprint = f"fakellm:{served_by}"
        self._header_tail = b"Server: fakellm\r\nX-Fake-Served-By: " + served_by.encode() + b"\r\n"
        self._model_json = dumps(self.model)
        self._fingerprint_json = dumps(self.fingerprint)
        self._routes = {
            "/health": ("GET", self._health),
            "/v1/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/models": ("GET", self._models),
            "/slots": ("GET", self._slots),
            "/props": ("GET", self._props),
            "/v1/chat/completions": ("POST", self._chat),
            "/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/completions": ("POST", self._completions),
            "/v1/embeddings": ("POST", self._embeddings),
            "/embeddings": ("POST", self._embeddings),
            "/v1/rerank": ("POST", self._rerank),
            "/rerank": ("POST", self._rerank),
            "/v1/reranking": ("POST", self._rerank),
            "/reranking": ("POST", self._rerank),
            "/v1/audio/transcriptions": ("POST", self._transcribe),
            "/fake/gates/open": ("POST", self._open_gate),
            "/fake/last-body": ("GET", self._last_body),
        }
        self._raw_body = {"/v1/audio/transcriptions"}

    # ----------------------------------------------------------------- test-only paths

    async def _last_body(
        self,
        req: Request,
        body: dict[str, Any] | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        seen = {"body": self.last_body, "headers": self.last_headers}
        await self._send_json(writer, 200, dumps(seen),
                              keep_alive=req.keep_alive, http10=req.http10)

    async def _open_gate(
        self,
        req: Request,
        body: dict[str, Any] | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        name = (body or {}).get("gate")
        if not isinstance(name, str) or not name:
            raise HttpError(400, "send {\"gate\": NAME}")
        self.misbehave.gate(name).set()
        await self._send_json(writer, 200, dumps({"gate": name, "open": True}),
                              keep_alive=req.keep_alive, http10=req.http10)

    # ----------------------------------------------------------------- endpoints

    async def _health(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self.misbehave.hold(req, body, reader)
        if self.loaded:
            await self._send_json(
                writer,
                200,
                b'{"status":"ok","model":' + self._model_json + b"}",
                keep_alive=req.keep_alive,
                http10=req.http10,
            )
        else:
            await self._send_error(
                writer, 503, "Loading model", keep_alive=req.keep_alive, http10=req.http10
            )

    async def _models(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self.misbehave.hold(req, body, reader)
        payload = {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": int(self._started),
                    "owned_by": "fakellm",
                }
            ],
            "model": self.model,
        }
        await self._send_json(
            writer, 200, dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _transcribe(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        """A multipart upload: answers with the size of the file and the `model` field seen,
        so a test can tell the proxy relayed the form unchanged (or rewrote `model`)."""
        ctype = req.headers.get("content-type", "")
        if "multipart/form-data" not in ctype or "boundary=" not in ctype:
            raise HttpError(400, "expected multipart/form-data with a boundary")
        boundary = ctype.split("boundary=", 1)[1].strip().strip('"').encode()
        fields: dict[str, bytes] = {}
        for part in req.body.split(b"--" + boundary):
            head, sep, value = part.partition(b"\r\n\r\n")
            if sep and b'name="' in head:
                name = head.split(b'name="', 1)[1].split(b'"', 1)[0].decode()
                fields[name] = value.removesuffix(b"\r\n")
        if "file" not in fields:
            raise HttpError(400, "no `file` part in the upload")
        if not self.loaded:
            raise self._unavailable()
        payload = {
            "text": f"fake transcript of {len(fields['file'])} bytes",
            "model": self.model,
            "form_model": fields.get("model", b"").decode(errors="replace"),
        }
        await self._send_json(
            writer, 200, dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _slots(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        await self.misbehave.hold(req, body, reader)
        payload = [{"id": i, "is_processing": busy} for i, busy in enumerate(self.slots)]
        await self._send_json(
            writer, 200, dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _props(
        self, req: Request, body: None, reader: Any, writer: asyncio.StreamWriter
    ) -> None:
        """llama-server's `/props` (the fields clients read: the context, the slots, the
        model's path), plus the query string seen, so a test can tell what the proxy sent."""
        await self.misbehave.hold(req, body, reader)
        if not self.loaded:
            raise self._unavailable()
        payload = {
            "default_generation_settings": {"n_ctx": FAKE_N_CTX, "params": {}},
            "total_slots": len(self.slots),
            "model_path": f"/models/{self.model}.gguf",
            "modalities": {"vision": False, "audio": False},
            "build_info": "fakellm",
            "model": self.model,
            "query": req.query,
        }
        await self._send_json(
            writer, 200, dumps(payload), keep_alive=req.keep_alive, http10=req.http10
        )

    async def _chat(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise HttpError(400, "'messages' must be a list")
        await self._generate(
            req, body, reader, writer, chat=True, prompt_tokens=word_count(messages)
        )

    async def _completions(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str | list):
            raise HttpError(400, "'prompt' must be a string or a list")
        await self._generate(
            req, body, reader, writer, chat=False, prompt_tokens=word_count(prompt)
        )

    async def _embeddings(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        raw = body.get("input", body.get("content"))
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            inputs: list[Any] = [raw]
        elif isinstance(raw, list) and raw:
            inputs = raw
        else:
            raise HttpError(400, "'input' must be a string or a non-empty list")
        await self.misbehave.hold(req, body, reader)
        if not self.loaded:
            raise self._unavailable()
        crash = self.misbehave.count_completion_request()
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        tokens = 0
        for i, item in enumerate(inputs):
            text = item if isinstance(item, str) else " ".join(str(t) for t in item)
            tokens += word_count(item)
            vector: Any = _embedding(text)
            if as_base64:
                vector = base64.b64encode(struct.pack(f"<{EMBEDDING_DIMS}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = max(tokens, 1)
        payload = dumps(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)

    async def _rerank(
        self,
        req: Request,
        body: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        query = body.get("query")
        documents = body.get("documents")
        if not isinstance(query, str):
            raise HttpError(400, "'query' must be a string")
        if not isinstance(documents, list):
            raise HttpError(400, "'documents' must be a list")
        texts = [_doc_text(d) for d in documents]
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)):
            raise HttpError(400, "'top_n' must be an integer")
        await self.misbehave.hold(req, body, reader)
        if not self.loaded:
            raise self._unavailable()
        crash = self.misbehave.count_completion_request()
        results: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            result: dict[str, Any] = {"index": i, "relevance_score": _relevance(query, text)}
            if body.get("return_documents"):
                result["document"] = {"text": text}
            results.append(result)
        if top_n is not None:
            results.sort(key=lambda r: r["relevance_score"], reverse=True)
            results = results[: max(top_n, 0)]
        tokens = max(1, sum(word_count(query) + word_count(t) for t in texts))
        payload = dumps(
            {
                "model": self.model,
                "object": "list",
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        await self._send_complete_or_crash(req, writer, payload, crash)
