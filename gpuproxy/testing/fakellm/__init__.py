"""A fake OpenAI-compatible inference server: the upstream for the example config, tests, benches.

Run as ``python -m gpuproxy.testing.fakellm --port P [--host H] [--model NAME] [--tps N]
[--load-seconds S] [--ignore-sigterm] [--crash-after N] [--exit-on-start CODE]``.

Why it is written this way:

* It is the upstream the proxy benchmarks measure against, so it must never be the bottleneck.
  It is a hand-written HTTP/1.1 server on asyncio streams (standard library only: no Django,
  no third-party import, and it starts in a few tens of milliseconds), constant bytes are
  encoded once, and a streamed token costs one small ``bytes`` formatting and one write.
* It behaves like llama-server where the proxy cares: it binds before "loading" (so the port
  is taken while ``/health`` still answers 503 with llama.cpp's exact error shape), it exits 1
  when the port is busy, it reports ``usage`` and llama.cpp ``timings``, and ``/slots`` says
  whether a generation is running.
* It can misbehave on purpose (slow load, death at start, ignoring SIGTERM, a crash in the
  middle of a response, held responses, slow tokens) so the proxy's failure handling can be
  tested against a real process instead of mocks.
* Every answer says who served it (``X-Fake-Served-By: NAME:PORT``, a top-level ``"model"``
  in every JSON object, ``system_fingerprint`` in completions) so routing can be asserted.

Lifecycle lines go to stdout (one flushed line per event: bound, loaded, a client that went
away, a simulated crash); failures to start go to stderr. Nothing is printed per request, so a
benchmark is not slowed down by logging.

The modules, one job each:

* `server`: sockets and HTTP/1.1 (parsing, framing, keep-alive, routing to a table).
* `generation`: the model: load state, slots, chat/text completions (JSON and streamed).
* `endpoints`: `FakeLLM`, its lifecycle and what each path answers.
* `misbehave`: the knobs that make it misbehave (flags, holds, gates, crashes).
* `__main__`: the command line (`build_parser`, `main`); not imported from here, see there.
"""

from gpuproxy.testing.fakellm.endpoints import DEFAULT_MODEL, EMBEDDING_DIMS, FakeLLM
from gpuproxy.testing.fakellm.generation import DEFAULT_MAX_TOKENS
from gpuproxy.testing.fakellm.misbehave import CRASH_EXIT_CODE, Misbehaviour
from gpuproxy.testing.fakellm.server import (
    HEAD_LIMIT,
    MAX_BODY,
    POLL_SLICE,
    ClientGone,
    HttpError,
    Request,
)

__all__ = [
    "CRASH_EXIT_CODE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "EMBEDDING_DIMS",
    "HEAD_LIMIT",
    "MAX_BODY",
    "POLL_SLICE",
    "ClientGone",
    "FakeLLM",
    "HttpError",
    "Misbehaviour",
    "Request",
]
