"""`/api/performance` in llama-swap's shape (`internal/perf/types.go`): the monitor's samples
of the last hour as `sys_stats` and `gpu_stats`, optionally only those after an instant.

Pure: the samples in, plain JSON data out, so the answer can cross from the scheduler process
(which owns the one monitor under `serve --workers N`) to the request process that serves it.
Sizes are whole MiB and temperatures whole degrees, as llama-swap's Go integers; a figure the
GPU tool did not report is 0 there, and 0 here.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpuproxy.observe.inflight import rfc3339
from gpuproxy.observe.perf.parse import GpuSample
from gpuproxy.observe.perf.sample import SystemSample

MIB = 1024 * 1024
LOOPBACK = "lo"  # llama-swap leaves the loopback interface out of `net_io`


def _moment(wall: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(wall, tz=dt.UTC)


def sys_stat(s: SystemSample) -> dict[str, Any]:
    load1, load5, load15 = s.load_average
    return {
        "timestamp": rfc3339(s.taken_at),
        "cpu_util_per_core": list(s.cpu_percent),
        "mem_total_mb": s.memory_total_bytes // MIB,
        "mem_used_mb": s.memory_used_bytes // MIB,
        "mem_free_mb": s.memory_free_bytes // MIB,
        "swap_total_mb": s.swap_total_bytes // MIB,
        "swap_used_mb": s.swap_used_bytes // MIB,
        "load_avg_1": load1,
        "load_avg_5": load5,
        "load_avg_15": load15,
        "net_io": [{"name": name, "bytes_recv": received, "bytes_sent": sent}
                   for name, (received, sent) in sorted(s.network.items())
                   if name != LOOPBACK],
    }


def _int(value: float | None) -> int:
    return int(value) if value is not None else 0


def _index(gpu_id: str) -> int:
    try:
        return int(gpu_id)
    except ValueError:
        return -1  # llama-swap's id for a GPU it cannot number


def gpu_stat(taken_at: float, g: GpuSample) -> dict[str, Any]:
    return {
        "timestamp": rfc3339(taken_at),
        "id": _index(g.id),
        "name": g.name,
        "uuid": g.uuid,
        "temp_c": _int(g.temperature_celsius),
        "vram_temp_c": _int(g.vram_temperature_celsius),
        "gpu_util_pct": g.util_percent or 0.0,
        "mem_util_pct": g.memory_util_percent or 0.0,
        "mem_used_mb": _int(g.memory_used_bytes) // MIB,
        "mem_total_mb": _int(g.memory_total_bytes) // MIB,
        "fan_speed_pct": g.fan_speed_percent or 0.0,
        "power_draw_w": g.power_draw_watts or 0.0,
    }


def performance(samples: list[SystemSample], after: dt.datetime | None) -> dict[str, Any]:
    """The body of `/api/performance` while monitoring is on: samples taken strictly after
    `after`, or all of them. Compared as the instants the client was shown (`_moment`), so
    a sample's own timestamp sent back as `after` leaves that sample out."""
    kept = [s for s in samples if after is None or _moment(s.taken_at) > after]
    return {
        "enabled": True,
        "sys_stats": [sys_stat(s) for s in kept],
        "gpu_stats": [gpu_stat(s.taken_at, g) for s in kept for g in s.gpus],
    }
