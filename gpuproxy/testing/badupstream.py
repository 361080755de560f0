"""A misbehaving upstream: a raw-asyncio HTTP server that does on purpose what real servers do
by accident, so the proxy's handling of each case is tested against a real process and socket.

    python -m gpuproxy.testing.badupstream --port P --mode MODE [--model NAME] [--tokens N]
        [--close-delay S] [--exit-code C]

It answers `/health` like llama-server (200 `{"status":"ok"}` with `Keep-Alive: timeout=5,
max=100`), so `gpuproxy serve` runs it as a model's `cmd`; `GET /v1/models` lists `--model`.
Every other request is an inference request: a JSON body whose `"stream": true` asks for SSE.
How it is answered is the mode's:

- `polite`: a correct answer on a connection kept alive (the baseline).
- `close-after-stream`: llama.cpp's server. Every answer says `Keep-Alive: timeout=5, max=100`,
  yet after each streamed (chunked) answer the connection is closed: as the next request
  arrives on it, unanswered (the race a client loses when it writes before it has seen the
  close), or after `--close-delay` seconds of quiet.
- `close-on-reuse`: a keep-alive race made exact. One request per connection; a second one on
  it is met by an immediate close, unanswered (an idle timeout that fired as it arrived).
- `truncate-cl`: `Content-Length: 1000`, 38 bytes of body, then the connection closes.
- `cut-mid-chunk`: chunked; a chunk announced as 100 bytes, 10 of them, then a close.
- `no-terminal-chunk`: chunked; whole chunks, then a close without the `0` chunk.
- `close-delimited`: neither `Content-Length` nor chunked: the body ends with the connection
  (HTTP/1.0 style).
- `echo`: answers JSON with `"headers"`: the request headers it received (lower-case names).
- `set-cookie`: `echo`, plus `Set-Cookie: sessionid=evil-PORT`.
- `huge-header`: a response header line of 9000 bytes (aiohttp's limit is 8190).
- `duplicate-cl`: two different `Content-Length` headers.
- `bad-chunk`: chunked, with a chunk-size line that is not hex.
- `not-http`: bytes that are not HTTP at all, then a close.

`--server NAME` is the `Server` header of every answer (default `badupstream`; llama.cpp's is
`llama.cpp`). `--exit-code C` makes the process exit with code C (`os._exit`, no cleanup: a
crash) at the moment the mode would close the connection, so the body ends because the
process died.
Lifecycle lines go to stdout, one flushed line per event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

MODES = ("polite", "close-after-stream", "close-on-reuse", "truncate-cl", "cut-mid-chunk",
         "no-terminal-chunk", "close-delimited", "set-cookie", "echo", "huge-header",
         "duplicate-cl", "bad-chunk", "not-http")
KEEP_ALIVE = b"Keep-Alive: timeout=5, max=100\r\n"
HEAD_LIMIT = 64 * 1024


def _out(line: str) -> None:
    print(line, flush=True)


class Request:
    __slots__ = ("body", "headers", "method", "path")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method, self.path, self.headers, self.body = method, path, headers, body

    def json(self) -> dict[str, Any]:
        try:
            value = json.loads(self.body or b"{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request with a Content-Length body (what the proxy sends); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    body = await reader.readexactly(length) if length else b""
    return Request(method, path.split("?", 1)[0], headers, body)


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.mode: str = args.mode
        self.model: str = args.model
        self.port: int = args.port
        self.tokens: int = args.tokens
        self.close_delay: float = args.close_delay
        self.exit_code: int | None = args.exit_code
        self.server = b"Server: %s\r\n" % args.server.encode()
        self.served = 0

    # ---- bodies -----------------------------------------------------------------------------

    def completion(self, req: Request) -> bytes:
        self.served += 1
        body: dict[str, Any] = {
            "id": f"chatcmpl-bad-{self.served}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "finish_reason": "length", "message": {
                "role": "assistant", "content": " ".join(f"tok{i}" for i in range(self.tokens))}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": self.tokens,
                      "total_tokens": 1 + self.tokens}}
        if self.mode in ("echo", "set-cookie"):
            body["headers"] = req.headers
        return json.dumps(body).encode()

    def events(self) -> list[bytes]:
        self.served += 1
        out = []
        for i in range(self.tokens):
            chunk = {"id": f"chatcmpl-bad-{self.served}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": self.model,
                     "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                  "finish_reason": None}]}
            out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    # ---- the connection ---------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served_here = 0
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    return
                if req.path == "/health":
                    self.write_json(writer, b'{"status":"ok"}')
                    await writer.drain()
                    continue
                if req.method == "GET" and req.path in ("/v1/models", "/models"):
                    self.write_json(writer, json.dumps({"object": "list", "data": [
                        {"id": self.model, "object": "model"}]}).encode())
                    await writer.drain()
                    continue
                served_here += 1
                if self.mode == "close-on-reuse" and served_here > 1:
                    _out(f"badupstream: closing a reused connection unanswered ({req.path})")
                    self.die_or(writer.transport.abort)
                    return
                if not await self.answer(req, reader, writer):
                    return
        except ConnectionError:
            return
        finally:
            writer.close()

    def write_json(self, writer: asyncio.StreamWriter, body: bytes,
                   extra: bytes = b"") -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + self.server + b"Content-Type: application/json\r\n"
                     + KEEP_ALIVE + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def die_or(self, close: Any) -> None:
        """End the connection the mode's way: the process dies (`--exit-code`) or it closes."""
        if self.exit_code is not None:
            _out(f"badupstream: exiting with code {self.exit_code} mid-response")
            os._exit(self.exit_code)
        close()

    async def answer(self, req: Request, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must not be used again."""
        mode = self.mode
        stream = bool(req.json().get("stream"))
        sse = b"HTTP/1.1 200 OK\r\n" + self.server + b"Content-Type: text/event-stream\r\n"
        if mode in ("polite", "close-on-reuse", "echo", "set-cookie", "close-after-stream"):
            extra = (b"Set-Cookie: sessionid=evil-%d; Path=/\r\n" % self.port
                     if mode == "set-cookie" else b"")
            if not stream:
                self.write_json(writer, self.completion(req), extra)
                await writer.drain()
                return True
            writer.write(sse + KEEP_ALIVE + extra + b"Transfer-Encoding: chunked\r\n\r\n")
            for event in self.events():
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            if mode != "close-after-stream":
                return True
            # llama.cpp: the answer said keep-alive, but the connection ends here
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), self.close_delay):
                    _out("badupstream: closing after a stream as the next request arrives")
            self.die_or(writer.close)
            return False
        if mode == "truncate-cl":
            body = self.completion(req)[:38]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + KEEP_ALIVE
                         + b"Content-Length: 1000\r\n\r\n" + body)
        elif mode == "cut-mid-chunk":
            head = sse if stream else b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            writer.write(head + KEEP_ALIVE + b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"64\r\n" + b"x" * 10)
        elif mode == "no-terminal-chunk":
            if stream:
                writer.write(sse + KEEP_ALIVE + b"Transfer-Encoding: chunked\r\n\r\n")
                for event in self.events()[:-1]:  # no [DONE] either
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            else:
                body = self.completion(req)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             + KEEP_ALIVE + b"Transfer-Encoding: chunked\r\n\r\n"
                             + b"%x\r\n%s\r\n" % (len(body), body))
        elif mode == "close-delimited":
            if stream:
                events = self.events()
                if self.exit_code is not None:
                    events = events[:-1]  # it dies before it could finish
                writer.write(sse + b"Connection: close\r\n\r\n" + b"".join(events))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\n\r\n" + self.completion(req))
        elif mode == "huge-header":
            body = self.completion(req)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Huge: "
                         + b"h" * 9000 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        elif mode == "duplicate-cl":
            body = self.completion(req)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
                         % (len(body), len(body) + 2) + body)
        elif mode == "bad-chunk":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\nzz-not-hex\r\n{}\r\n0\r\n\r\n")
        elif mode == "not-http":
            writer.write(b"SSH-2.0-OpenSSH_9.2 this is not HTTP\r\n\x00\x01\x02\xff\r\n\r\n")
        await writer.drain()
        self.die_or(writer.close)
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuproxy.testing.badupstream",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=MODES, default="polite")
    p.add_argument("--model", default="bad")
    p.add_argument("--tokens", type=int, default=8, help="tokens (SSE events) per answer")
    p.add_argument("--close-delay", type=float, default=0.5,
                   help="close-after-stream: seconds of quiet after a stream before the close")
    p.add_argument("--server", default="badupstream", help="the Server header's value")
    p.add_argument("--exit-code", type=int, default=None,
                   help="exit with this code instead of closing the connection")
    return p


async def serve(args: argparse.Namespace) -> None:
    server = Server(args)
    listener = await asyncio.start_server(server.handle, args.host, args.port, limit=HEAD_LIMIT)
    _out(f"badupstream: mode {args.mode} listening on {args.host}:{args.port}")
    async with listener:
        await listener.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"badupstream: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
