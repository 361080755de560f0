"""`routing.scheduler.settings.serial.affinityBudget`: what its value means, written once.

Off (absent, empty, `off`, 0), `auto` (k x the waiting request's model's measured swap cost,
k = `AUTO_SWAPS`), or a number of seconds. The config file, the settings page, the catalog,
`gpuproxy whatif` and the guarantees panel all read it through `parse_budget`; the rule itself is
the core's (scheduling/core/budget.py). Pure Python: the panel's JavaScript mirrors it
(scheduling/static/scheduling/guarantees.js, checked against this file by
tests/test_guarantees.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

AUTO = "auto"
OFF = "off"
#: `auto`: the budget in swap-times. 6 keeps round robin's swaps within one of serial's while
#: the starvation trap's lone request waits 44.5 s instead of 729.5 s (bench/simulate.py's
#: sweep at swap 5 s; issue 23's own table says 41 s and 729 s).
AUTO_SWAPS = 6.0
REMEDY = "give auto, a number of seconds above 0, or off (empty)"
MAX_SECONDS = 365 * 86400  # a longer budget is off in all but name
_SPACE = " \t\n\r\f\v"  # ASCII whitespace: guarantees.js trims the same, not Unicode's
_SECONDS = re.compile(r"(\d+\.?\d*|\.\d+)[ \t\n\r\f\v]*s?", re.ASCII)


@dataclass(frozen=True)
class Budget:
    seconds: float = 0.0  # a fixed budget; 0 = none
    swaps: float = 0.0  # `auto`: this many swap-times of the model; 0 = not auto

    @property
    def on(self) -> bool:
        return self.seconds > 0 or self.swaps > 0

    def text(self) -> str:
        """As stored on the settings page: "", "auto" or the seconds ("120", "7.5")."""
        if self.swaps:
            return AUTO
        if self.seconds:  # never an exponent: parse_budget reads plain digits only
            return format(Decimal(repr(self.seconds)), "f").rstrip("0").rstrip(".")
        return ""

    def value(self) -> str | float | None:
        """As a config file writes it: "auto", a number, or None (not written)."""
        if self.swaps:
            return AUTO
        if self.seconds:
            return int(self.seconds) if self.seconds == int(self.seconds) else self.seconds
        return None


def parse_budget(value: object) -> Budget:
    """A budget from the file's value or the page's text; `ValueError` says what is wrong.
    Seconds are kept to the millisecond, so that the stored text reads back the same."""
    budget = _parse(value)
    seconds = round(budget.seconds, 3)
    if seconds > MAX_SECONDS:
        raise ValueError(f"{value!r} is more than a year: {REMEDY}")
    return Budget(seconds=seconds, swaps=budget.swaps)


def _parse(value: object) -> Budget:
    if value is None or value is False or value == 0:
        return Budget()
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a budget: {REMEDY}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{value} is not a budget: {REMEDY}")
        return Budget(seconds=float(value))
    if isinstance(value, str):
        text = value.strip(_SPACE).lower()
        if text in ("", OFF):
            return Budget()
        if text == AUTO:
            return Budget(swaps=AUTO_SWAPS)
        if _SECONDS.fullmatch(text):
            seconds = float(text.rstrip("s").rstrip(_SPACE))
            return Budget(seconds=seconds) if seconds > 0 else Budget()
    raise ValueError(f"{value!r} is not a budget: {REMEDY}")
