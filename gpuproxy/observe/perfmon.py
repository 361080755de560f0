"""The performance monitor behind `/metrics`: CPU, memory, load, network and GPU figures.

One task samples every `every` seconds and swaps the newest `SystemSample` in whole;
`PerfCollector` only reads `PerfMonitor.latest`. A scrape therefore never waits for `nvidia-smi`
(which takes hundreds of milliseconds on a busy box and hangs outright when the driver is
wedged), never runs psutil on the scrape thread, and needs no lock: the sample is immutable and
a single attribute read is atomic.

GPUs are read with `nvidia-smi`, or with `rocm-smi` when there is no `nvidia-smi` on PATH; with
neither there are simply no GPU series. Each run has a timeout and is killed with its whole
process group when it overruns, so a hung tool costs one late sample, not the sampler. A tool
that fails is reported once, with the command and what to try, and again only after it has
worked in between: a broken driver must not write a warning every five seconds for days.

The series follow llama-swap's `internal/perf/prometheus.go` under the `gpuproxy_` prefix,
except that swap space is `gpuproxy_swap_memory_*`, so it cannot be mistaken for model swaps
(`gpuproxy_swaps_total`). When monitoring is off the collector yields nothing at all, not even
empty families, so dashboards show "no data" rather than stale or zero figures.

No Django imports: the wiring reads the settings and calls `configure()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("gpuproxy.observe.perfmon")

GPU_TIMEOUT = 5.0  # one nvidia-smi/rocm-smi run; a healthy one answers well within a second
MIN_EVERY = 0.01  # the settings refuse < 1 s; this only stops a bypassed value from busy-looping
MAX_EVERY = 86400.0  # a timer a day away is as good as none; an infinite one breaks the loop
MIB = 1024 * 1024

NVIDIA_SMI_FIELDS = ("index", "name", "uuid", "temperature.gpu", "temperature.memory",
                     "utilization.gpu", "utilization.memory", "memory.used", "memory.total",
                     "fan.speed", "power.draw")
NVIDIA_SMI_ARGS = ("--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS),
                   "--format=csv,noheader,nounits")
ROCM_SMI_ARGS = ("--showtemp", "--showuse", "--showmemuse", "--showmeminfo", "vram",
                 "--showpower", "--showfan", "--showproductname", "--showuniqueid", "--json")


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment; None where the tool does not report a figure ("[N/A]")."""

    id: str
    name: str
    uuid: str  # "" when unknown
    temperature_celsius: float | None
    vram_temperature_celsius: float | None
    util_percent: float | None
    memory_util_percent: float | None
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    fan_speed_percent: float | None
    power_draw_watts: float | None


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


# --- parsing the GPU tools (pure) -------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A figure, or None for the tools' ways of saying "no figure": `[N/A]`, `[Not Supported]`,
    `N/A`, `Unknown Error`, an empty field."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    else:
        text = str(value).strip().strip("[]").strip()
        try:
            number = float(text)
        except ValueError:
            return None
    return number if math.isfinite(number) else None


def _text(value: Any) -> str:
    """A name or id, with the tools' placeholders for "unknown" turned into ""."""
    text = str(value).strip() if value is not None else ""
    return "" if text.strip("[]").lower() in ("", "n/a", "not supported", "unknown") else text


def _mib(value: Any) -> float | None:
    number = _number(value)
    return None if number is None else number * MIB


def parse_nvidia_smi(text: str) -> list[GpuSample]:
    """GPUs from `nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits`.

    Lines that do not have the fields (nvidia-smi prints errors such as "Unable to determine
    the device handle for GPU 0000:01:00.0: Unknown Error" in place of a GPU) are skipped, so
    one lost GPU does not hide the others. A comma inside the name is kept in the name.
    """
    gpus: list[GpuSample] = []
    width = len(NVIDIA_SMI_FIELDS)
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < width:
            continue
        extra = len(parts) - width  # commas inside the name
        name = ", ".join(parts[1:2 + extra])
        parts = [parts[0], name, *parts[2 + extra:]]
        index = _text(parts[0])
        if not index:
            continue
        gpus.append(GpuSample(
            id=index,
            name=_text(name) or f"GPU {index}",
            uuid=_text(parts[2]),
            temperature_celsius=_number(parts[3]),
            vram_temperature_celsius=_number(parts[4]),
            util_percent=_number(parts[5]),
            memory_util_percent=_number(parts[6]),
            memory_used_bytes=_mib(parts[7]),
            memory_total_bytes=_mib(parts[8]),
            fan_speed_percent=_number(parts[9]),
            power_draw_watts=_number(parts[10]),
        ))
    return gpus


_CARD = re.compile(r"card(\d+)")


def _normalise(key: str) -> str:
    return " ".join(key.lower().split())


def _first(card: Mapping[str, Any], keys: tuple[str, ...],
           convert: Callable[[Any], Any] = _number) -> Any:
    """The first of `keys` (normalised) that holds a usable value; rocm-smi renames its keys
    between versions, so each figure has a list of the spellings seen in the wild."""
    for key in keys:
        if key in card:
            value = convert(card[key])
            if value not in (None, ""):
                return value
    return None


def _matching(card: Mapping[str, Any], test: Callable[[str], bool]) -> float | None:
    """The first usable number under a key that passes `test`: the fallback for spellings
    not in the lists yet."""
    for key in sorted(card):
        if test(key):
            number = _number(card[key])
            if number is not None:
                return number
    return None


def parse_rocm_smi(text: str) -> list[GpuSample]:
    """GPUs from `rocm-smi <ROCM_SMI_ARGS>` (`--json`): one `cardN` object per GPU.

    Text before the JSON (some versions print warnings to stdout) and keys that are not cards
    (`system`) are skipped. Raises ValueError when there is no JSON object at all.
    """
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in the output")
    data, _ = json.JSONDecoder().raw_decode(text, start)
    if not isinstance(data, dict):
        raise ValueError("the JSON is not an object of cards")
    cards = sorted(((int(m.group(1)), value) for key, value in data.items()
                    if (m := _CARD.fullmatch(key.strip().lower())) and isinstance(value, dict)),
                   key=lambda item: item[0])
    gpus: list[GpuSample] = []
    for index, raw in cards:
        card = {_normalise(str(k)): v for k, v in raw.items()}
        temperature = _first(card, ("temperature (sensor edge) (c)",
                                    "temperature (sensor junction) (c)"))
        if temperature is None:
            temperature = _matching(card, lambda k: k.startswith("temperature")
                                    and "mem" not in k and "hbm" not in k)
        vram_temperature = _first(card, ("temperature (sensor memory) (c)",
                                         "temperature (sensor mem) (c)"))
        if vram_temperature is None:
            vram_temperature = _matching(card, lambda k: k.startswith("temperature")
                                         and ("mem" in k or "hbm" in k))
        used = _first(card, ("vram total used memory (b)",))
        total = _first(card, ("vram total memory (b)",))
        memory_util = _first(card, ("gpu memory allocated (vram%)", "gpu memory use (%)"))
        if memory_util is None and used is not None and total:
            memory_util = used / total * 100
        power = _first(card, ("average graphics package power (w)",
                              "current socket graphics package power (w)"))
        if power is None:
            power = _matching(card, lambda k: "package power" in k and "max" not in k)
        gpus.append(GpuSample(
            id=str(index),
            name=_first(card, ("card series", "device name", "card model"), _text)
            or f"card{index}",
            uuid=_first(card, ("unique id",), _text) or "",
            temperature_celsius=temperature,
            vram_temperature_celsius=vram_temperature,
            util_percent=_first(card, ("gpu use (%)",)),
            memory_util_percent=memory_util,
            memory_used_bytes=used,
            memory_total_bytes=total,
            fan_speed_percent=_first(card, ("fan speed (%)",)),
            power_draw_watts=power,
        ))
    return gpus


# --- sampling ---------------------------------------------------------------------------------


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


def _read_system() -> dict[str, Any]:
    """The psutil half of a sample; blocking but quick, so it runs in a worker thread."""
    memory = psutil.virtual_memory()
    swap = psutil.swap_memory()
    one, five, fifteen = psutil.getloadavg()
    return {
        # Utilisation since the previous call: the previous sample, or the priming call in
        # PerfMonitor.__init__, so about one interval.
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


def _sane_every(every: float) -> float:
    if not every >= MIN_EVERY:  # also catches NaN
        return MIN_EVERY
    return min(every, MAX_EVERY)


class PerfMonitor:
    """Samples in the background and publishes the newest `SystemSample` as `latest`.

    Everything but `latest` is for the event loop's thread. `latest` may be read from any
    thread (the Prometheus scrape runs in one).
    """

    def __init__(self, every: float = 5.0, enabled: bool = True, *,
                 gpu_timeout: float = GPU_TIMEOUT) -> None:
        self._every = _sane_every(every)
        self._enabled = enabled
        self._gpu_timeout = gpu_timeout
        self._latest: SystemSample | None = None
        # Bumped on every disable, so a sample that was in flight then is thrown away instead
        # of reappearing after `configure(False)` cleared `latest`.
        self._generation = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # configure() wakes the sleeping loop with it
        self._lock = asyncio.Lock()  # one sample at a time: the background's and sample_now()'s
        self._waiters: list[asyncio.Future[SystemSample]] = []
        self._troubles: set[str] = set()  # problems already warned about, until they clear
        self._no_gpu_tool_noted = False
        # cpu_percent(interval=None) measures since its previous call; the first call has
        # nothing to compare with and returns zeros, so make it here, not in the first sample.
        psutil.cpu_percent(percpu=True, interval=None)

    @property
    def latest(self) -> SystemSample | None:
        return self._latest

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def every(self) -> float:
        return self._every

    def configure(self, enabled: bool, every: float) -> None:
        """Apply changed settings at once: the loop wakes and re-plans its next sample."""
        every = _sane_every(every)
        if enabled == self._enabled and every == self._every:
            return  # the catalog reloads for many reasons; most change nothing here
        if not enabled:
            self._generation += 1
            self._latest = None
        self._enabled = enabled
        self._every = every
        self._changed.set()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="perfmon")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def wait_for_sample(self) -> SystemSample:
        """The next sample published after this call: tests wait on this instead of sleeping."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await waiter

    async def sample_now(self) -> SystemSample | None:
        """Take one sample and publish it; None when monitoring is (or became) disabled."""
        async with self._lock:
            if not self._enabled:
                return None
            generation = self._generation
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
            if not self._enabled or generation != self._generation:
                return None
            sample = SystemSample(taken_at=taken_at, gpus=tuple(gpus), **system)
            self._latest = sample
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(sample)
            return sample

    async def _run(self) -> None:
        """Sample every `every` seconds, measured start to start; re-plan on configure()."""
        loop = asyncio.get_running_loop()
        last: float | None = None  # loop time the last sample started
        while True:
            # Cleared before the settings are read, so a configure() from here on is seen
            # either by this pass or by the wait below; none is lost.
            self._changed.clear()
            if not self._enabled:
                last = None  # enabling again samples at once
                await self._changed.wait()
                continue
            now = loop.time()
            if last is not None and now < last + self._every:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(last + self._every - now):
                        await self._changed.wait()
                continue
            last = now
            try:
                await self.sample_now()
            except Exception:  # a bug must cost one sample, not every sample after it
                logger.exception("performance sample failed; trying again in %g s",
                                 self._every)

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


# --- Prometheus -------------------------------------------------------------------------------

_GPU_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("gpuproxy_gpu_temperature_celsius", "GPU temperature in Celsius", "temperature_celsius"),
    ("gpuproxy_gpu_vram_temperature_celsius", "GPU VRAM temperature in Celsius",
     "vram_temperature_celsius"),
    ("gpuproxy_gpu_util_percent", "GPU utilization percent (0-100)", "util_percent"),
    ("gpuproxy_gpu_memory_util_percent", "GPU memory utilization percent (0-100)",
     "memory_util_percent"),
    ("gpuproxy_gpu_memory_used_bytes", "GPU memory used in bytes", "memory_used_bytes"),
    ("gpuproxy_gpu_memory_total_bytes", "GPU memory total in bytes", "memory_total_bytes"),
    ("gpuproxy_gpu_fan_speed_percent", "GPU fan speed percent (0-100)", "fan_speed_percent"),
    ("gpuproxy_gpu_power_draw_watts", "GPU power draw in watts", "power_draw_watts"),
)


class PerfCollector(Collector):
    """Exports `monitor.latest`; never samples itself, so a scrape costs no tool runs.

    `describe()` stays the base class's empty list: the names depend on whether monitoring is
    on, and an empty description keeps registration from running a collect.
    """

    def __init__(self, monitor: PerfMonitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[Metric]:
        sample = self._monitor.latest  # one read: the whole scrape sees one sample
        if sample is None:
            return
        yield from _system_families(sample)
        yield from _gpu_families(sample.gpus)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _system_families(s: SystemSample) -> Iterator[Metric]:
    cpu = GaugeMetricFamily("gpuproxy_cpu_util_percent", "CPU utilization per core (0-100)",
                            labels=["core"])
    for core, percent in enumerate(s.cpu_percent):
        cpu.add_metric([str(core)], percent)
    yield cpu
    yield _gauge("gpuproxy_memory_total_bytes", "Total memory in bytes", s.memory_total_bytes)
    yield _gauge("gpuproxy_memory_used_bytes", "Used memory in bytes", s.memory_used_bytes)
    yield _gauge("gpuproxy_memory_free_bytes", "Free memory in bytes (not counting "
                                               "reclaimable cache)", s.memory_free_bytes)
    yield _gauge("gpuproxy_swap_memory_total_bytes", "Total swap space in bytes",
                 s.swap_total_bytes)
    yield _gauge("gpuproxy_swap_memory_used_bytes", "Used swap space in bytes",
                 s.swap_used_bytes)
    load = GaugeMetricFamily("gpuproxy_load_average", "Load average", labels=["interval"])
    for interval, value in zip(("1m", "5m", "15m"), s.load_average, strict=True):
        load.add_metric([interval], value)
    yield load
    if s.network:
        network = CounterMetricFamily("gpuproxy_network_bytes", "Total network bytes "
                                      "transferred", labels=["interface", "direction"])
        for interface, (received, sent) in sorted(s.network.items()):
            network.add_metric([interface, "recv"], received)
            network.add_metric([interface, "sent"], sent)
        yield network


def _gpu_families(gpus: tuple[GpuSample, ...]) -> Iterator[Metric]:
    for name, documentation, attribute in _GPU_FAMILIES:
        family = GaugeMetricFamily(name, documentation, labels=["id", "name", "uuid"])
        for gpu in gpus:
            value = getattr(gpu, attribute)
            if value is not None:
                family.add_metric([gpu.id, gpu.name, gpu.uuid], value)
        if family.samples:  # a figure no GPU reports is left out, not shown empty
            yield family
