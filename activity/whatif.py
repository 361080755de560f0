"""The activity log's window as `scheduling.whatif` replays it: the requests that ran, the swap
costs measured from the window's own loads, and what was loaded when it began.

`gpuproxy whatif` and the settings page's what-if panel (`GET /api/whatif`) both call
`report`; the replay itself is plain Python (`scheduling/whatif.py`). Runs in a worker thread
or a command: it uses the ORM.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
from collections.abc import Iterable, Sequence

from activity import events
from activity.models import ModelEvent, RequestLog
from scheduling.catalog_db import build_catalog
from scheduling.core.config import SchedulerConfig
from scheduling.guarantees import format_duration
from scheduling.whatif import (
    Recorded,
    Report,
    WhatIfError,
    Window,
    compare,
    settings_of,
    variant,
)

#: a model whose swap cost nothing in the log measures is assumed to take this long
DEFAULT_SWAP_COST = 10.0
#: loads before the window that measure a model when the window has none
LOADS_BEFORE = 20
#: the most requests one replay takes: the newest of a longer window
MAX_REQUESTS = 100_000
#: how far before the window to look for requests still waiting or running when it began
LEAD = dt.timedelta(hours=24)

NEVER_RAN = "never dispatched (rejected, cancelled or failed before a grant: no service time)"
PEER = "served by a peer (not this box's GPU)"
UNDEFINED = "for a model no longer defined"
UNFINISHED = "still running"
TRIMMED = "older than the newest {n:,} (the most one replay takes)"
_STOPPED = (events.UNLOAD, events.IDLE_UNLOAD, events.CRASH, events.START_FAILED)


def report(start: dt.datetime, end: dt.datetime, *, scheduler: str | None = None,
           aging_divisor: float | None = None, swap_affinity_bonus: float | None = None,
           swap_cost: float | None = None, models: Sequence[str] = (),
           config: SchedulerConfig | None = None,
           ttl: dict[str, float] | None = None) -> Report:
    """Replay [start, end) under today's settings (the catalog's) and under these ones.

    `config` and `ttl` are the catalog's unless given (tests give them).
    `swap_cost`: seconds per swap for every model, instead of the measured ones. `models`:
    only their requests count in the figures; every request is replayed, since they all
    shared the box. Raises `WhatIfError` for settings the settings page refuses or a window
    with nothing to replay.
    """
    if end <= start:
        raise WhatIfError("the window ends before it starts: give --from earlier than --to")
    if swap_cost is not None and not swap_cost > 0:
        raise WhatIfError("--swap-cost must be auto or a positive number of seconds")
    if config is None:  # today's: the catalog's models, swap rules, settings and ttls
        catalog = build_catalog()
        config = catalog.scheduler_config()
        ttl = {m: float(c.ttl) for m, c in catalog.models.items() if c.ttl > 0}
    other, notes = variant(settings_of(config), scheduler, aging_divisor, swap_affinity_bonus)
    window = read_window(start, end, config, models, swap_cost)
    unknown = sorted(set(models) - {r.model for r in window.rows})
    if unknown:
        notes.append("no replayed request for " + ", ".join(unknown))
    return compare(window, config, other, notes, ttl)


_FIELDS = ("received_at", "dispatched_at", "finished_at", "model", "priority", "queue_wait_ms",
           "scheduler")


def read_window(start: dt.datetime, end: dt.datetime, config: SchedulerConfig,
                models: Sequence[str] = (), swap_cost: float | None = None) -> Window:
    """The requests received in [start, end) that ran, newest first up to `MAX_REQUESTS`;
    and, uncounted, those received before the window and still waiting or running when it
    began: they held the box, so a replay without them would start emptier than it was."""
    left_out = {NEVER_RAN: 0, PEER: 0, UNDEFINED: 0, UNFINISHED: 0}
    taken: list[tuple[dt.datetime, Recorded]] = []  # (arrival, the row with arrival 0)
    cut = start  # the window's start; later when it holds more than one replay takes
    trimmed = 0
    inside = (RequestLog.objects.filter(received_at__gte=start, received_at__lt=end)
              .order_by("-received_at").values_list(*_FIELDS))
    for row in inside.iterator(chunk_size=5000):
        why = _why_not(row, config)
        if why:
            left_out[why] += 1
        elif trimmed or len(taken) >= MAX_REQUESTS:
            if not trimmed:
                cut = taken[-1][0]
            if row[2] > cut:  # older, still running at the new start: it held the box
                taken.append(_recorded(row, reported=False))
            trimmed += 1
        else:
            taken.append(_recorded(row, reported=not models or row[3] in models))
    if trimmed:
        left_out[TRIMMED.format(n=MAX_REQUESTS)] = trimmed
    else:
        running = (RequestLog.objects.filter(received_at__gte=start - LEAD, received_at__lt=start,
                                             finished_at__gt=start)
                   .values_list(*_FIELDS))
        taken += [_recorded(row, reported=False) for row in running if not _why_not(row, config)]
    taken.sort(key=lambda t: t[0])
    origin = min(cut, taken[0][0]) if taken else cut
    rows = tuple(dataclasses.replace(r, arrival=(at - cut).total_seconds()) for at, r in taken)
    last = max((cut + dt.timedelta(seconds=r.arrival + r.wait + r.service) for r in rows),
               default=end)
    load: dict[str, float] = {}
    basis: dict[str, str] = {}
    if swap_cost is None:
        load, basis = measure_swap_costs(cut, end, {r.model for r in rows})
    return Window(label=label(cut, end), rows=rows,
                  left_out={k: v for k, v in left_out.items() if v}, load=load,
                  load_basis=basis,
                  swap_cost=DEFAULT_SWAP_COST if swap_cost is None else swap_cost,
                  preload=loaded_at(origin, config.models, rows),
                  recorded_swaps=recorded_loads(origin, last))


def _why_not(row: tuple, config: SchedulerConfig) -> str | None:
    """Why this row cannot be replayed, or None."""
    _received, dispatched, finished, model, _priority, _wait, scheduler = row
    if dispatched is None:
        return NEVER_RAN
    if scheduler == "peer" or model in config.peer_models:
        return PEER
    if model not in config.models:
        return UNDEFINED
    if finished is None:
        return UNFINISHED
    return None


def _recorded(row: tuple, reported: bool) -> tuple[dt.datetime, Recorded]:
    received, dispatched, finished, model, priority, wait_ms, _scheduler = row
    # the arrival the scheduler aged from (a trusted peer's request: its first one)
    arrived = dispatched - dt.timedelta(milliseconds=wait_ms) if wait_ms is not None \
        else received
    return arrived, Recorded(arrival=0.0, model=model, priority=priority,
                             service=max(0.0, (finished - dispatched).total_seconds()),
                             wait=(wait_ms or 0.0) / 1000, reported=reported)


def measure_swap_costs(start: dt.datetime, end: dt.datetime, models: Iterable[str]
                       ) -> tuple[dict[str, float], dict[str, str]]:
    """Each model's swap: the median of its loads (spawn → ready) in the window, else of its
    last loads before it, else the median wait of its requests for a load; plus the median
    stop of a model evicted for a swap in the window, which the swap waited for too."""
    stops = _median(ModelEvent.objects.filter(at__gte=start, at__lt=end, kind=events.UNLOAD,
                                              reason=events.SWAP, duration_ms__isnull=False)
                    .values_list("duration_ms", flat=True))
    stop = (stops or 0.0) / 1000
    load: dict[str, float] = {}
    basis: dict[str, str] = {}
    for model in sorted(models):
        ready = ModelEvent.objects.filter(model=model, kind=events.READY,
                                          duration_ms__isnull=False)
        inside = list(ready.filter(at__gte=start, at__lt=end).values_list("duration_ms",
                                                                            flat=True))
        if inside:
            how = f"median of {len(inside)} load{'s' * (len(inside) != 1)} in the window"
        else:
            inside = list(ready.filter(at__lt=start).order_by("-at")
                          .values_list("duration_ms", flat=True)[:LOADS_BEFORE])
            how = f"median of its last {len(inside)} load{'s' * (len(inside) != 1)} before"
        if not inside:
            inside = list(RequestLog.objects.filter(
                model=model, received_at__gte=start, received_at__lt=end,
                swap_ms__isnull=False).values_list("swap_ms", flat=True))
            how = f"median wait of {len(inside)} of its requests for its load"
            if not inside:
                continue
            stop_part = 0.0  # a request's wait for a load includes the stop before it
        else:
            stop_part = stop
        load[model] = (_median(inside) or 0.0) / 1000 + stop_part
        basis[model] = how + (f" + a stop of {format_duration(stop)}" if stop_part else "")
    return load, basis


def loaded_at(start: dt.datetime, defined: Iterable[str], rows: Sequence[Recorded]
              ) -> tuple[str, ...]:
    """The models loaded when the window starts: the last event of each before it is a load
    or its ready. A log without model events: the first request's model, if it waited for no
    load (its recorded wait was under a second)."""
    last: dict[str, str] = {}
    for model in sorted(set(defined)):  # one indexed lookup each: (model, at)
        kind = (ModelEvent.objects.filter(model=model, at__lt=start)
                .exclude(kind=events.RESTART).order_by("-at")
                .values_list("kind", flat=True).first())
        if kind is not None:
            last[model] = kind
    if last:
        return tuple(sorted(m for m, k in last.items() if k in (events.LOAD, events.READY)))
    if rows and rows[0].wait < 1.0 and not ModelEvent.objects.exists():
        return (rows[0].model,)
    return ()


def recorded_loads(start: dt.datetime, end: dt.datetime) -> int | None:
    """Loads the log has from the first replayed arrival to the last replayed request's end
    (None when the log has no model events at all, as before they were recorded)."""
    if not ModelEvent.objects.exists():
        return None
    return ModelEvent.objects.filter(at__gte=start, at__lte=end, kind=events.LOAD).count()


def label(start: dt.datetime, end: dt.datetime) -> str:
    span = format_duration((end - start).total_seconds())
    a, b = start.astimezone(dt.UTC), end.astimezone(dt.UTC)
    return f"{a:%Y-%m-%d %H:%M:%S} → {b:%Y-%m-%d %H:%M:%S} UTC ({span})"


def _median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


__all__ = ["WhatIfError", "read_window", "report"]
