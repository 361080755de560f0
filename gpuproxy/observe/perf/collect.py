"""The periodic monitor task and the Prometheus collector that exports its newest sample.

One task samples every `every` seconds and swaps the newest `SystemSample` in whole;
`PerfCollector` only reads `PerfMonitor.latest`. A scrape therefore never waits for `nvidia-smi`
(which takes hundreds of milliseconds on a busy box and hangs outright when the driver is
wedged), never runs psutil on the scrape thread, and needs no lock: the sample is immutable and
a single attribute read is atomic. Taking a sample is `sample.Sampler`'s job; this module only
decides when, publishes the result and turns it into series.

The series follow llama-swap's `internal/perf/prometheus.go` under the `gpuproxy_` prefix,
except that swap space is `gpuproxy_swap_memory_*`, so it cannot be mistaken for model swaps
(`gpuproxy_swaps_total`). When monitoring is off the collector yields nothing at all, not even
empty families, so dashboards show "no data" rather than stale or zero figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuproxy.observe.perf.parse import GpuSample
from gpuproxy.observe.perf.sample import GPU_TIMEOUT, Sampler, SystemSample

logger = logging.getLogger("gpuproxy.observe.perf.collect")

MIN_EVERY = 0.01  # the settings refuse < 1 s; this only stops a bypassed value from busy-looping
MAX_EVERY = 86400.0  # a timer a day away is as good as none; an infinite one breaks the loop
HISTORY_SECONDS = 3600.0  # `/api/performance` keeps the last hour, as llama-swap's ring does
HISTORY_MAX = 36000  # samples, whatever `every` is: a bound on memory


def _history_size(every: float) -> int:
    return max(1, min(int(HISTORY_SECONDS / every), HISTORY_MAX))


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
        self._latest: SystemSample | None = None
        # Bumped on every disable, so a sample that was in flight then is thrown away instead
        # of reappearing after `configure(False)` cleared `latest`.
        self._generation = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # configure() wakes the sleeping loop with it
        self._lock = asyncio.Lock()  # one sample at a time: the background's and sample_now()'s
        self._waiters: list[asyncio.Future[SystemSample]] = []
        self._sampler = Sampler(gpu_timeout=gpu_timeout)
        self._history: deque[SystemSample] = deque(maxlen=_history_size(self._every))

    @property
    def latest(self) -> SystemSample | None:
        return self._latest

    def history(self) -> list[SystemSample]:
        """The samples of the last hour, oldest first (llama-swap's `/api/performance`)."""
        return list(self._history)

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
            self._history.clear()
        if every != self._every:  # the ring holds an hour at the new pace
            self._history = deque(self._history, maxlen=_history_size(every))
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
        waiter: asyncio.Future[SystemSample] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await waiter

    async def sample_now(self) -> SystemSample | None:
        """Take one sample and publish it; None when monitoring is (or became) disabled."""
        async with self._lock:
            if not self._enabled:
                return None
            generation = self._generation
            sample = await self._sampler.take()
            if sample is None:
                return None
            if not self._enabled or generation != self._generation:
                return None
            self._latest = sample
            self._history.append(sample)
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
