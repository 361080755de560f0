"""What a 0 or an empty value means, in words, where the admin shows it.

llama-swap's configuration uses 0 (or leaving a key out) for "the default", and the default
depends on other settings: a model's `concurrencyLimit` 0 is 10 under fifo and no limit of its
own under serial (scheduling/core/ledger.py `limit_for`), a `ttl` of -1 is the global TTL,
itself 0 for "never". A bare `0` in a list reads as "zero requests allowed"; these say what
is in force. The texts are the rules of scheduling/core and scheduling/models.py, written
once here for the model list and the settings page.
"""

from __future__ import annotations

from scheduling.core.config import DEFAULT_CONCURRENCY_LIMIT
from scheduling.models import ProxySettings

CONCURRENCY_DEFAULT = (f"default: {DEFAULT_CONCURRENCY_LIMIT} under fifo, "
                       "no limit under serial")


def concurrency(limit: int) -> str:
    """ "0 (default: 10 under fifo, no limit under serial)", or the limit itself."""
    if limit > 0:
        return str(limit)
    return f"0 ({CONCURRENCY_DEFAULT})"


def seconds(value: int) -> str:
    if value % 3600 == 0:
        return f"{value // 3600} h"
    if value % 60 == 0 and value >= 60:
        return f"{value // 60} min"
    return f"{value} s"


def ttl(value: int, global_ttl: int) -> str:
    """A model's idle TTL: -1 is the global one (whose 0 is never), 0 is never."""
    if value == -1:
        inherited = "never" if global_ttl <= 0 else seconds(global_ttl)
        return f"-1 (global: {inherited})"
    if value == 0:
        return "0 (never)"
    return seconds(value)


def settings_meanings(s: ProxySettings) -> list[str]:
    """The settings page's zeros and blanks, each with what it does now: the help texts say
    the rule, this says the outcome for the values saved."""
    lines = []
    lines.append("global TTL: " + ("0 = models whose ttl is -1 never unload for idleness"
                                   if s.global_ttl == 0 else
                                   f"models whose ttl is -1 unload after {seconds(s.global_ttl)}"
                                   " idle"))
    lines.append(f"unload timeout: models whose own is 0 get {seconds(s.unload_timeout)} "
                 "between SIGTERM and SIGKILL")
    lines.append("max waiting: " + ("0 = no cap on waiting requests" if s.max_waiting == 0 else
                                    f"{s.max_waiting:,} requests may wait, all bands together"))
    for band in ("interactive", "normal", "batch"):
        cap = getattr(s, f"max_waiting_{band}")
        lines.append(f"max waiting, {band}: " + ("0 = no band cap" if cap == 0 else
                                                f"{cap:,} at most"))
    lines.append("queue timeout: " + ("0 = a request waits as long as it takes"
                                      if s.queue_timeout == 0 else
                                      f"503 queue_timeout after {seconds(s.queue_timeout)}"))
    bounds = (s.priority_min, s.priority_max, s.priority_default)
    lines.append("trusted priority: " + (
        "all empty = requests without a key's range are not clamped"
        if all(b is None for b in bounds) else
        f"min {_or_open(s.priority_min)}, max {_or_open(s.priority_max)}, default "
        f"{'0' if s.priority_default is None else s.priority_default}"))
    lines.append("capture buffer: " + ("0 = no captures kept" if s.capture_buffer_mb == 0 else
                                       f"{s.capture_buffer_mb} MB of captures"))
    lines.append(f"models' concurrencyLimit 0: {CONCURRENCY_DEFAULT} (now {s.scheduler}: "
                 + (f"{DEFAULT_CONCURRENCY_LIMIT} per model" if s.scheduler == "fifo"
                    else "no limit of its own; the waiting caps above bound it") + ")")
    return lines


def _or_open(value: int | None) -> str:
    return "none" if value is None else str(value)
