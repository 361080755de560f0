"""A llama-server look-alike: llama.cpp's own C++ HTTP server, run in-process through xllamacpp.

    python -m gpuproxy.testing.llama_server --port P -m MODEL.gguf [-c N] [-np N] [-t N]
        [--alias NAME] [--host H] ...           (`--help` lists every flag)

The command line takes llama-server's flags with llama-server's meanings, so a model's `cmd`
reads like a real llama-server command and can be swapped for one. The HTTP surface is
llama-server's own (xllamacpp compiles llama.cpp's `tools/server`): `/health` answers 503
"Loading model" while the model loads, then 200; `/v1/chat/completions`, `/v1/completions`,
`/completion` (with `timings`), `/v1/models`, `/slots`, `/metrics` (with `--metrics`).

Like llama-server it exits with code 1 when it cannot start (a busy port: llama.cpp logs
"couldn't bind HTTP server socket, hostname: H, port: P"; a bad model file), stops on SIGTERM
or SIGINT (exit 0; a second signal exits at once), and rejects an unknown flag with exit code 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

PROG = "python -m gpuproxy.testing.llama_server"
# xllamacpp's Server destructor hangs forever when it runs before the server's main loop has
# started (its terminate() is lost: the loop sets `running = true` when it begins), and that
# loop starts just after the constructor returns. So a stop waits until the server is this old,
# and a C-level watchdog ends the process with code 1 if the destructor hangs anyway.
MIN_AGE_BEFORE_STOP = 0.3
STOP_WATCHDOG = 5.0


POOLING = ("none", "mean", "cls", "last", "rank")  # llama-server's --pooling values


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{PROG}: error: {message}\n(a llama-server look-alike over xllamacpp; it "
                     "accepts only the llama-server flags that --help lists)\n")


def _flash_attn(value: str) -> str:
    value = value.lower()
    if value not in ("on", "off", "auto"):
        raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")
    return value


def _xllamacpp_version() -> str:
    try:
        return version("xllamacpp")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="llama.cpp's server (through xllamacpp) with llama-server's flags.")
    add = p.add_argument
    add("-m", "--model", required=True, metavar="FNAME", help="model path (.gguf)")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8080, help="port to listen on (default 8080)")
    add("-a", "--alias", metavar="NAME[,NAME...]",
        help="the model's name(s) in the API (default: the file's path)")
    add("-c", "--ctx-size", type=int, metavar="N",
        help="context size in tokens, all slots together (default 0: the model's)")
    add("-np", "--parallel", type=int, metavar="N", help="number of slots (default 1)")
    add("-t", "--threads", type=int, metavar="N", help="generation threads (default: auto)")
    add("-tb", "--threads-batch", type=int, metavar="N",
        help="prompt-processing threads (default: same as --threads)")
    add("--threads-http", type=int, metavar="N", help="HTTP worker threads (default: auto)")
    add("-b", "--batch-size", type=int, metavar="N", help="logical batch size (default 2048)")
    add("-ub", "--ubatch-size", type=int, metavar="N", help="physical batch size (default 512)")
    add("-n", "--n-predict", "--predict", type=int, metavar="N",
        help="default tokens to predict when a request sets none (default -1: unlimited)")
    add("-ngl", "--gpu-layers", "--n-gpu-layers", type=int, metavar="N",
        help="layers on the GPU (accepted; a CPU-only xllamacpp wheel ignores it)")
    add("-fa", "--flash-attn", type=_flash_attn, metavar="on|off|auto", help="flash attention")
    add("-to", "--timeout", type=int, metavar="SECONDS", help="HTTP read/write timeout")
    add("--seed", type=int, help="default sampling seed (default: random)")
    add("--temp", type=float, help="default sampling temperature (default 0.8)")
    add("--api-key", action="append", metavar="KEY", help="require this API key (repeatable)")
    add("--chat-template", metavar="JINJA_OR_NAME",
        help="chat template (default: the model's own)")
    add("--jinja", dest="jinja", action="store_true", default=None,
        help="use the jinja template engine (the default)")
    add("--no-jinja", dest="jinja", action="store_false")
    add("--metrics", action="store_true", help="enable /metrics")
    add("--props", action="store_true", help="allow POST /props")
    add("--slots", dest="slots", action="store_true", default=None,
        help="enable /slots (the default)")
    add("--no-slots", dest="slots", action="store_false")
    add("--no-webui", action="store_true", help="do not serve the web UI at /")
    add("--embedding", "--embeddings", action="store_true",
        help="serve embeddings (/v1/embeddings, /embedding) instead of generation")
    add("--pooling", choices=POOLING, metavar="{" + ",".join(POOLING) + "}",
        help="how token embeddings become one (default: the model's)")
    add("--no-warmup", action="store_true", help="skip the warm-up run at load")
    add("-v", "--verbose", action="store_true", help="log everything")
    add("--version", action="version",
        version=f"xllamacpp {_xllamacpp_version()} (llama.cpp's server, in-process)")
    return p


def build_params(args: argparse.Namespace):
    """xllamacpp.CommonParams (llama.cpp's common_params) from parsed llama-server flags."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    if args.alias:
        params.model_alias = {a.strip() for a in args.alias.split(",") if a.strip()}
    if args.ctx_size is not None:
        params.n_ctx = args.ctx_size
    if args.parallel is not None:
        params.n_parallel = args.parallel
    if args.threads is not None:
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
    if args.threads_batch is not None:
        params.cpuparams_batch.n_threads = args.threads_batch
    if args.threads_http is not None:
        params.n_threads_http = args.threads_http
    if args.batch_size is not None:
        params.n_batch = args.batch_size
    if args.ubatch_size is not None:
        params.n_ubatch = args.ubatch_size
    if args.n_predict is not None:
        params.n_predict = args.n_predict
    if args.gpu_layers is not None:
        params.n_gpu_layers = args.gpu_layers
    if args.flash_attn is not None:
        kinds = xllamacpp.llama_flash_attn_type
        params.flash_attn_type = {"on": kinds.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                  "off": kinds.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                                  "auto": kinds.LLAMA_FLASH_ATTN_TYPE_AUTO}[args.flash_attn]
    if args.timeout is not None:
        params.timeout_read = params.timeout_write = args.timeout
    if args.seed is not None:
        params.sampling.seed = args.seed
    if args.temp is not None:
        params.sampling.temp = args.temp
    if args.api_key:
        params.api_keys = list(args.api_key)
    if args.chat_template is not None:
        params.chat_template = args.chat_template
    if args.jinja is not None:
        params.use_jinja = args.jinja
    if args.slots is not None:
        params.endpoint_slots = args.slots
    params.endpoint_metrics = args.metrics
    params.endpoint_props = args.props
    if args.no_webui:
        params.ui = False
    if args.embedding:
        params.embedding = True
    if args.pooling is not None:
        params.pooling_type = getattr(xllamacpp.llama_pooling_type,
                                      f"LLAMA_POOLING_TYPE_{args.pooling.upper()}")
    if args.no_warmup:
        params.warmup = False
    if args.verbose:
        params.verbosity = 4
    return params


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import xllamacpp  # after parsing: --help and flag errors work without it

    # llama.cpp's threads must never take SIGTERM/SIGINT: a Python handler run from one of them
    # cannot wake the main thread. So both stay blocked here, in every thread the server starts
    # (they inherit this mask), and the main thread takes them with sigwait. A signal during the
    # model load waits, pending, and stops the server as soon as it is up.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        server = xllamacpp.Server(build_params(args))
    except RuntimeError:
        # llama.cpp has already logged why (e.g. "couldn't bind HTTP server socket, hostname: H,
        # port: P" then "exiting due to HTTP server error"); adding a line would push its own
        # reason out of a short output tail. llama-server exits with code 1 here too.
        return 1
    started = time.monotonic()
    signal.sigwait(stop_signals)
    # A second signal ends the process at once (llama-server force-exits too): only this
    # thread takes it, with the default action.
    for sig in stop_signals:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    time.sleep(max(0.0, started + MIN_AGE_BEFORE_STOP - time.monotonic()))
    faulthandler.dump_traceback_later(STOP_WATCHDOG, exit=True)  # a C thread: needs no GIL
    del server  # stops the HTTP server and the main loop, cancelling generation in progress
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
