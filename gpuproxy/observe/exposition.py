"""One `/metrics` for a proxy of several processes (`serve --workers N`).

`prometheus_client`'s multiprocess mode cannot carry custom collectors (the scheduler, the
activity writer and the perf monitor are all custom), so each process renders its own
registry and the scheduler process merges the texts here, when a scrape asks. Every series
is summed over the processes (a request process counts its own requests; the scheduler
process counts queue, swap and model series, and reports zeros for the rest), so the output
has the very names and labels of a one-process proxy. Two exceptions: a process's own
`process_*` and `python_*` series keep one line per process, labelled `worker` ("scheduler",
or the request process's pid), and the oldest-wait gauge and the build info (1 in every
process, not N + 1) take the largest value, not the sum.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PER_PROCESS = ("process_", "python_")
LARGEST = frozenset({"gpuproxy_queue_oldest_wait_seconds", "gpuproxy_build_info"})
CUMULATIVE = frozenset({"counter", "histogram", "summary"})


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge(own: str, theirs: list[tuple[str, str]], accept: str,
          departed: Sequence[str] = ()) -> tuple[bytes, str]:
    """`own`: the scheduler process's exposition; `theirs`: (worker, exposition) of each
    request process; `departed`: the last expositions of request processes that are gone,
    whose counters and histograms are still added (a sum that dropped when a process died
    would read as a reset to Prometheus). Returns the merged exposition in the format
    `accept` asks for."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    sources = [("scheduler", own, False), *((w, t, False) for w, t in theirs),
               *(("", t, True) for t in departed)]
    for worker, text, gone in sources:
        for family in text_string_to_metric_families(text):
            if gone and (family.type not in CUMULATIVE or family.name.startswith(PER_PROCESS)):
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type)
                values[family.name] = {}
            into = values[family.name]
            per_process = family.name.startswith(PER_PROCESS)
            for sample in family.samples:
                labels: dict[str, Any] = dict(sample.labels)
                if per_process:
                    labels["worker"] = worker
                key = (sample.name, tuple(sorted(labels.items())))
                if key not in into:
                    into[key] = sample.value
                elif family.name in LARGEST:
                    into[key] = max(into[key], sample.value)
                else:
                    into[key] += sample.value
    for name, merged in families.items():
        merged.samples = [Sample(sample_name, dict(labels), value)
                          for (sample_name, labels), value in values[name].items()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))  # type: ignore[arg-type]
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
