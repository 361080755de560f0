"""`/api/hardware`: what this machine is (OS, CPU, memory, accelerators), in llama-swap's
`HardwareSnapshot` shape (`internal/hw/types.go`, schema version 1).

Taken once per process, the first time it is asked for, on a worker thread (it runs
`nvidia-smi`, which can take a second), and kept: hardware does not change under a running
proxy. Every process of `serve --workers N` runs on the same machine, so each takes its own
instead of asking the scheduler process. Detection is best effort, as llama-swap's: a figure
that cannot be read is null, an absent `nvidia-smi` means no accelerators listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime as dt
import io
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

# psutil ships no type information and types-psutil is not a dependency of the project.
import psutil  # type: ignore[import-untyped]

from gpuproxy.version import version_info

SCHEMA_VERSION = 1
NVIDIA_FIELDS = "index,name,uuid,memory.total,driver_version,power.limit"
TOOL_TIMEOUT = 10.0

_ARCHITECTURES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64",
                  "ppc64le": "ppc64le", "riscv64": "riscv64", "s390x": "s390x",
                  "armv7l": "armv7"}


def _architecture(raw: str) -> dict[str, Any]:
    name = _ARCHITECTURES.get(raw.lower(), "other")
    return {"name": name, "raw_name": None if name == raw else raw}


def _os_release() -> dict[str, str]:
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key.strip()] = value.strip().strip('"')
    return fields


def _operating_system() -> dict[str, Any]:
    system = platform.system().lower()
    family = {"linux": "linux", "darwin": "macos", "windows": "windows",
              "freebsd": "freebsd"}.get(system, "other")
    release = _os_release() if family == "linux" else {}
    out: dict[str, Any] = {"family": family, "name": release.get("ID") or None,
                           "version": release.get("VERSION_ID") or None,
                           "kernel": platform.release() or None}
    if family == "other":
        out["raw_family"] = system
    return out


def _environment() -> dict[str, Any]:
    if Path("/.dockerenv").exists():
        return {"kind": "container", "name": "Docker", "version": None}
    if Path("/run/.containerenv").exists():
        return {"kind": "container", "name": "Podman", "version": None}
    with contextlib.suppress(OSError):
        if "microsoft" in Path("/proc/version").read_text().lower():
            return {"kind": "wsl", "name": "WSL", "version": None}
    return {"kind": "unknown", "name": None, "version": None}


def _cpu() -> dict[str, Any]:
    vendor = model = None
    sockets: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "vendor_id" and vendor is None:
                vendor = value or None
            elif key == "model name" and model is None:
                model = value or None
            elif key == "physical id":
                sockets.add(value)
    logical = psutil.cpu_count(logical=True) or None
    physical = psutil.cpu_count(logical=False) or None
    return {"vendor": vendor, "model": model, "socket_count": len(sockets) or None,
            "physical_core_count": physical, "logical_thread_count": logical}


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None  # "[N/A]"


def _nvidia() -> list[dict[str, Any]]:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        output = subprocess.run(
            [tool, f"--query-gpu={NVIDIA_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found: list[dict[str, Any]] = []
    for row in csv.reader(io.StringIO(output), skipinitialspace=True):
        if len(row) != 6:
            continue
        index, name, _uuid, memory_mib, driver, power = (c.strip() for c in row)
        mib = _number(memory_mib)
        limit = _number(power)
        found.append({
            "index": int(index) if index.isdigit() else len(found),
            "kind": "gpu", "vendor": "NVIDIA", "model": name or None, "architecture": None,
            "memory": {"kind": "dedicated",
                       "capacity_bytes": int(mib * 1024 * 1024) if mib else None},
            "driver": {"name": "NVIDIA", "version": driver} if driver else None,
            "power_limit_watts": limit if limit else None,
        })
    return found


def detect() -> dict[str, Any]:
    """The snapshot, now (blocking: it may run `nvidia-smi`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "captured_at": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
        "capture": {"scope": "inference_host", "method": "detected",
                    "detector": {"name": "gpuproxy",
                                 "version": version_info()["version"]}},
        "architecture": _architecture(platform.machine() or os.uname().machine),
        "operating_system": _operating_system(),
        "environment": _environment(),
        "cpu": _cpu(),
        "memory": {"capacity_bytes": int(psutil.virtual_memory().total)},
        "accelerators": _nvidia(),
    }


_snapshot: asyncio.Future[dict[str, Any]] | None = None


async def snapshot() -> dict[str, Any]:
    """This process's snapshot, taken on a worker thread the first time (one detection, however
    many ask at once)."""
    global _snapshot
    if _snapshot is None:
        _snapshot = asyncio.ensure_future(asyncio.to_thread(detect))
    return await asyncio.shield(_snapshot)
