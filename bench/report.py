"""Run every benchmark and write BENCHMARKS.md: the machine, the date, each script's output, and
a summary of the goals. This is what `make bench` runs.

    .venv/bin/python bench/report.py [--only proxy_overhead,readiness] [--output BENCHMARKS.md]

Each `bench/*.py` (except this one) runs with no arguments, its useful default, one after the
other: first the scripts of issue 9 in its order, then the rest alphabetically. Their output is
echoed as it comes and kept. BENCHMARKS.md is rewritten between its two `report.py` marker
comments only; the hand-written text around them (what the profiles showed, what was fixed)
stays. Exit status: 1 if any script exited non-zero (a crash, or `simulate.py`'s acceptance
figures), else 0. Timings never fail it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ORDER = ["proxy_overhead", "scheduler_pick", "readiness", "queue_load", "activity_writer"]
BEGIN = "<!-- report.py: generated from here; edit around it, not inside -->"
END = "<!-- report.py: generated up to here -->"
SKELETON = f"""# Benchmarks

`make bench` runs every script in `bench/` and rewrites the generated part of this file
(`bench/README.md` says what each script measures). Every figure is a ratio against a baseline
measured in the same run, because these machines are noisy; nothing fails on a timing.

{BEGIN}
{END}

## Notes
"""
UNCONTENDED_LIMIT = 2.0  # "no growth in cost per request when uncontended": 100k/10 within noise


@dataclass
class Outcome:
    name: str
    code: int
    seconds: float
    output: str


def scripts(only: set[str] | None) -> list[str]:
    # soak.py and activity_partitions.py (10M rows) take about ten minutes: run on their own.
    present = sorted(p.stem for p in BENCH.glob("*.py")
                     if p.stem not in ("report", "soak", "activity_partitions"))
    ordered = [s for s in ORDER if s in present] + [s for s in present if s not in ORDER]
    if only:
        unknown = only - set(present)
        if unknown:
            sys.exit(f"no such benchmark: {', '.join(sorted(unknown))}")
        ordered = [s for s in ordered if s in only]
    return ordered


def run(name: str) -> Outcome:
    print(f"\n=== bench/{name}.py", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    code = proc.wait()
    seconds = time.perf_counter() - t0
    print(f"=== bench/{name}.py: exit {code}, {seconds:.0f} s", flush=True)
    return Outcome(name, code, seconds, "".join(lines).rstrip("\n"))


# ---- the machine ----------------------------------------------------------------------------

def machine() -> list[tuple[str, str]]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    os_name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return [
        ("CPU", f"{cpu}, {os.cpu_count()} logical cores"),
        ("memory", ram),
        ("OS", f"{os_name}, kernel {platform.release()} ({platform.machine()})"),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("commit", commit()),
    ]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes" if dirty else "")


# ---- the goals ------------------------------------------------------------------------------

def goals(outcomes: list[Outcome]) -> list[tuple[str, str, str]]:
    """(script, verdict, text) for every goal line a script printed, plus the scripts that
    state their goal in their own words."""
    rows: list[tuple[str, str, str]] = []
    for o in outcomes:
        if o.code != 0 and o.name != "simulate":
            rows.append((o.name, "ERROR", f"exited {o.code}: see its output"))
        if o.name == "scheduler_pick":
            rows += scheduler_pick_goals(o.output)
        elif o.name == "activity_writer":
            rows += activity_writer_goals(o.output)
        for m in re.finditer(r"^\s*(PASS|GAP|FAIL)\s+(.+)$", o.output, re.M):
            rows.append((o.name, m.group(1), m.group(2).strip()))
    return rows


def scheduler_pick_goals(out: str) -> list[tuple[str, str, str]]:
    rows = []
    m = re.search(r"serial pick at 100k: ([\d.,]+ µs) \(goal ≤ 20 µs: (\w+)\)", out)
    if m:
        rows.append(("scheduler_pick", m.group(2),
                     f"serial pick at 100k queued: {m.group(1)} (goal ≤ 20 µs)"))
    m = re.search(r"uncontended 100k/10 = ([\d.,]+)x", out)
    if m:
        ratio = float(m.group(1).replace(",", ""))
        rows.append(("scheduler_pick", "PASS" if ratio <= UNCONTENDED_LIMIT else "GAP",
                     f"uncontended request at 100k vs 10 queued: {m.group(1)}x (goal: no growth, "
                     f"≤ {UNCONTENDED_LIMIT:g}x counted as noise)"))
    return rows


def activity_writer_goals(out: str) -> list[tuple[str, str, str]]:
    m = re.search(r"throughput\s+([\d,]+) rows/s", out)
    if not m:
        return [("activity_writer", "N/A", "not measured: " + (out.splitlines() or [""])[-1])]
    rate = int(m.group(1).replace(",", ""))
    return [("activity_writer", "PASS" if rate >= 5000 else "GAP",
             f"activity rows into PostgreSQL: {rate:,} rows/s (goal ≥ 5,000)")]


# ---- BENCHMARKS.md --------------------------------------------------------------------------

def generated(outcomes: list[Outcome], total: float, started: dt.datetime) -> str:
    lines = [
        f"Generated by `make bench` (`bench/report.py`) on {started:%Y-%m-%d %H:%M} UTC; the "
        f"whole run took **{total / 60:.1f} minutes** ({total:.0f} s).",
        "",
        "Rerun: `make bench` (everything, and this file), or one script: "
        "`.venv/bin/python bench/<name>.py` (`--help` for its options).",
        "",
        "| machine | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in machine()]
    lines += ["", "### Goals", "", "| script | verdict | figure |", "|---|---|---|"]
    for script, verdict, text in goals(outcomes):
        lines.append(f"| `{script}` | {verdict} | {text.replace('|', '/')} |")
    lines += ["", "### Output", ""]
    for o in outcomes:
        lines += [f"#### `bench/{o.name}.py` (exit {o.code}, {o.seconds:.0f} s)", "", "```",
                  o.output, "```", ""]
    return "\n".join(lines).rstrip("\n")


def write(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else SKELETON
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + body + "\n" + END + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated script names (no .py)")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    only = {s.strip().removesuffix(".py") for s in args.only.split(",") if s.strip()} or None
    started = dt.datetime.now(dt.UTC)
    t0 = time.perf_counter()
    outcomes = [run(name) for name in scripts(only)]
    total = time.perf_counter() - t0
    write(args.output, generated(outcomes, total, started))
    print(f"\nwrote {args.output} ({total / 60:.1f} minutes)")
    print("goals:")
    for script, verdict, text in goals(outcomes):
        print(f"  {verdict:5} {script}: {text}")
    failed = [o.name for o in outcomes if o.code != 0]
    if failed:
        print(f"exited non-zero: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
