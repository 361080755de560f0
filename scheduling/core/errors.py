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

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} is not defined; GET /v1/models lists the models and "
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
