"""The guarantees panel's formulas (scheduling/guarantees.py) against the numbers written by hand
in docs/scheduling.md, and its JavaScript mirror against the Python, value for value.

The numbers are read out of the doc itself, never copied here: a change to the doc that the
code does not follow (or the reverse) fails, and a sentence this file can no longer find
fails too, naming it.
"""

# ruff: noqa: RUF001, RUF002  (the panel writes the multiplication sign, as docs/scheduling.md does)
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduling.affinity_budget import parse_budget
from scheduling.guarantees import (
    crossover,
    format_duration,
    guarantees,
    no_overtaking_after,
    parse_number,
    problems,
)
from tests.helpers import tool

ROOT = Path(__file__).resolve().parent.parent
JS = ROOT / "scheduling" / "static" / "scheduling" / "guarantees.js"
DOC = ROOT / "docs" / "scheduling.md"


def test_the_module_is_pure():
    """No Django: the formulas are checked here, and mirrored in JavaScript, on their own."""
    code = ("import sys, scheduling.guarantees; "
            "print(','.join(m for m in ('django', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def texts(divisor, bonus) -> dict[str, str]:
    return {g.title: g.text for g in guarantees(divisor, bonus)}


# ---- what docs/scheduling.md says --------------------------------------------------------------

def said(pattern: str) -> re.Match[str]:
    """`pattern` in the doc's prose, line breaks folded (a sentence may wrap anywhere)."""
    found = re.search(pattern, " ".join(DOC.read_text().split()))
    assert found, f"docs/scheduling.md no longer says {pattern!r}: update this test with it"
    return found


def number(text: str) -> float:
    """A number as the doc writes it: "12 600", "0.5"."""
    return float(text.replace(" ", ""))


@dataclass(frozen=True)
class Figure:
    """One duration the doc writes, the seconds its own arithmetic gives, and what the code
    computes from the same operands."""

    where: str
    seconds: float
    text: str
    computed: float


@dataclass(frozen=True)
class TRow:
    """A row of the "No overtaking after T" table: T = (gap + bonus) × divisor."""

    you: str
    later: str
    gap: int
    bonus: int
    divisor: float
    seconds: float | None  # written in the row, or not
    text: str
    without_bonus: str | None  # the row's "(0 with `swapAffinityBonus: 0`)"


_T_ROW = re.compile(
    r"\| (?P<you>[^|]+?) \| (?P<later>[^|]+?) \| "
    r"(?:\((?P<gap>\d+) \+ (?P<bonus>\d+)\)|(?P<bonus_alone>\d+)) × (?P<divisor>[\d.]+) s"
    r"(?: = (?P<seconds>\d[\d ]*) s)? = \*\*(?P<text>[^*]+)\*\*"
    r"(?: \((?P<without>\d+) with `swapAffinityBonus: 0`\))? \|")


def _name(cell: str) -> str:
    found = re.search(r"`(\w+)`", cell)
    return found.group(1) if found else cell


def t_table() -> tuple[TRow, ...]:
    lines = DOC.read_text().splitlines()
    header = lines.index("| you are | the later arrivals are | T |")
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        m = _T_ROW.fullmatch(line)
        assert m, f"a row of the T table this test cannot read: {line}"
        gap_cell = re.search(r"gap (\d+)", m["later"])
        gap = int(gap_cell.group(1)) if gap_cell else 0  # "the same priority as yours"
        if m["gap"] is not None:
            assert int(m["gap"]) == gap, f"the row's gap and its formula differ: {line}"
        rows.append(TRow(_name(m["you"]), _name(m["later"]), gap,
                         int(m["bonus"] or m["bonus_alone"]), number(m["divisor"]),
                         number(m["seconds"]) if m["seconds"] else None, m["text"],
                         m["without"]))
    assert rows, "the T table has no rows"
    return tuple(rows)


def t_row(you: str, later: str) -> TRow:
    found = [r for r in t_table() if (r.you, r.later) == (you, later)]
    assert len(found) == 1, f"the T table has no single row for {you} behind {later}"
    return found[0]


def defaults() -> tuple[float, int]:
    """(agingDivisor, swapAffinityBonus) as the doc states the defaults."""
    m = said(r"The defaults are `swapAffinityBonus: (\d+)` and `agingDivisor: (\d+)`")
    return number(m[2]), int(m[1])


def band_gap() -> int:
    return int(said(r"smaller than the gap between bands \((\d+)\)")[1])


def batch_crossover() -> re.Match[str]:
    """gap, divisor, seconds, text; then the texts with affinity on one side."""
    return said(r"outranks it once w > (\d+) × ([\d.]+) s = (\d[\d ]*) s \(\*\*([^*]+)\*\*\) "
                r"when both or neither have affinity\. It takes (.+?) when only the interactive "
                r"one has affinity, and (.+?) when only the batch one has\.")


def normal_crossover() -> re.Match[str]:
    """gap, divisor, text; then the two numbers with affinity on one side, and their unit."""
    return said(r"A `normal` request outranks a fresh interactive one after (\d+) × ([\d.]+) s "
                r"= \*\*([^*]+)\*\* \((\d+) or (\d+) (\w+) with affinity on one side\)")


def half_second() -> re.Match[str]:
    """"Choosing values" at agingDivisor 0.5: the crossover, T behind interactive, T in a band."""
    return said(r"At `([\d.]+)` \(two points per second\), a batch request outranks a fresh "
                r"interactive one after (\d+) × ([\d.]+) = (\d+) s, T for batch behind "
                r"interactive is \((\d+) \+ (\d+)\) × ([\d.]+) = (\d+) s, and within a band it "
                r"is (\d+) × ([\d.]+) = (\d+) s\.")


def bonus_30() -> re.Match[str]:
    """divisor, bonus, and the minutes of reordering the doc says it allows."""
    return said(r"With `agingDivisor: (\d+)`, a bonus of (\d+) lets requests for the loaded "
                r"model go first as long as they are less than (\d+) minutes younger")


def doc_figures() -> list[Figure]:
    """Every duration the doc gives for the formulas. Seconds come from the doc's own
    arithmetic: written out where it writes them, else its operands in its formula."""
    divisor, bonus = defaults()
    figures = []
    for r in t_table():
        seconds = r.seconds if r.seconds is not None else (r.gap + r.bonus) * r.divisor
        figures.append(Figure(f"T, {r.you} behind {r.later}", seconds, r.text,
                              no_overtaking_after(r.gap, r.divisor, r.bonus)))
        if r.without_bonus is not None:
            figures.append(Figure(f"T, {r.you} behind {r.later}, bonus 0",
                                  number(r.without_bonus), f"{r.without_bonus} s",
                                  no_overtaking_after(r.gap, r.divisor, 0)))
    c = batch_crossover()
    gap, div = int(c[1]), number(c[2])
    figures += [
        Figure("crossover batch/interactive", number(c[3]), c[4], crossover(gap, div)),
        Figure("crossover, only the interactive one has affinity", (gap + bonus) * div, c[5],
               crossover(gap, div, bonus)),
        Figure("crossover, only the batch one has affinity", (gap - bonus) * div, c[6],
               crossover(gap, div, -bonus)),
    ]
    n = normal_crossover()
    gap, div = int(n[1]), number(n[2])
    figures += [
        Figure("crossover normal/interactive", gap * div, n[3], crossover(gap, div)),
        Figure("crossover normal, interactive affinity", (gap + bonus) * div, f"{n[4]} {n[6]}",
               crossover(gap, div, bonus)),
        Figure("crossover normal, normal affinity", (gap - bonus) * div, f"{n[5]} {n[6]}",
               crossover(gap, div, -bonus)),
    ]
    h = half_second()
    figures += [
        Figure("agingDivisor 0.5: crossover", number(h[4]), f"{h[4]} s",
               crossover(int(h[2]), number(h[3]))),
        Figure("agingDivisor 0.5: T behind interactive", number(h[8]), f"{h[8]} s",
               no_overtaking_after(int(h[5]), number(h[7]), int(h[6]))),
        Figure("agingDivisor 0.5: T within a band", number(h[11]), f"{h[11]} s",
               no_overtaking_after(0, number(h[10]), int(h[9]))),
    ]
    b = bonus_30()
    figures.append(Figure("a bonus of 30", int(b[3]) * 60, f"{b[3]} min",
                          no_overtaking_after(0, number(b[1]), int(b[2]))))
    within = said(r"bonus × divisor seconds of age \(([^)]+) with the defaults\)")
    figures.append(Figure("reordering within a band", bonus * divisor, within[1],
                          no_overtaking_after(0, divisor, bonus)))
    return figures


def test_the_t_table_has_the_rows_the_panel_states():
    assert [(r.you, r.later) for r in t_table()] == [
        ("batch", "interactive"), ("normal", "interactive"), ("batch", "normal"),
        ("any", "the same priority as yours")]


def test_format_duration_writes_what_the_docs_write():
    wrong = [(f, format_duration(f.seconds)) for f in doc_figures()
             if format_duration(f.seconds) != f.text]
    assert not wrong


@pytest.mark.parametrize(("seconds", "expected"), [
    (1_800, "30 min"),
    (0, "0 s"),
    (0.5, "0.5 s"),
    (150, "2 min 30 s"),
    (7_200, "2 h"),
    (2 * 86_400 + 4 * 3600, "2 d 4 h"),
])
def test_format_duration_units(seconds, expected):
    """The rules of its docstring, beyond the doc's own figures."""
    assert format_duration(seconds) == expected


def test_the_formulas_give_the_documented_seconds():
    assert not [f for f in doc_figures() if f.computed != f.seconds]


def test_the_table_is_for_the_defaults():
    divisor, bonus = defaults()
    assert {(r.divisor, r.bonus) for r in t_table()} == {(divisor, bonus)}
    # the panel's one line for normal behind interactive also covers batch behind normal
    assert t_row("batch", "normal").gap == t_row("normal", "interactive").gap


def test_the_defaults_panel_has_the_numbers_of_docs_scheduling():
    divisor, bonus = defaults()
    g = texts(divisor, bonus)
    d = f"{divisor:g}"
    assert g["Band isolation"].startswith(
        f"holds: the bonus ({bonus}) is below the {band_gap()} points")
    c = batch_crossover()
    assert (f"outranks a fresh interactive one after {c[4]} ({c[1]} × {c[2]} s) when both or "
            f"neither have affinity; after {c[5]} when only the interactive one has it, {c[6]} "
            "when only the batch one has.") in g["Batch vs. fresh interactive"]
    n = normal_crossover()
    assert (f"after {n[3]} ({n[1]} × {n[2]} s); {n[4]} {n[6]} or {n[5]} {n[6]} with affinity "
            "on one side." in g["Normal vs. fresh interactive"])
    r = t_row("batch", "interactive")
    assert (f"more than {r.text} (({r.gap} + {r.bonus}) × {d} s)"
            in g["No overtaking: batch behind interactive"])
    r = t_row("normal", "interactive")
    assert (f"more than {r.text} (({r.gap} + {r.bonus}) × {d} s)"
            in g["No overtaking: normal behind interactive"])
    assert f"waits at most {r.text} behind fresh interactive" in g[
        "Longest wait behind interactive"]
    r = t_row("any", "the same priority as yours")
    assert f"more than {r.text} ({r.bonus} × {d} s)" in g["No overtaking: same priority"]
    assert all(x.ok for x in guarantees(divisor, bonus))


def test_a_half_second_divisor_as_in_choosing_values():
    """docs/scheduling.md, "Choosing values", at agingDivisor 0.5."""
    h = half_second()
    g = texts(number(h[1]), int(h[6]))
    assert f"after {h[4]} s ({h[2]} × {h[3]} s)" in g["Batch vs. fresh interactive"]
    assert (f"more than {h[8]} s (({h[5]} + {h[6]}) × {h[7]} s)"
            in g["No overtaking: batch behind interactive"])
    assert f"more than {h[11]} s ({h[9]} × {h[10]} s)" in g["No overtaking: same priority"]


def test_a_bonus_of_30_reorders_a_band_by_30_minutes():
    b = bonus_30()
    assert (f"more than {b[3]} min ({b[2]} × {b[1]} s)"
            in texts(number(b[1]), int(b[2]))["No overtaking: same priority"])


def test_bonus_zero_means_strict_arrival_order_and_no_affinity_variants():
    divisor, _ = defaults()
    g = texts(divisor, 0)
    assert (f"more than 0 s (0 × {divisor:g} s) later is never served first (strict arrival "
            "order).") in g["No overtaking: same priority"]
    assert "affinity changes nothing" in g["Batch vs. fresh interactive"]
    assert "with affinity on one side" not in g["Normal vs. fresh interactive"]


def test_the_largest_allowed_bonus_still_isolates_bands():
    g = guarantees(60, 99)
    assert all(x.ok for x in g)
    assert texts(60, 99)["Band isolation"].startswith("holds")


@pytest.mark.parametrize(("divisor", "bonus", "says"), [
    (60, 120, "bonus ≥ 100: band isolation is broken"),
    (60, 100, "bonus ≥ 100: band isolation is broken"),
    (60, -1, "bonus < 0: it must be 0..99"),
    (60, 10.5, "swapAffinityBonus must be a whole number"),
    (60, None, "swapAffinityBonus is not a number"),
    (0, 10, "agingDivisor ≤ 0: waiting would never raise a score"),
    (-5, 10, "agingDivisor ≤ 0"),
    (None, 10, "agingDivisor is not a number"),
])
def test_invalid_values_say_why_instead_of_computing(divisor, bonus, says):
    panel = guarantees(divisor, bonus)
    assert [g for g in panel if not g.ok], panel
    joined = " ".join(g.text for g in panel)
    assert says in joined
    assert "refused on save" in joined
    assert " min" not in joined and " h " not in joined  # no durations from invalid values


def test_the_affinity_budget_line_with_the_defaults():
    """issue 23: off, only the queue bounds what affinity costs (later arrivals stop passing
    after bonus x divisor = 600 s); auto bounds it by 6 swap-times; seconds by themselves; a
    bonus of 0 has nothing to bound; nonsense is refused on save."""
    def line(budget: str, bonus: int = 10) -> tuple[str, bool]:
        g = {g.title: g for g in guarantees(60, bonus, budget)}["Affinity budget"]
        return g.text, g.ok

    assert line("")[0].startswith("off: only the queue bounds how long affinity holds a "
                                  "request back: requests for the loaded model arriving more "
                                  "than 10 min after it no longer pass it")
    assert "6 × its model's measured swap cost (a 30 s load: 3 min) plus the service" in \
        line("auto")[0]
    assert line("90")[0].startswith("no request is kept back by affinity for longer than 90 s")
    # not capped at bonus x divisor: what arrived within it still goes first (the trap)
    assert "longer than 60 min plus" in line("3600")[0]
    assert line("auto", bonus=0)[0] == "with a bonus of 0 there is no affinity to bound."
    assert line("soon") == ("affinityBudget must be auto, a number of seconds or empty (off) "
                            "— refused on save", False)


def test_both_invalid_lists_both():
    assert [g.title for g in problems(0, 120)] == ["Band isolation", "Aging"]
    assert problems(60, 10) == []


@pytest.mark.parametrize(("text", "value"), [
    ("60", 60.0), (" 0.5 ", 0.5), ("+7", 7.0), ("-1", -1.0), (".5", 0.5), ("5.", 5.0),
    ("1e3", 1000.0), ("", None), ("abc", None), ("inf", None), ("nan", None), ("1_000", None),
    ("0x10", None), ("1e999", None), ("٣", None), (None, None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


# ---- guarantees.js gives the same text -------------------------------------------------------

DIVISORS = [60, 0.5, 1, 30, 45.5, 120, 3600, 0.001, 0.25, 7.3, 1e-6, 1.5e-5, 2e-7, 1e17,
            0, -3, None]
BONUSES = [10, 0, 1, 30, 99, 100, 120, -1, 10.5, None]
SECONDS = [0, 0.004, 0.005, 0.125, 1.125, 2.5, 9.994, 9.995, 9.999, 10, 10.5, 59.5, 119.4,
           119.5, 119.6, 120, 150.5, 599.5, 6600, 7199.4, 7199.6, 7200, 7230, 12_600,
           86_399, 172_799, 172_800, 200_000, 10**9]
BUDGETS = ["", "auto", " AUTO ", "off", "120", " 90 s ", "7.5", ".5s", "0", "9999", "x", "-5",
           "1e3", "auto6", "12 minutes", "5\u00a0s", "\u20035", "\x1c5", "\t5\n", "0.0004",
           "31536000", "31536001", "1234567.891234"]
TYPED = ["60", " 0.5 ", "+7", "-1", ".5", "5.", "1e3", "", "abc", "inf", "nan", "1_000", "0x10",
         "1e999", "1.5e-3", "10.0", "٣", "1 0"]

NODE_SCRIPT = """
const g = require(process.argv[1]);
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify({
  panels: input.pairs.map(([d, b, budget]) => g.guarantees(d, b, budget)),
  budgets: input.budgets.map(g.parseBudget),
  durations: input.seconds.map(g.formatDuration),
  parsed: input.typed.map(g.parseNumber),
}));
"""


def node() -> str:
    return tool("node", "nodejs")


def test_the_javascript_mirror_renders_the_same_text():
    pairs = [(d, b, budget) for d in DIVISORS for b in BONUSES for budget in BUDGETS]
    payload = json.dumps({"pairs": pairs, "seconds": SECONDS, "typed": TYPED,
                          "budgets": BUDGETS})
    out = subprocess.run([node(), "-e", NODE_SCRIPT, str(JS)], input=payload, text=True,
                         capture_output=True, check=True, timeout=30)
    js = json.loads(out.stdout)
    for (d, b, budget), panel in zip(pairs, js["panels"], strict=True):
        expected = [{"title": g.title, "text": g.text, "ok": g.ok}
                    for g in guarantees(d, b, budget)]
        assert panel == expected, (d, b, budget)
    for typed, got in zip(BUDGETS, js["budgets"], strict=True):
        try:
            parsed = parse_budget(typed)
        except ValueError:
            assert got is None, typed
        else:
            assert got == {"seconds": parsed.seconds, "swaps": parsed.swaps}, typed
    assert js["durations"] == [format_duration(s) for s in SECONDS]
    assert js["parsed"] == [parse_number(t) for t in TYPED]


DOM_SCRIPT = """
// Just enough of a page for guarantees.js: the two inputs, the scheduler select, the list.
function node(id, value) {
  return {id, value, hidden: false, children: [], listeners: {}, className: "", textContent: "",
    addEventListener(type, fn) { (this.listeners[type] = this.listeners[type] || []).push(fn); },
    fire(type) { (this.listeners[type] || []).forEach((fn) => fn()); },
    appendChild(c) { this.children.push(c); return c; },
    removeChild(c) { this.children.splice(this.children.indexOf(c), 1); return c; },
    get firstChild() { return this.children[0] || null; }};
}
const page = {
  id_aging_divisor: node("id_aging_divisor", "60"),
  id_swap_affinity_bonus: node("id_swap_affinity_bonus", "10"),
  id_affinity_budget: node("id_affinity_budget", ""),
  id_scheduler: node("id_scheduler", "serial"),
  "guarantees-list": node("guarantees-list"),
  "guarantees-fifo": node("guarantees-fifo"),
};
global.document = {
  readyState: "complete",
  getElementById: (id) => page[id] || null,
  createElement: () => node(),
  createTextNode: (text) => ({textContent: text}),
};
require(process.argv[1]);
const shown = () => page["guarantees-list"].children.map((li) => ({
  cls: li.className, text: li.children.map((c) => c.textContent).join("")}));
const steps = [];
page.id_swap_affinity_bonus.value = "120";
page.id_swap_affinity_bonus.fire("input");
steps.push(shown());
page.id_swap_affinity_bonus.value = "20";
page.id_swap_affinity_bonus.fire("input");
page.id_aging_divisor.value = "0.5";
page.id_aging_divisor.fire("input");
steps.push(shown());
page.id_affinity_budget.value = "auto";
page.id_affinity_budget.fire("input");
steps.push(shown());
page.id_scheduler.value = "fifo";
page.id_scheduler.fire("change");
steps.push(page["guarantees-fifo"].hidden);
process.stdout.write(JSON.stringify(steps));
"""


def test_the_page_script_re_renders_the_panel_on_input():
    out = subprocess.run([node(), "-e", DOM_SCRIPT, str(JS)], text=True, capture_output=True,
                         check=True, timeout=30)
    refused, edited, budgeted, fifo_note_hidden = json.loads(out.stdout)
    assert refused == [{"cls": "guarantee guarantee-bad",
                        "text": f"{g.title}: {g.text}"} for g in guarantees(60, 120)]
    assert "band isolation is broken" in refused[0]["text"]
    assert edited == [{"cls": "guarantee guarantee-ok",
                       "text": f"{g.title}: {g.text}"} for g in guarantees(0.5, 20)]
    assert budgeted == [{"cls": "guarantee guarantee-ok",
                         "text": f"{g.title}: {g.text}"} for g in guarantees(0.5, 20, "auto")]
    assert budgeted[-1]["text"].startswith("Affinity budget: auto")
    assert fifo_note_hidden is False
