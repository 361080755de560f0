"""`/dashboard/about`: what this proxy is and runs on, for an operator or a bug report: the
build, Python and Django, the machine (`/api/hardware`'s snapshot, taken once per process),
the scheduler settings in force, the config file last imported, the database's vendor.

Never a secret, a command line or an environment: the database is named by vendor and server
version only (its URL holds a password), the config by its path (not its content: keys), and
no upstream's `cmd` or `env` appears.
"""

from __future__ import annotations

import platform
from typing import Any

import django
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse

from dashboard.pages.common import render_page
from gpuproxy.observe import hardware
from gpuproxy.shell import runtime
from gpuproxy.version import version_info
from scheduling.catalog import Catalog

GIB = 1024 ** 3


def gib(n: int | None) -> str:
    return "unknown" if not n else f"{n / GIB:.1f} GiB"


def scheduler_summary(catalog: Catalog) -> list[tuple[str, str]]:
    """The settings in force (the catalog the proxy runs with), as (name, value) lines."""
    caps = ", ".join(f"{band} {n}" for band, n in sorted(catalog.max_waiting_per_band.items())
                     if n)
    return [
        ("scheduler", catalog.scheduler),
        ("swap affinity bonus", str(catalog.swap_affinity_bonus)),
        ("aging divisor", f"{catalog.aging_divisor:g} s"),
        ("router", catalog.router),
        ("queue cap", str(catalog.max_waiting) if catalog.max_waiting else "none"),
        ("queue cap per band", caps or "none"),
        ("queue timeout", f"{catalog.queue_timeout:g} s" if catalog.queue_timeout else "none"),
        ("models", str(len(catalog.models))),
        ("performance monitoring", f"every {catalog.performance_interval:g} s"
         if catalog.performance_monitoring else "off"),
        ("capture buffer", f"{catalog.capture_buffer_mb} MB"
         if catalog.capture_buffer_mb else "off"),
        ("API keys", f"{len(catalog.api_keys)} ({len(catalog.admin_keys)} admin)"
         if catalog.api_keys else "none: every client is let in"),
    ]


def machine(snapshot: dict[str, Any]) -> list[tuple[str, str]]:
    """The hardware snapshot as (name, value) lines."""
    cpu = snapshot.get("cpu") or {}
    system = snapshot.get("operating_system") or {}
    cores = [f"{cpu['physical_core_count']} cores" if cpu.get("physical_core_count") else "",
             f"{cpu['logical_thread_count']} threads" if cpu.get("logical_thread_count") else ""]
    lines = [
        ("CPU", " · ".join(part for part in (cpu.get("model") or "unknown",
                                             ", ".join(c for c in cores if c)) if part)),
        ("memory", gib((snapshot.get("memory") or {}).get("capacity_bytes"))),
        ("system", " ".join(str(v) for v in (system.get("name") or system.get("family"),
                                             system.get("version"), system.get("kernel"))
                            if v)),
        ("architecture", (snapshot.get("architecture") or {}).get("name") or "unknown"),
    ]
    accelerators = snapshot.get("accelerators") or []
    for gpu in accelerators:
        driver = (gpu.get("driver") or {}).get("version")
        lines.append((f"GPU {gpu.get('index')}", " · ".join(str(part) for part in (
            f"{gpu.get('vendor') or ''} {gpu.get('model') or ''}".strip() or "unknown",
            gib((gpu.get("memory") or {}).get("capacity_bytes")),
            f"driver {driver}" if driver else "") if part)))
    if not accelerators:
        lines.append(("GPUs", "none found (no nvidia-smi, or it lists none)"))
    return lines


def _database() -> dict[str, str]:
    from django.db import connection

    from scheduling.models import ConfigImport

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SHOW server_version")
        elif connection.vendor == "sqlite":
            cursor.execute("SELECT sqlite_version()")
        else:
            cursor.execute("SELECT 1")
        (server,) = cursor.fetchone()
    last = ConfigImport.objects.first()
    return {
        "vendor": connection.display_name, "server": str(server),
        "config": last.source_path if last else "",
        "imported_at": last.imported_at.isoformat(timespec="seconds") if last else "",
        "files": ", ".join(last.files) if last and len(last.files) > 1 else "",
    }


@staff_member_required
async def page(request: HttpRequest) -> HttpResponse:
    rt = await runtime.port()
    info = version_info()
    return await render_page(request, "dashboard/about.html", {
        "build": [("gpuproxy", info["version"]), ("commit", info["commit"]),
                  ("built", info["build_date"]),
                  ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
                  ("Django", django.get_version())],
        "machine": machine(await hardware.snapshot()),
        "scheduler": scheduler_summary(rt.catalog),
        "database": await runtime.run_db(_database),
    })
