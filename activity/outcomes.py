"""The documented outcome set of a request in the activity log (`RequestLog.outcome`).

Each request ends in exactly one of these; analysts filter and group on them.
"""

from __future__ import annotations

OK = "ok"
UPSTREAM_ERROR = "upstream_error"
REJECTED_CAPACITY = "rejected_capacity"
REJECTED_QUEUE = "rejected_queue"
QUEUE_TIMEOUT = "queue_timeout"
CANCELLED_QUEUED = "cancelled_queued"
CANCELLED_INFLIGHT = "cancelled_inflight"
CANCELLED_BY_ADMIN = "cancelled_by_admin"
START_FAILED = "start_failed"
UPSTREAM_DIED = "upstream_died"
UPSTREAM_STOPPED = "upstream_stopped"
BAD_REQUEST = "bad_request"
UNKNOWN_MODEL = "unknown_model"
UNAUTHORIZED = "unauthorized"
SHUTTING_DOWN = "shutting_down"

#: outcome -> one-line description (also the documentation of the set).
DESCRIPTIONS: dict[str, str] = {
    OK: "served: the upstream answered with a success status and the response was relayed",
    UPSTREAM_ERROR: "the upstream answered with an error status (4xx/5xx), relayed to the client",
    REJECTED_CAPACITY: "refused with 429 because the model is at its concurrency limit",
    REJECTED_QUEUE: "refused with 429 because the wait queue was full",
    QUEUE_TIMEOUT: "waited in the queue longer than allowed and was answered with an error",
    CANCELLED_QUEUED: "the client left while waiting in the queue or on a model load",
    CANCELLED_INFLIGHT: "the client left while the upstream was answering (mid-stream)",
    CANCELLED_BY_ADMIN: "an operator cancelled it from the dashboard while it was being served",
    START_FAILED: "the model's server could not be started (or never became ready)",
    UPSTREAM_DIED: "the model's server died or dropped the connection while answering",
    UPSTREAM_STOPPED: "the model's server was stopped (an unload, a restart or the proxy's "
                      "shutdown) while answering",
    BAD_REQUEST: "the request was malformed (bad JSON, no model, body too large)",
    UNKNOWN_MODEL: "the requested model is not defined (404)",
    UNAUTHORIZED: "no or a wrong API key (401)",
    SHUTTING_DOWN: "refused or cut because the proxy was shutting down",
}

ALL: tuple[str, ...] = tuple(DESCRIPTIONS)

#: Django field choices: (value, label).
CHOICES: list[tuple[str, str]] = [(value, value.replace("_", " ")) for value in ALL]

MAX_LENGTH = 32
