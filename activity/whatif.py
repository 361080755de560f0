"""The activity log's window as `scheduling.whatif` replays it: the requests that ran, the swap
costs measured from the window's own loads, and what was loaded when it began.

`gpuproxy whatif` and the settings page's what-if panel (`GET /api/whatif`) both call
`report`; the replay itself is plain Python (`scheduling/whatif.py`). Runs in a worker thread
or a command: it uses the ORM.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from activity import events
from activity.models import ModelEvent, RequestLog
from scheduling.catalog import Catalog
from scheduling.catalog_db import build_catalog
from scheduling.core.config import SchedulerConfig
from scheduling.guarantees import format_duration
from scheduling.whatif import (
    Recorded,
    Replayable,
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
#: a request running when the window begins enters the replay this much before its start,
#: so that it takes its slot before the requests that were waiting then
RUNNING_EARLIER = dt.timedelta(milliseconds=1)

NEVER_RAN = "never dispatched (rejected, cancelled or failed before a grant: no service time)"
PEER = "served by a peer (not this box's GPU)"
UNDEFINED = "for a model no longer defined"
UNFINISHED = "still running"
TRIMMED = "older than the newest {n:,} (the most one replay takes)"


def report(start: dt.datetime, end: dt.datetime, **asked: Any) -> Report:
    """Replay [start, end) under today's settings and under the ones asked (`prepare`'s
    arguments), here."""
    return compare(*prepare(start, end, **asked))


def prepare(start: dt.datetime, end: dt.datetime, *, scheduler: str | None = None,
            aging_divisor: float | None = None, swap_affinity_bonus: float | None = None,
            affinity_budget: str | None = None, swap_cost: float | None = None,
            models: Sequence[str] = (), config: SchedulerConfig | None = None,
            ttl: dict[str, float] | None = None) -> Replayable:
    """What `scheduling.whatif.compare` takes, read from the database: the window, today's
    config, the settings asked (checked), notes and the ttls. The settings page's panel runs
    the compare in a process of its own (gpuproxy/api/whatif.py); the command, here.

    `config` and `ttl` are the catalog's unless given (tests give them). `swap_cost`: seconds
    per swap for every model, instead of the measured ones. `models`: only their requests
    count in the figures; every request is replayed, since they all shared the box. Raises
    `WhatIfError` for settings the settings page refuses.
    """
    if end <= start:
        raise WhatIfError("the window ends before it starts: give --from earlier than --to")
    if swap_cost is not None and not (math.isfinite(swap_cost) and swap_cost > 0):
        raise WhatIfError("--swap-cost must be auto or a positive number of seconds")
    if config is None:  # today's: the catalog's models, swap rules, settings and ttls
        catalog = build_catalog()
        config, ttl = catalog.scheduler_config(), ttls(catalog)
    other, notes = variant(settings_of(config), scheduler, aging_divisor, swap_affinity_bonus,
                           affinity_budget)
    window = read_window(start, end, config, models, swap_cost)
    unknown = sorted(set(models) - {r.model for r in window.rows if r.reported})
    if unknown:
        notes.append("no replayed request for " + ", ".join(unknown))
    return window, config, other, tuple(notes), ttl


_FIELDS = ("received_at", "dispatched_at", "finished_at", "model", "priority", "queue_wait_ms",
           "scheduler")


def ttls(catalog: Catalog) -> dict[str, float]:
    """Each model's idle unload in force (its own `ttl`, else `globalTTL`), for the replay."""
    return {m: float(c.ttl) for m, c in catalog.models.items() if c.ttl > 0}


def read_window(start: dt.datetime, end: dt.datetime, config: SchedulerConfig,
                models: Sequence[str] = (), swap_cost: float | None = None) -> Window:
    """The requests received in [start, end) that ran, newest first up to `MAX_REQUESTS` (the
    window then starts at the oldest taken); and, uncounted, those received before the window
    and still running or waiting when it began, since they held the box: a replay without
    them would start emptier than it was."""
    left_out = {NEVER_RAN: 0, PEER: 0, UNDEFINED: 0, UNFINISHED: 0}
    taken: list[tuple[dt.datetime, Recorded]] = []  # (arrival, the row with arrival 0)
    cut = start  # where the replay starts: the window's start, or its oldest taken request
    oldest = start  # the received_at of the oldest taken so far
    inside = (RequestLog.objects.filter(received_at__gte=start, received_at__lt=end)
              .order_by("-received_at").values_list(*_FIELDS))
    for row in inside.iterator(chunk_size=5000):
        if len(taken) >= MAX_REQUESTS:
            cut = oldest
            left_out[TRIMMED.format(n=MAX_REQUESTS)] = RequestLog.objects.filter(
                received_at__gte=start, received_at__lt=cut).count()
            break
        why = _why_not(row, config)
        if why:
            left_out[why] += 1
        else:
            taken.append(_recorded(row, reported=not models or row[3] in models))
            oldest = row[0]
    taken += _held_the_box(cut, config)
    rows = tuple(dataclasses.replace(r, arrival=(at - cut).total_seconds())
                 for at, r in sorted(taken, key=lambda t: t[0]))
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
                  preload=loaded_at(cut, config.models, rows),
                  recorded_swaps=recorded_loads(cut, last))


def _held_the_box(cut: dt.datetime, config: SchedulerConfig
                  ) -> list[tuple[dt.datetime, Recorded]]:
    """The requests received before `cut` (within `LEAD`) that had not finished by then, to
    replay uncounted: one already running holds its slot from the start (entering just
    before it, on its loaded model) for what was left of its service; one still waiting
    enters at the start, aged from its arrival."""
    out = []
    for row in (RequestLog.objects.filter(received_at__gte=cut - LEAD, received_at__lt=cut,
                                          finished_at__gt=cut).values_list(*_FIELDS)):
        if _why_not(row, config):
            continue
        arrived, rec = _recorded(row, reported=False)
        dispatched, finished = row[1], row[2]
        if dispatched < cut:
            out.append((cut - RUNNING_EARLIER, dataclasses.replace(
                rec, service=(finished - cut + RUNNING_EARLIER).total_seconds(), wait=0.0)))
        else:
            out.append((arrived, dataclasses.replace(rec, enters=0.0)))
    return out


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


__all__ = ["WhatIfError", "prepare", "read_window", "report"]
