"""What the serial scheduler promises for a given `agingDivisor` and `swapAffinityBonus`.

The formulas of docs/scheduling.md ("Guarantees, with numbers for the defaults"), written once
so the settings page can show them for the values being edited. Pure Python, no Django: the
admin renders them server-side, and `scheduling/static/scheduling/guarantees.js` mirrors this
file line for line to re-render them as the admin types (tests/test_guarantees.py checks that
both give the same text).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from scheduling.affinity_budget import AUTO_SWAPS, parse_budget

#: the priority gap between neighbouring bands (`interactive` 100, `normal` 0, `batch` -100)
BAND_GAP = 100
#: the largest bonus that never lifts a request into the next band
MAX_BONUS = BAND_GAP - 1
TIMES = "\N{MULTIPLICATION SIGN}"


@dataclass(frozen=True)
class Guarantee:
    title: str
    text: str
    ok: bool = True


def format_duration(seconds: float) -> str:
    """A duration as docs/scheduling.md writes it: "5 s", "105 s", "10 min", "110 min",
    "3 h 30 min", "2 d 4 h".

    Each unit is used until two of the next one would fit, so 100 min stays "100 min" (easier
    to compare with "110 min" than "1 h 40 min"), and 210 min becomes "3 h 30 min". Rounding is
    half up with `floor(x + 0.5)`, which JavaScript computes bit for bit the same way.
    """
    if seconds < 10:
        hundredths = f"{_half_up(seconds * 100) / 100:.2f}"
        return hundredths.rstrip("0").rstrip(".") + " s"
    if seconds < 120:
        return f"{_half_up(seconds)} s"
    if seconds < 2 * 3600:
        minutes, secs = divmod(_half_up(seconds), 60)
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    if seconds < 2 * 86400:
        hours, minutes = divmod(_half_up(seconds / 60), 60)
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(_half_up(seconds / 3600), 24)
    return f"{days} d" + (f" {hours} h" if hours else "")


def _half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _number(value: float) -> str:
    """A setting as JavaScript's String() writes it: 60 rather than 60.0, 0.5, 0.000001, 1e-7.

    Both languages print the shortest digits that read back as the same float; they differ in
    when they switch to an exponent and how they write it, which is evened out here.
    """
    if value == int(value) and abs(value) < 1e21:
        return str(int(value))
    text = repr(float(value))
    mantissa, exp_mark, exponent = text.partition("e")
    if not exp_mark:
        return text
    if -6 <= int(exponent) < 21:  # JavaScript spells out 1e-6 and 1e-5
        return format(Decimal(text), "f")
    return f"{mantissa}e{int(exponent):+d}"


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def parse_number(text: str | None) -> float | None:
    """A typed setting as a number, or None when it is not one (the panel then says so).

    Stricter than float() ("inf", "nan", "1_000" are not numbers here), and written as a
    pattern so that guarantees.js accepts exactly the same strings.
    """
    text = (text or "").strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def problems(aging_divisor: float | None, swap_affinity_bonus: float | None,
             affinity_budget: str = "") -> list[Guarantee]:
    """Why these values would be refused on save, one entry per field; empty when valid.

    The panel shows these instead of durations computed from values that cannot be saved.
    `None` stands for a value that is not a number at all.
    """
    found: list[Guarantee] = []
    try:
        parse_budget(affinity_budget)
    except ValueError:
        found.append(Guarantee("Affinity budget",
                               "affinityBudget must be auto, a number of seconds or empty "
                               "(off) — refused on save", False))
    bonus = swap_affinity_bonus
    if bonus is None or not math.isfinite(bonus):
        found.append(Guarantee("Swap affinity bonus",
                               "swapAffinityBonus is not a number — refused on save", False))
    elif bonus != int(bonus):
        found.append(Guarantee("Swap affinity bonus",
                               "swapAffinityBonus must be a whole number — refused on save",
                               False))
    elif bonus < 0:
        found.append(Guarantee("Swap affinity bonus",
                               f"bonus < 0: it must be 0..{MAX_BONUS} — refused on save", False))
    elif bonus > MAX_BONUS:
        found.append(Guarantee(
            "Band isolation",
            f"bonus ≥ {BAND_GAP}: band isolation is broken (the bonus would lift a request into "
            "the next band) — refused on save", False))
    divisor = aging_divisor
    if divisor is None or not math.isfinite(divisor):
        found.append(Guarantee("Aging", "agingDivisor is not a number — refused on save", False))
    elif divisor <= 0:
        found.append(Guarantee(
            "Aging",
            "agingDivisor ≤ 0: waiting would never raise a score, so low priorities could "
            "starve — refused on save", False))
    return found


def no_overtaking_after(gap: float, aging_divisor: float, swap_affinity_bonus: float) -> float:
    """T = (gap + bonus) * divisor: a request arriving more than T seconds after yours, with a
    priority `gap` above yours, can never be served before yours."""
    return (gap + swap_affinity_bonus) * aging_divisor


def crossover(gap: float, aging_divisor: float, affinity: float = 0) -> float:
    """Seconds a request must wait to outrank a fresh one `gap` priority points above it;
    `affinity` is the bonus the fresh one has over it (negative when only the waiting one
    has it)."""
    return (gap + affinity) * aging_divisor


def guarantees(aging_divisor: float | None, swap_affinity_bonus: float | None,
               affinity_budget: str = "") -> list[Guarantee]:
    """The panel of the settings page: each guarantee with its numbers, or the problems."""
    bad = problems(aging_divisor, swap_affinity_bonus, affinity_budget)
    if bad:
        return bad
    assert aging_divisor is not None and swap_affinity_bonus is not None
    d, b = aging_divisor, int(swap_affinity_bonus)
    ds, bs = _number(d), str(b)

    def t(gap: int) -> str:
        return format_duration(no_overtaking_after(gap, d, b))

    def formula(gap: int) -> str:
        return f"({gap} + {bs}) {TIMES} {ds} s" if gap else f"{bs} {TIMES} {ds} s"

    return [
        Guarantee(
            "Band isolation",
            f"holds: the bonus ({bs}) is below the {BAND_GAP} points between bands, so of two "
            "requests that have waited equally long, the one in the higher band always wins, "
            "whichever model is loaded."),
        Guarantee(
            "Batch vs. fresh interactive",
            "a waiting batch request outranks a fresh interactive one after "
            f"{format_duration(crossover(200, d))} (200 {TIMES} {ds} s)"
            + (f" when both or neither have affinity; after "
               f"{format_duration(crossover(200, d, b))} when only the interactive one has it, "
               f"{format_duration(crossover(200, d, -b))} when only the batch one has." if b else
               "; with a bonus of 0, affinity changes nothing.")),
        Guarantee(
            "Normal vs. fresh interactive",
            "a normal request outranks a fresh interactive one after "
            f"{format_duration(crossover(100, d))} (100 {TIMES} {ds} s)"
            + (f"; {format_duration(crossover(100, d, b))} or "
               f"{format_duration(crossover(100, d, -b))} with affinity on one side." if b else
               ".")),
        Guarantee(
            "No overtaking: batch behind interactive",
            f"an interactive request arriving more than {t(200)} ({formula(200)}) after a batch "
            "request is never served before it."),
        Guarantee(
            "No overtaking: normal behind interactive",
            f"an interactive request arriving more than {t(100)} ({formula(100)}) after a normal "
            "one is never served before it (the same holds for normal behind batch)."),
        Guarantee(
            "No overtaking: same priority",
            f"a request of the same priority arriving more than {t(0)} ({formula(0)}) later is "
            "never served first"
            + (" (strict arrival order)." if b == 0 else
               "; that is how far the affinity bonus may reorder a band to save swaps.")),
        Guarantee(
            "Longest wait behind interactive",
            f"a normal request waits at most {t(100)} behind fresh interactive arrivals: after "
            "that nothing new can pass it, and it waits only for what arrived before."),
        Guarantee("Affinity budget", budget_text(affinity_budget, d, b)),
    ]


def budget_text(affinity_budget: str, d: float, b: int) -> str:
    """How long affinity may hold a request back, with the budget (issue 23) or without.
    Without, nothing but the queue bounds it: later arrivals stop passing after b x d, but
    every one that arrived before then still goes first (the starvation trap: 729 s)."""
    if not b:
        return "with a bonus of 0 there is no affinity to bound."
    budget = parse_budget(affinity_budget)
    then = " plus the service running then; affinity is then ignored for it until it is served."
    if budget.swaps:
        return (f"auto: no request is kept back by affinity for longer than "
                f"{_number(budget.swaps)} {TIMES} its model's measured swap cost (a 30 s "
                f"load: {format_duration(budget.swaps * 30)})" + then)
    if budget.seconds:
        return ("no request is kept back by affinity for longer than "
                f"{format_duration(budget.seconds)}" + then)
    return (f"off: only the queue bounds how long affinity holds a request back: requests for "
            f"the loaded model arriving more than {format_duration(no_overtaking_after(0, d, b))}"
            " after it no longer pass it, but all that arrived before then go first; auto "
            f"bounds it by {_number(AUTO_SWAPS)} swap-times.")
