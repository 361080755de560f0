"""The performance monitor and its Prometheus collector, against the real psutil and real
subprocesses. The GPU tools cannot run here, so fake `nvidia-smi` / `rocm-smi` scripts stand in
for them on a PATH that holds nothing else: a real tool can never leak into a test.

Expected values are written out by hand from the fixtures, never computed with the code under
test. Nothing sleeps waiting for time to pass: tests await `wait_for_sample()` or a sample.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuproxy.observe.perf import (
    NVIDIA_SMI_ARGS,
    ROCM_SMI_ARGS,
    GpuSample,
    PerfCollector,
    PerfMonitor,
    parse_nvidia_smi,
    parse_rocm_smi,
)
from tests.helpers import memory_total_bytes

MIB = 1024 * 1024
DEADLINE = 10.0  # generous: a hang fails the test instead of stalling the suite
CAT = shutil.which("cat") or "/bin/cat"
SLEEP = shutil.which("sleep") or "/bin/sleep"

# nvidia-smi --query-gpu=index,name,uuid,temperature.gpu,temperature.memory,utilization.gpu,
# utilization.memory,memory.used,memory.total,fan.speed,power.draw --format=csv,noheader,nounits
# A GeForce (no memory temperature sensor) and an H100 (passively cooled: no fan).
NVIDIA_CSV = textwrap.dedent("""\
    0, NVIDIA GeForce RTX 3090, GPU-5a3c9e1f-2b7d-4c8e-9f10-3a4b5c6d7e8f, 64, [N/A], 87, 43, 21850, 24576, 72, 312.45
    1, NVIDIA H100 80GB HBM3, GPU-0e1d2c3b-4a59-6877-8695-a4b3c2d1e0f9, 38, 45, 0, 0, 1, 81559, [Not Supported], 71.23
    """)  # noqa: E501

GEFORCE = GpuSample(
    id="0", name="NVIDIA GeForce RTX 3090", uuid="GPU-5a3c9e1f-2b7d-4c8e-9f10-3a4b5c6d7e8f",
    temperature_celsius=64.0, vram_temperature_celsius=None, util_percent=87.0,
    memory_util_percent=43.0, memory_used_bytes=21850 * MIB, memory_total_bytes=24576 * MIB,
    fan_speed_percent=72.0, power_draw_watts=312.45)
H100 = GpuSample(
    id="1", name="NVIDIA H100 80GB HBM3", uuid="GPU-0e1d2c3b-4a59-6877-8695-a4b3c2d1e0f9",
    temperature_celsius=38.0, vram_temperature_celsius=45.0, util_percent=0.0,
    memory_util_percent=0.0, memory_used_bytes=1 * MIB, memory_total_bytes=81559 * MIB,
    fan_speed_percent=None, power_draw_watts=71.23)

# rocm-smi --showtemp --showuse --showmemuse --showmeminfo vram --showpower --showfan
#          --showproductname --showuniqueid --json   (ROCm 6.x key names)
ROCM_JSON = """{"card0": {"Temperature (Sensor edge) (C)": "42.0", \
"Temperature (Sensor junction) (C)": "48.0", "Temperature (Sensor memory) (C)": "60.0", \
"Fan speed (level)": "56", "Fan speed (%)": "22", "Fan RPM": "1003", \
"Average Graphics Package Power (W)": "58.0", "GPU use (%)": "12", "GFX Activity": "2217412", \
"GPU Memory Allocated (VRAM%)": "48", "GPU Memory Read/Write Activity (%)": "3", \
"Memory Activity": "1003744", "Avg. Memory Bandwidth": "0", \
"VRAM Total Memory (B)": "25753026560", "VRAM Total Used Memory (B)": "12389187584", \
"Card Series": "Radeon RX 7900 XTX", "Card Model": "0x744c", \
"Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]", "Card SKU": "EXT94393", \
"Subsystem ID": "0x5315", "Device Rev": "0xc8", "Node ID": "1", "GUID": "45677", \
"GFX Version": "gfx1100", "Unique ID": "N/A"}, \
"card1": {"Temperature (Sensor edge) (C)": "35.0", "Temperature (Sensor junction) (C)": "37.0", \
"Temperature (Sensor memory) (C)": "41.0", "Current Socket Graphics Package Power (W)": "43.0", \
"GPU use (%)": "0", "GFX Activity": "0", "GPU Memory Allocated (VRAM%)": "0", \
"GPU Memory Read/Write Activity (%)": "0", "Memory Activity": "N/A", \
"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "11317248", \
"Card Series": "Instinct MI210", "Card Model": "0x740f", \
"Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]", "Card SKU": "D67301", \
"GFX Version": "gfx90a", "Unique ID": "0x9f2a31c40b5e6d7a"}, \
"system": {"Driver version": "6.7.0"}}
"""

RX7900 = GpuSample(
    id="0", name="Radeon RX 7900 XTX", uuid="", temperature_celsius=42.0,
    vram_temperature_celsius=60.0, util_percent=12.0, memory_util_percent=48.0,
    memory_used_bytes=12389187584.0, memory_total_bytes=25753026560.0, fan_speed_percent=22.0,
    power_draw_watts=58.0)
MI210 = GpuSample(
    id="1", name="Instinct MI210", uuid="0x9f2a31c40b5e6d7a", temperature_celsius=35.0,
    vram_temperature_celsius=41.0, util_percent=0.0, memory_util_percent=0.0,
    memory_used_bytes=11317248.0, memory_total_bytes=68702699520.0, fan_speed_percent=None,
    power_draw_watts=43.0)

# ROCm 5.x spelled several keys differently and printed a warning before the JSON.
ROCM5_TEXT = """WARNING: One or more commands failed
{"card0": {"Temperature (Sensor edge) (C)": "51.0", "Temperature (Sensor memory) (C)": "N/A", \
"Fan speed (%)": "30.98", "Average Graphics Package Power (W)": "105.0", "GPU use (%)": "99", \
"GPU memory use (%)": "87", "VRAM Total Memory (B)": "17163091968", \
"VRAM Total Used Memory (B)": "14931722240", "Card series": "Navi 21 [Radeon RX 6800/6800 XT / \
6900 XT]", "Card model": "0x73bf", "Unique ID": "0x7c1b2e3d4f5a6b7c"}}
"""


# --- parsing ----------------------------------------------------------------------------------


def test_parse_nvidia_smi_two_gpus_with_missing_fields():
    assert parse_nvidia_smi(NVIDIA_CSV) == [GEFORCE, H100]


def test_parse_nvidia_smi_skips_a_lost_gpu_and_keeps_commas_in_names():
    text = ("Unable to determine the device handle for GPU 0000:02:00.0: Unknown Error\n"
            "3, Tesla K80, rev B, [N/A], [N/A], [N/A], [N/A], [N/A], 0, 11441, [N/A], [N/A]\n")
    assert parse_nvidia_smi(text) == [GpuSample(
        id="3", name="Tesla K80, rev B", uuid="", temperature_celsius=None,
        vram_temperature_celsius=None, util_percent=None, memory_util_percent=None,
        memory_used_bytes=0.0, memory_total_bytes=11441 * MIB, fan_speed_percent=None,
        power_draw_watts=None)]


def test_parse_rocm_smi_two_cards_skips_the_system_entry():
    assert parse_rocm_smi(ROCM_JSON) == [RX7900, MI210]


def test_parse_rocm_smi_older_key_names_and_a_warning_before_the_json():
    assert parse_rocm_smi(ROCM5_TEXT) == [GpuSample(
        id="0", name="Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", uuid="0x7c1b2e3d4f5a6b7c",
        temperature_celsius=51.0, vram_temperature_celsius=None, util_percent=99.0,
        memory_util_percent=87.0, memory_used_bytes=14931722240.0,
        memory_total_bytes=17163091968.0, fan_speed_percent=30.98, power_draw_watts=105.0)]


def test_parse_rocm_smi_refuses_output_without_json():
    with pytest.raises(ValueError):
        parse_rocm_smi("ERROR: GPU[0] : Unable to read sysfs\n")


# --- helpers ----------------------------------------------------------------------------------


def scrape(monitor: PerfMonitor) -> tuple[str, dict[str, list[tuple[dict[str, str], float]]]]:
    """The exposition text and, per sample name, its (labels, value) pairs."""
    registry = CollectorRegistry()
    registry.register(PerfCollector(monitor))
    text = generate_latest(registry).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return text, samples


def only_path(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """PATH is `directory` alone: the fakes there, and certainly no real GPU tool."""
    monkeypatch.setenv("PATH", str(directory))


def fake_tool(directory: Path, name: str, body: str) -> Path:
    """An executable `name` in `directory` running `body` under /bin/sh; it records its
    arguments in `<name>.args`, one per line."""
    path = directory / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{directory}/{name}.args"\n{body}\n')
    path.chmod(0o755)
    return path


def printing_tool(directory: Path, name: str, output: str) -> Path:
    (directory / f"{name}.out").write_text(output)
    return fake_tool(directory, name, f'exec {CAT} "{directory}/{name}.out"')


def assert_system_series(samples: dict[str, list[tuple[dict[str, str], float]]]) -> None:
    cores = sorted(int(labels["core"]) for labels, _ in samples["gpuproxy_cpu_util_percent"])
    assert cores == list(range(os.cpu_count()))
    assert all(0 <= v <= 100 for _, v in samples["gpuproxy_cpu_util_percent"])
    assert samples["gpuproxy_memory_total_bytes"] == [({}, memory_total_bytes())]
    for name in ("gpuproxy_memory_used_bytes", "gpuproxy_memory_free_bytes",
                 "gpuproxy_swap_memory_total_bytes", "gpuproxy_swap_memory_used_bytes"):
        assert len(samples[name]) == 1 and samples[name][0][1] >= 0, name
    assert sorted(labels["interval"] for labels, _ in samples["gpuproxy_load_average"]) == [
        "15m", "1m", "5m"]
    network = {(labels["interface"], labels["direction"]): v
               for labels, v in samples["gpuproxy_network_bytes_total"]}
    assert ("lo", "recv") in network and ("lo", "sent") in network


def gpu_values(samples: dict[str, list[tuple[dict[str, str], float]]],
               name: str) -> dict[tuple[str, str, str], float]:
    return {(labels["id"], labels["name"], labels["uuid"]): v
            for labels, v in samples.get(name, [])}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


@pytest.fixture
def perf_log() -> Iterator[_Records]:
    """The monitor's log records. Not caplog: settings.LOGGING stops `gpuproxy.*` from
    propagating to the root logger, where caplog listens."""
    handler = _Records()
    logger = logging.getLogger("gpuproxy.observe.perf")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


async def until(condition: Callable[[], bool]) -> None:
    """A 10 ms poll with a deadline, only for what happens in another process (a file a fake
    tool writes, a PID's state): there is no event to wait on from here."""
    async with asyncio.timeout(DEADLINE):
        while not condition():  # noqa: ASYNC110 (no event to wait on from outside)
            await asyncio.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- the monitor with fake tools --------------------------------------------------------------


async def test_nvidia_smi_series_and_system_series(tmp_path, monkeypatch):
    printing_tool(tmp_path, "nvidia-smi", NVIDIA_CSV)
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor(every=5.0)
    sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    assert sample is not None and monitor.latest is sample
    assert sample.gpus == (GEFORCE, H100)
    assert (tmp_path / "nvidia-smi.args").read_text().splitlines() == list(NVIDIA_SMI_ARGS)
    assert NVIDIA_SMI_ARGS == (
        "--query-gpu=index,name,uuid,temperature.gpu,temperature.memory,utilization.gpu,"
        "utilization.memory,memory.used,memory.total,fan.speed,power.draw",
        "--format=csv,noheader,nounits")

    _, samples = scrape(monitor)
    assert_system_series(samples)
    geforce = ("0", "NVIDIA GeForce RTX 3090", "GPU-5a3c9e1f-2b7d-4c8e-9f10-3a4b5c6d7e8f")
    h100 = ("1", "NVIDIA H100 80GB HBM3", "GPU-0e1d2c3b-4a59-6877-8695-a4b3c2d1e0f9")
    assert gpu_values(samples, "gpuproxy_gpu_temperature_celsius") == {geforce: 64, h100: 38}
    # [N/A] and [Not Supported] leave that GPU out of the family; the other GPU stays.
    assert gpu_values(samples, "gpuproxy_gpu_vram_temperature_celsius") == {h100: 45}
    assert gpu_values(samples, "gpuproxy_gpu_fan_speed_percent") == {geforce: 72}
    assert gpu_values(samples, "gpuproxy_gpu_util_percent") == {geforce: 87, h100: 0}
    assert gpu_values(samples, "gpuproxy_gpu_memory_util_percent") == {geforce: 43, h100: 0}
    assert gpu_values(samples, "gpuproxy_gpu_memory_used_bytes") == {
        geforce: 22911385600, h100: 1048576}
    assert gpu_values(samples, "gpuproxy_gpu_memory_total_bytes") == {
        geforce: 25769803776, h100: 85520809984}
    assert gpu_values(samples, "gpuproxy_gpu_power_draw_watts") == {geforce: 312.45, h100: 71.23}


async def test_rocm_smi_is_used_when_there_is_no_nvidia_smi(tmp_path, monkeypatch):
    printing_tool(tmp_path, "rocm-smi", ROCM_JSON)
    only_path(monkeypatch, tmp_path)
    assert shutil.which("nvidia-smi") is None
    monitor = PerfMonitor()
    sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    assert sample is not None and sample.gpus == (RX7900, MI210)
    assert (tmp_path / "rocm-smi.args").read_text().splitlines() == list(ROCM_SMI_ARGS)

    _, samples = scrape(monitor)
    assert_system_series(samples)
    rx = ("0", "Radeon RX 7900 XTX", "")
    mi = ("1", "Instinct MI210", "0x9f2a31c40b5e6d7a")
    assert gpu_values(samples, "gpuproxy_gpu_temperature_celsius") == {rx: 42, mi: 35}
    assert gpu_values(samples, "gpuproxy_gpu_vram_temperature_celsius") == {rx: 60, mi: 41}
    assert gpu_values(samples, "gpuproxy_gpu_fan_speed_percent") == {rx: 22}
    assert gpu_values(samples, "gpuproxy_gpu_memory_total_bytes") == {
        rx: 25753026560, mi: 68702699520}
    assert gpu_values(samples, "gpuproxy_gpu_power_draw_watts") == {rx: 58, mi: 43}


async def test_no_gpu_tool_means_no_gpu_series(tmp_path, monkeypatch):
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor()
    sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    assert sample is not None and sample.gpus == ()
    text, samples = scrape(monitor)
    assert_system_series(samples)
    assert "gpuproxy_gpu_" not in text


async def test_a_hanging_gpu_tool_is_killed_and_the_sample_still_published(tmp_path,
                                                                         monkeypatch, perf_log):
    # The sleep is a child of the script, as in a wrapper: killing only the script would leave
    # it holding the output pipe open.
    fake_tool(tmp_path, "nvidia-smi", f'{SLEEP} 60 &\necho $! > "{tmp_path}/child.pid"\nwait')
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor(gpu_timeout=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    assert loop.time() - started < 0.5 + 2.0  # the timeout, plus room for the kill and psutil
    assert sample is not None and sample.gpus == ()
    assert monitor.latest is sample
    text, samples = scrape(monitor)
    assert "gpuproxy_gpu_" not in text
    assert_system_series(samples)
    child = int((tmp_path / "child.pid").read_text())
    await until(lambda: gone(child))  # SIGKILL is immediate; reaping may lag a moment
    await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    warnings = perf_log.warnings()
    assert len(warnings) == 1, warnings  # once, not once per sample
    assert "nvidia-smi --query-gpu=" in warnings[0] and "0.5 s" in warnings[0]


async def test_a_failing_gpu_tool_warns_once_with_its_message(tmp_path, monkeypatch,
                                                              perf_log):
    fake_tool(tmp_path, "nvidia-smi",
              'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA '
              'driver." >&2\nexit 9')
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor()
    for _ in range(3):
        sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
        assert sample is not None and sample.gpus == ()
    warnings = perf_log.warnings()
    assert len(warnings) == 1, warnings
    assert "exited with status 9" in warnings[0]
    assert "couldn't communicate with the NVIDIA driver" in warnings[0]
    assert "run `nvidia-smi` by hand" in warnings[0]


# --- enabled / disabled -----------------------------------------------------------------------


async def test_disabled_exports_nothing_until_enabled(tmp_path, monkeypatch):
    printing_tool(tmp_path, "nvidia-smi", NVIDIA_CSV)
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor(enabled=False)
    assert await monitor.sample_now() is None
    assert monitor.latest is None
    text, samples = scrape(monitor)
    assert "gpuproxy_" not in text and samples == {}
    assert not (tmp_path / "nvidia-smi.args").exists()  # disabled runs no tools either

    monitor.configure(True, 5.0)
    sample = await asyncio.wait_for(monitor.sample_now(), DEADLINE)
    assert sample is not None and monitor.latest is sample
    _, samples = scrape(monitor)
    assert_system_series(samples)
    assert len(samples["gpuproxy_gpu_temperature_celsius"]) == 2

    monitor.configure(False, 5.0)
    assert monitor.latest is None
    text, _ = scrape(monitor)
    assert "gpuproxy_" not in text


async def test_disabling_during_a_sample_discards_it(tmp_path, monkeypatch):
    """A sample that was under way when monitoring was turned off must not reappear."""
    gate = tmp_path / "gate"
    (tmp_path / "nvidia-smi.out").write_text(NVIDIA_CSV)
    fake_tool(tmp_path, "nvidia-smi", f'while [ ! -e "{gate}" ]; do {SLEEP} 0.01; done\n'
                                      f'exec {CAT} "{tmp_path}/nvidia-smi.out"')
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor(gpu_timeout=DEADLINE)
    gate.touch()
    assert await asyncio.wait_for(monitor.sample_now(), DEADLINE) is not None
    gate.unlink()
    (tmp_path / "nvidia-smi.args").unlink()
    pending = asyncio.create_task(monitor.sample_now())
    await until((tmp_path / "nvidia-smi.args").exists)  # the sample is under way
    monitor.configure(False, 5.0)
    assert monitor.latest is None
    gate.touch()
    assert await asyncio.wait_for(pending, DEADLINE) is None
    assert monitor.latest is None


async def test_the_background_task_samples_on_its_own_and_stops(tmp_path, monkeypatch):
    only_path(monkeypatch, tmp_path)
    monitor = PerfMonitor(every=0.05)
    monitor.start()
    monitor.start()  # idempotent: still one task
    try:
        first = await asyncio.wait_for(monitor.wait_for_sample(), DEADLINE)
        second = await asyncio.wait_for(monitor.wait_for_sample(), DEADLINE)
        assert second is not first and second.taken_at >= first.taken_at
        assert monitor.latest is second

        monitor.configure(False, 0.05)
        assert monitor.latest is None
        monitor.configure(True, 0.05)  # the first sample after enabling comes promptly
        again = await asyncio.wait_for(monitor.wait_for_sample(), DEADLINE)
        assert monitor.latest is again and again.taken_at >= second.taken_at
    finally:
        await asyncio.wait_for(monitor.stop(), DEADLINE)
    await monitor.stop()  # a second stop is harmless


def test_importing_the_module_registers_no_collector():
    """The wiring registers PerfCollector; an import that did would duplicate its series."""
    code = ("import gpuproxy.observe.perf\n"
            "from prometheus_client import REGISTRY, generate_latest\n"
            "assert b'gpuproxy_' not in generate_latest(REGISTRY)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
