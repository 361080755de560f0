"""Taking one sample: the psutil figures and a run of `nvidia-smi` (or `rocm-smi`), side by side.

Kept apart from the periodic task (`collect`) because this is the part that touches the outside
world and can fail or hang. GPUs are read with `nvidia-smi`, or with `rocm-smi` when there is no
`nvidia-smi` on PATH; with neither there are simply no GPU figures. Each run has a timeout and is
killed with its whole process group when it overruns, so a hung tool costs one late sample, not
the sampler. A tool that fails is reported once, with the command and what to try, and again
only after it has worked in between: a broken driver must not write a warning every five
seconds for days.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

# psutil ships no type information and types-psutil is not a dependency of the project.
import psutil  # type: ignore[import-untyped]

from gpuproxy.observe.perf.parse import (
    NVIDIA_SMI_ARGS,
    ROCM_SMI_ARGS,
    GpuSample,
    parse_nvidia_smi,
    parse_rocm_smi,
)

logger = logging.getLogger("gpuproxy.observe.perf.sample")

GPU_TIMEOUT = 5.0  # one nvidia-smi/rocm-smi run; a healthy one answers well within a second


@dataclass(frozen=True)
class SystemSample:
    """Everything one sample saw. Published whole and never changed, so readers need no lock."""

    taken_at: float  # time.time()
    cpu_percent: tuple[float, ...]  # per core
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    load_average: tuple[float, float, float]  # 1m, 5m, 15m
    network: dict[str, tuple[int, int]]  # interface -> (bytes received, bytes sent), loopback too
    gpus: tuple[GpuSample, ...]


class _SystemFigures(TypedDict):
    """The psutil half of a `SystemSample`."""

    cpu_percent: tuple[float, ...]
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    load_average: tuple[float, float, float]
    network: dict[str, tuple[int, int]]


class _ToolFailed(Exception):
    """A GPU tool that timed out, could not start or exited non-zero; the message says which."""


@dataclass(frozen=True)
class _GpuTool:
    name: str
    path: str
    args: tuple[str, ...]
    parse: Callable[[str], list[GpuSample]]
    remedy: str


def _find_gpu_tool() -> _GpuTool | None:
    """Looked up on every sample, so a driver installed while the proxy runs is picked up."""
    if path := shutil.which("nvidia-smi"):
        return _GpuTool("nvidia-smi", path, NVIDIA_SMI_ARGS, parse_nvidia_smi,
                        "run `nvidia-smi` by hand to see why (after a driver upgrade the box "
                        "usually needs a reboot)")
    if path := shutil.which("rocm-smi"):
        return _GpuTool("rocm-smi", path, ROCM_SMI_ARGS, parse_rocm_smi,
                        "run `rocm-smi --json` by hand to see why (the user running gpuproxy "
                        "needs the video and render groups)")
    return None


def _read_system() -> _SystemFigures:
    """The psutil half of a sample; blocking but quick, so it runs in a worker thread."""
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    one, five, fifteen = psutil.getloadavg()
    return {
        # Utilisation since the previous call: the previous sample, or the priming call in
        # Sampler.__init__, so about one interval.
        "cpu_percent": tuple(float(p) for p in psutil.cpu_percent(percpu=True, interval=None)),
        # `free` as llama-swap reports it (excludes reclaimable cache), for dashboard parity.
        "memory_total_bytes": int(memory.total),
        "memory_used_bytes": int(memory.used),
        "memory_free_bytes": int(memory.free),
        "swap_total_bytes": int(swap.total),
        "swap_used_bytes": int(swap.used),
        "load_average": (float(one), float(five), float(fifteen)),
        "network": {name: (int(c.bytes_recv), int(c.bytes_sent))
                    for name, c in psutil.net_io_counters(pernic=True).items()},
    }


class Sampler:
    """Takes samples on request and remembers which troubles it has already warned about.

    For the event loop's thread only; `PerfMonitor` takes one sample at a time.
    """

    def __init__(self, *, gpu_timeout: float = GPU_TIMEOUT) -> None:
        self._gpu_timeout = gpu_timeout
        self._troubles: set[str] = set()  # problems already warned about, until they clear
        self._no_gpu_tool_noted = False
        # cpu_percent(interval=None) measures since its previous call; the first call has
        # nothing to compare with and returns zeros, so make it here, not in the first sample.
        psutil.cpu_percent(percpu=True, interval=None)

    async def take(self) -> SystemSample | None:
        """One sample; None when psutil failed (said once in the log). A GPU tool that fails
        only leaves the GPUs out."""
        taken_at = time.time()
        system, gpus = await asyncio.gather(asyncio.to_thread(_read_system),
                                            self._read_gpus(), return_exceptions=True)
        if isinstance(gpus, BaseException):  # _read_gpus handles its own failures
            raise gpus
        if isinstance(system, BaseException):
            self._trouble("system", "reading CPU/memory/network figures with psutil "
                                    f"failed: {system!r}; no sample this time",
                          exc_info=system)
            return None
        self._cleared("system", "reading CPU/memory/network figures works again")
        return SystemSample(taken_at=taken_at, gpus=tuple(gpus), **system)

    async def _read_gpus(self) -> list[GpuSample]:
        tool = _find_gpu_tool()
        if tool is None:
            if not self._no_gpu_tool_noted:
                self._no_gpu_tool_noted = True
                logger.debug("neither nvidia-smi nor rocm-smi is on PATH; no GPU figures")
            return []
        self._no_gpu_tool_noted = False
        command = f"`{tool.path} {' '.join(tool.args)}`"
        try:
            gpus = tool.parse(await self._run_tool(tool))
        except (_ToolFailed, ValueError) as exc:
            what = str(exc) if isinstance(exc, _ToolFailed) else (
                f"printed something that could not be read ({exc})")
            self._trouble(tool.name, f"{command} {what}; GPU figures are left out of /metrics "
                                     f"until it works; {tool.remedy}")
            return []
        self._cleared(tool.name, f"{tool.name} works again; GPU figures are back")
        return gpus

    async def _run_tool(self, tool: _GpuTool) -> str:
        """The tool's stdout. It runs in its own session so that a timeout can kill whatever it
        started too (a wrapper script's children would otherwise keep the pipe open)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                tool.path, *tool.args, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)
        except OSError as exc:
            raise _ToolFailed(f"could not be started ({exc})") from None
        try:
            async with asyncio.timeout(self._gpu_timeout):
                stdout, stderr = await proc.communicate()
        except TimeoutError:
            raise _ToolFailed(f"gave no answer within {self._gpu_timeout:g} s and was "
                              "killed") from None
        finally:
            if proc.returncode is None:  # timed out, or the sampler is being stopped
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if proc.returncode != 0:
            said = (stderr or stdout).decode(errors="replace").strip().splitlines()
            detail = f": {said[-1][:300]}" if said else ""
            raise _ToolFailed(f"exited with status {proc.returncode}{detail}")
        return stdout.decode(errors="replace")

    def _trouble(self, key: str, message: str, exc_info: BaseException | None = None) -> None:
        if key in self._troubles:
            logger.debug(message)
            return
        self._troubles.add(key)
        logger.warning(message, exc_info=exc_info)

    def _cleared(self, key: str, message: str) -> None:
        if key in self._troubles:
            self._troubles.discard(key)
            logger.info(message)
