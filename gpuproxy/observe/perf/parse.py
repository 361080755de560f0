"""What the GPU tools print, read into `GpuSample`s: pure functions, no processes, no clock.

Kept apart from the sampling so that every format quirk (nvidia-smi's `[N/A]` and error lines
in place of a GPU, rocm-smi's keys renamed between versions and warnings before its JSON) is
tested on fixed text, without a GPU and without running anything. The argument lists live here
too because they fix the format the parsers read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

MIB = 1024 * 1024

NVIDIA_SMI_FIELDS = ("index", "name", "uuid", "temperature.gpu", "temperature.memory",
                     "utilization.gpu", "utilization.memory", "memory.used", "memory.total",
                     "fan.speed", "power.draw")
NVIDIA_SMI_ARGS = ("--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS),
                   "--format=csv,noheader,nounits")
ROCM_SMI_ARGS = ("--showtemp", "--showuse", "--showmemuse", "--showmeminfo", "vram",
                 "--showpower", "--showfan", "--showproductname", "--showuniqueid", "--json")

_T = TypeVar("_T")


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


@overload
def _first(card: Mapping[str, Any], keys: tuple[str, ...]) -> float | None: ...


@overload
def _first(card: Mapping[str, Any], keys: tuple[str, ...],
           convert: Callable[[Any], _T | None]) -> _T | None: ...


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
