"""The performance monitor behind `/metrics`: CPU, memory, load, network and GPU figures.

Three modules, one job each:

* `parse`: what `nvidia-smi` and `rocm-smi` print, read into `GpuSample`s (pure).
* `sample`: taking one sample (psutil in a worker thread, one GPU tool run with a timeout).
* `collect`: the periodic task that publishes the newest sample (`PerfMonitor`) and the
  Prometheus collector that exports it (`PerfCollector`).

No Django imports: the wiring reads the settings and calls `PerfMonitor.configure()`. Importing
the package registers no collector; the wiring registers `PerfCollector` once.
"""

from gpuproxy.observe.perf.collect import PerfCollector, PerfMonitor
from gpuproxy.observe.perf.parse import (
    NVIDIA_SMI_ARGS,
    NVIDIA_SMI_FIELDS,
    ROCM_SMI_ARGS,
    GpuSample,
    parse_nvidia_smi,
    parse_rocm_smi,
)
from gpuproxy.observe.perf.sample import GPU_TIMEOUT, SystemSample

__all__ = [
    "GPU_TIMEOUT",
    "NVIDIA_SMI_ARGS",
    "NVIDIA_SMI_FIELDS",
    "ROCM_SMI_ARGS",
    "GpuSample",
    "PerfCollector",
    "PerfMonitor",
    "SystemSample",
    "parse_nvidia_smi",
    "parse_rocm_smi",
]
