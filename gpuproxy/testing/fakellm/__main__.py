"""The fake upstream's command line: ``python -m gpuproxy.testing.fakellm --port P ...``.

Only argument parsing lives here, so that what the process can be told is in one screen. The
package's `__init__` never imports this module: `python -m` then runs it exactly once (runpy
warns on stderr when a package has already imported its own `__main__`, and tests read stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from gpuproxy.testing.fakellm.endpoints import DEFAULT_MODEL, FakeLLM


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number: {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpuproxy.testing.fakellm",
        description="A fake OpenAI-compatible inference server for tests and benchmarks.",
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name to report")
    parser.add_argument(
        "--tps",
        type=_non_negative_float,
        default=0.0,
        help="generated tokens per second (default 0: as fast as possible)",
    )
    parser.add_argument(
        "--load-seconds",
        type=_non_negative_float,
        default=0.0,
        help="answer 503 'Loading model' for this long after binding",
    )
    parser.add_argument(
        "--ignore-sigterm", action="store_true", help="ignore SIGTERM (SIGINT/SIGKILL still work)"
    )
    parser.add_argument(
        "--crash-after",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the Nth model request sends its headers (and half its tokens), then exits 3",
    )
    parser.add_argument(
        "--exit-on-start",
        type=int,
        default=None,
        metavar="CODE",
        help="exit with CODE right after binding (a server that dies while loading)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Console entry point: parse, serve, exit with the server's code."""
    args = build_parser().parse_args(argv)
    code = asyncio.run(FakeLLM(args).run())
    sys.exit(code)


if __name__ == "__main__":
    main()
