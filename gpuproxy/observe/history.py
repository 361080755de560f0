"""The last hour in one-minute buckets, and the last requests, for the dashboard's charts.

Prometheus keeps the long history; this is what an operator sees without one: queue wait per
band, dispatches and swaps per minute, and the most recent finished requests. Fed by
gpuproxy/observe/metrics.py where those facts are counted, on the event loop's thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduling.core.priority import BANDS

MINUTES = 60
RECENT = 50


@dataclass
class _Minute:
    start: int  # unix time of the minute
    waits: dict[str, list[float]] = field(default_factory=lambda: {b: [0, 0.0, 0.0]
                                                                   for b in BANDS})
    swaps: int = 0


class History:
    def __init__(self) -> None:
        self._minutes: deque[_Minute] = deque(maxlen=MINUTES)
        self._recent: deque[Mapping[str, Any]] = deque(maxlen=RECENT)

    def _bucket(self, now: float) -> _Minute:
        start = int(now // 60 * 60)
        if not self._minutes or self._minutes[-1].start != start:
            self._minutes.append(_Minute(start))
        return self._minutes[-1]

    def dispatch(self, band: str, wait: float, now: float | None = None) -> None:
        count_sum_max = self._bucket(time.time() if now is None else now).waits[band]
        count_sum_max[0] += 1
        count_sum_max[1] += wait
        count_sum_max[2] = max(count_sum_max[2], wait)

    def swap(self, now: float | None = None) -> None:
        self._bucket(time.time() if now is None else now).swaps += 1

    def request(self, row: Mapping[str, Any]) -> None:
        """Keep the finished row itself (nothing changes it once submitted): it is shaped for
        the dashboard only when one asks (`recent_rows`), not on every request."""
        self._recent.appendleft(row)

    def recent_rows(self) -> list[dict[str, Any]]:
        """The most recent finished requests, newest first, as the dashboard shows them."""
        return [{
            "request_id": str(row["request_id"]),
            "time": row["finished_at"].isoformat(),
            "model": row["model"] or row["model_requested"],
            "band": row["band"],
            "outcome": row["outcome"],
            "status": row["status_code"],
            "path": row["path"],
            "duration_ms": row["duration_ms"],
            "queue_wait_ms": row["queue_wait_ms"],
            "ttft_ms": row["ttft_ms"],
            "completion_tokens": row["completion_tokens"],
        } for row in list(self._recent)]

    def view(self, now: float | None = None) -> dict[str, Any]:
        """Sixty one-minute points ending with the current minute; null where nothing was
        dispatched in a band that minute (no wait to show is not a wait of 0)."""
        now = time.time() if now is None else now
        last = int(now // 60 * 60)
        by_start = {m.start: m for m in self._minutes}
        starts = [last - 60 * i for i in range(MINUTES - 1, -1, -1)]
        out: dict[str, Any] = {"minute": starts, "swaps": [], "dispatched": {},
                               "queue_wait_avg_s": {}, "queue_wait_max_s": {}}
        for b in BANDS:
            out["dispatched"][b] = []
            out["queue_wait_avg_s"][b] = []
            out["queue_wait_max_s"][b] = []
        for s in starts:
            m = by_start.get(s)
            out["swaps"].append(m.swaps if m else 0)
            for b in BANDS:
                n, total, top = m.waits[b] if m else (0, 0.0, 0.0)
                out["dispatched"][b].append(n)
                out["queue_wait_avg_s"][b].append(round(total / n, 3) if n else None)
                out["queue_wait_max_s"][b].append(round(top, 3) if n else None)
        return out


HISTORY = History()
