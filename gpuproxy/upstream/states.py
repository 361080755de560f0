"""The words an upstream's lifecycle is told in: its `State` and the `StartFailed` of a start.

A module of its own because everything above the process manager speaks them (the run loop,
the upstream registry, the proxy's consumers, the metrics), and because `State` is the one
spelling of the five process states: whatever else lists them derives from it
(`gpuproxy.observe.metrics.MODEL_STATES`), except where gpuproxy may not be imported: the
scheduling core's constants (`scheduling.core.effects`) copy its values and must keep them.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from enum import StrEnum

OUTPUT_TAIL_LINES = 20  # lines of upstream output kept on a StartFailed
MESSAGE_TAIL_LINES = 3  # of those, shown in str(StartFailed)


class State(StrEnum):
    """An upstream's process state: `stopped → starting → ready → stopping → stopped`, plus
    `failed` (a start that failed; the next `ensure_ready()` starts from scratch)."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class StartFailed(Exception):
    """A start that did not reach `ready`.

    `reason` is `"spawn"` (the command could not be run at all), `"port_in_use"` (something
    else already listens on the model's port), `"exited"` (it exited during the start),
    `"timeout"` (no 200 from the health endpoint in time) or `"aborted"` (a stop or the
    proxy's shutdown ended the start).

    Two messages, because they go to different people: `str()` is the one line an operator
    acts on, with the command, the last output and the remedy, for the log and the admin;
    `public` is what any API client may read: the model, what happened, the port. A command
    line carries `--api-key ...`, and output carries whatever the server prints.
    """

    def __init__(self, model_id: str, reason: str, detail: str, *, summary: str = "",
                 port: int | None = None, cmd: str = "", exit_code: int | None = None,
                 output_tail: Iterable[str] = (), remedy: str = "") -> None:
        self.model_id = model_id
        self.reason = reason
        self.exit_code = exit_code
        self.output_tail = list(output_tail)
        self.cmd = cmd
        self.port = port
        message = f'model "{model_id}" {detail}'
        shown = [clip(line, 300) for line in self.output_tail if line.strip()]
        if shown:
            message += "; last output: " + " | ".join(shown[-MESSAGE_TAIL_LINES:])
        if remedy:
            message += "; " + remedy
        # Never the detail: it may hold the command line. Every caller gives a summary.
        public = f'model "{model_id}" {summary or f"could not be started ({reason})"}'
        if port is not None:
            public += f" (port {port})"
        if reason in ("spawn", "port_in_use", "exited", "timeout"):
            public += "; the proxy's log has the details"
        self.public = public
        super().__init__(message)


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
