"""The ways a request can be refused, each knowing its HTTP status, code and headers.

The core never raises for an expected outcome: it hands one of these to `Effects.grant_error`,
and the shell renders it once, as an OpenAI-style error.
"""

from __future__ import annotations


class SchedulingError(Exception):
    status = 500
    code = "scheduler_error"
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        return {}


class ModelNotFound(SchedulingError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"

    def __init__(self, model: str, why: str = "") -> None:
        super().__init__(f"model {model!r} is not served: {why}" if why else
                         f"model {model!r} is not defined; GET /v1/models lists the models and "
                         "aliases this proxy serves")
        self.model = model


class ConcurrencyLimit(SchedulingError):
    status = 429
    code = "concurrency_limit"
    type = "rate_limit_error"

    def __init__(self, model: str, limit: int) -> None:
        super().__init__(f"Too many requests: model {model!r} already has {limit} admitted "
                         "(its concurrencyLimit); retry shortly")
        self.model = model
        self.limit = limit

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class QueueFull(SchedulingError):
    """The wait queue (or the request's band of it) is at its cap: refused before waiting,
    so a flood cannot grow the queue without bound."""

    status = 429
    code = "queue_full"
    type = "rate_limit_error"

    def __init__(self, scope: str, limit: int) -> None:
        super().__init__(f"Too many requests waiting: {scope} already holds {limit} "
                         "(queue.maxWaiting); retry later")
        self.scope = scope
        self.limit = limit

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


class QueueTimeout(SchedulingError):
    """The request waited longer than its queue deadline (X-LlamaSwap-Queue-Timeout, or the
    `queue.timeout` default) without being dispatched."""

    status = 503
    code = "queue_timeout"
    type = "server_error"

    def __init__(self, model: str, seconds: float) -> None:
        super().__init__(f"model {model!r} could not be served within the queue deadline of "
                         f"{seconds:g} s; retry later or allow a longer wait "
                         "(X-LlamaSwap-Queue-Timeout)")
        self.model = model
        self.seconds = seconds


class SwapFailed(SchedulingError):
    status = 502
    code = "start_failed"
    type = "upstream_error"

    def __init__(self, model: str, detail: str, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.model = model
        if timed_out:
            self.status = 504
            self.code = "start_timeout"


class ShuttingDown(SchedulingError):
    status = 503
    code = "shutting_down"
    type = "server_error"

    def __init__(self) -> None:
        super().__init__("gpuproxy is shutting down; retry against the restarted proxy")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


class SchedulerUnavailable(SchedulingError):
    """`serve --workers N`: the scheduler process is gone (it is being restarted), so no
    grant can come. A waiting request gets this, never a replay."""

    status = 503
    code = "scheduler_unavailable"
    type = "server_error"

    def __init__(self) -> None:
        super().__init__("gpuproxy's scheduler process is restarting; the models it ran were "
                         "stopped with it; retry shortly")

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "2"}
