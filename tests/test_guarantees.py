"""The guarantees panel's formulas (scheduling/guarantees.py) against the numbers written by hand
in docs/scheduling.md, and its JavaScript mirror against the Python, value for value."""

# ruff: noqa: RUF001  (the panel writes the multiplication sign, as docs/scheduling.md does)
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduling.guarantees import (
    crossover,
    format_duration,
    guarantees,
    no_overtaking_after,
    parse_number,
    problems,
)

JS = Path(__file__).resolve().parent.parent / "scheduling" / "static" / "scheduling" / \
    "guarantees.js"


def test_the_module_is_pure():
    """No Django: the formulas are checked here, and mirrored in JavaScript, on their own."""
    code = ("import sys, scheduling.guarantees; "
            "print(','.join(m for m in ('django', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, cwd=JS.parents[3], check=True)
    assert out.stdout.strip() == ""


def texts(divisor, bonus) -> dict[str, str]:
    return {g.title: g.text for g in guarantees(divisor, bonus)}


@pytest.mark.parametrize(("seconds", "expected"), [
    (12_600, "3 h 30 min"),  # T batch behind interactive
    (12_000, "3 h 20 min"),  # crossover batch/interactive
    (11_400, "3 h 10 min"),
    (6_600, "110 min"),      # T normal behind interactive
    (6_000, "100 min"),
    (5_400, "90 min"),
    (600, "10 min"),         # T within a band
    (1_800, "30 min"),
    (105, "105 s"),          # agingDivisor 0.5
    (100, "100 s"),
    (5, "5 s"),
    (0, "0 s"),
    (0.5, "0.5 s"),
    (150, "2 min 30 s"),
    (7_200, "2 h"),
    (2 * 86_400 + 4 * 3600, "2 d 4 h"),
])
def test_format_duration_writes_what_the_docs_write(seconds, expected):
    assert format_duration(seconds) == expected


def test_the_formulas_give_the_documented_seconds():
    assert no_overtaking_after(200, 60, 10) == 12_600
    assert no_overtaking_after(100, 60, 10) == 6_600
    assert no_overtaking_after(0, 60, 10) == 600
    assert no_overtaking_after(0, 60, 0) == 0
    assert crossover(200, 60) == 12_000
    assert crossover(200, 60, 10) == 12_600
    assert crossover(200, 60, -10) == 11_400
    assert crossover(100, 60) == 6_000
    assert no_overtaking_after(200, 0.5, 10) == 105
    assert crossover(200, 0.5) == 100
    assert no_overtaking_after(0, 0.5, 10) == 5


def test_the_defaults_panel_has_the_numbers_of_docs_scheduling():
    g = texts(60, 10)
    assert g["Band isolation"].startswith("holds: the bonus (10) is below the 100 points")
    assert ("outranks a fresh interactive one after 3 h 20 min (200 × 60 s) when both or neither "
            "have affinity; after 3 h 30 min when only the interactive one has it, 3 h 10 min "
            "when only the batch one has.") in g["Batch vs. fresh interactive"]
    assert ("after 100 min (100 × 60 s); 110 min or 90 min with affinity on one side."
            in g["Normal vs. fresh interactive"])
    assert ("more than 3 h 30 min ((200 + 10) × 60 s)"
            in g["No overtaking: batch behind interactive"])
    assert "more than 110 min ((100 + 10) × 60 s)" in g["No overtaking: normal behind interactive"]
    assert "more than 10 min (10 × 60 s)" in g["No overtaking: same priority"]
    assert "waits at most 110 min behind fresh interactive" in g["Longest wait behind interactive"]
    assert all(x.ok for x in guarantees(60, 10))


def test_a_half_second_divisor_as_in_choosing_values():
    """docs/scheduling.md, "Choosing values": 100 s, 105 s and 5 s at agingDivisor 0.5."""
    g = texts(0.5, 10)
    assert "after 100 s (200 × 0.5 s)" in g["Batch vs. fresh interactive"]
    assert "more than 105 s ((200 + 10) × 0.5 s)" in g["No overtaking: batch behind interactive"]
    assert "more than 5 s (10 × 0.5 s)" in g["No overtaking: same priority"]


def test_a_bonus_of_30_reorders_a_band_by_30_minutes():
    assert "more than 30 min (30 × 60 s)" in texts(60, 30)["No overtaking: same priority"]


def test_bonus_zero_means_strict_arrival_order_and_no_affinity_variants():
    g = texts(60, 0)
    assert "more than 0 s (0 × 60 s) later is never served first (strict arrival order)." \
        in g["No overtaking: same priority"]
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
TYPED = ["60", " 0.5 ", "+7", "-1", ".5", "5.", "1e3", "", "abc", "inf", "nan", "1_000", "0x10",
         "1e999", "1.5e-3", "10.0", "٣", "1 0"]

NODE_SCRIPT = """
const g = require(process.argv[1]);
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify({
  panels: input.pairs.map(([d, b]) => g.guarantees(d, b)),
  durations: input.seconds.map(g.formatDuration),
  parsed: input.typed.map(g.parseNumber),
}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_javascript_mirror_renders_the_same_text():
    pairs = [(d, b) for d in DIVISORS for b in BONUSES]
    payload = json.dumps({"pairs": pairs, "seconds": SECONDS, "typed": TYPED})
    out = subprocess.run(["node", "-e", NODE_SCRIPT, str(JS)], input=payload, text=True,
                         capture_output=True, check=True, timeout=30)
    js = json.loads(out.stdout)
    for (d, b), panel in zip(pairs, js["panels"], strict=True):
        expected = [{"title": g.title, "text": g.text, "ok": g.ok} for g in guarantees(d, b)]
        assert panel == expected, (d, b)
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
page.id_scheduler.value = "fifo";
page.id_scheduler.fire("change");
steps.push(page["guarantees-fifo"].hidden);
process.stdout.write(JSON.stringify(steps));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_page_script_re_renders_the_panel_on_input():
    out = subprocess.run(["node", "-e", DOM_SCRIPT, str(JS)], text=True, capture_output=True,
                         check=True, timeout=30)
    refused, edited, fifo_note_hidden = json.loads(out.stdout)
    assert refused == [{"cls": "guarantee guarantee-bad",
                        "text": f"{g.title}: {g.text}"} for g in guarantees(60, 120)]
    assert "band isolation is broken" in refused[0]["text"]
    assert edited == [{"cls": "guarantee guarantee-ok",
                       "text": f"{g.title}: {g.text}"} for g in guarantees(0.5, 20)]
    assert fifo_note_hidden is False
