"""What if: the activity log's own requests replayed under today's settings and other ones.

The activity log holds, for every request that ran, its arrival, model, priority (as the
scheduler applied it) and service time (finished - dispatched). `compare` replays a window of
them through the real core (`scheduling/replay.py`) twice, under the settings in force and
under the ones asked about, and sets the replay under today's settings against what actually
happened: if they disagree, the what-if figures are not to be trusted either, and the operator
is told so rather than shown two confident columns.

Pure Python, like the replay: `activity/whatif.py` reads the window from the database and the
catalog, the command and the settings page render what comes back. The settings are checked by
the settings page's own code (`scheduling/guarantees.problems`), except that a bonus above 99
is replayed as 99 with a note instead of refused: the question "what would 150 do" has an
answer, which is what 99 does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from scheduling.affinity_budget import Budget, parse_budget
from scheduling.core.config import SchedulerConfig
from scheduling.core.priority import band
from scheduling.guarantees import MAX_BONUS, format_duration, problems
from scheduling.replay import Replay, Row, percentile, replay

BANDS = ("interactive", "normal", "batch")
SCHEDULERS = ("serial", "fifo")
UNLIMITED = 10**9  # every recorded request ran, so the replay must admit every one
#: a replayed wait "matches" the recorded one within this many seconds, or this share of it
TOLERANCE_S = 1.0
TOLERANCE_SHARE = 0.10
COL = 14  # the width of a figure in the printed table


class WhatIfError(ValueError):
    """Settings or a window that cannot be replayed; the message says why and what to do."""


@dataclass(frozen=True)
class Settings:
    """The scheduler settings one replay runs under."""

    scheduler: str = "serial"
    aging_divisor: float = 60.0
    swap_affinity_bonus: int = 10
    affinity_budget: str = ""  # "", "auto" or seconds (scheduling/affinity_budget.py)

    def describe(self) -> str:
        if self.scheduler == "fifo":
            return "fifo"
        return (f"serial, agingDivisor {self.aging_divisor:g} s, "
                f"swapAffinityBonus {self.swap_affinity_bonus}"
                + (f", affinityBudget {self.affinity_budget}" if self.affinity_budget else ""))


def settings_of(config: SchedulerConfig) -> Settings:
    budget = Budget(config.affinity_budget, config.affinity_budget_swaps)
    return Settings(config.scheduler, config.aging_divisor, config.swap_affinity_bonus,
                    budget.text())


def variant(today: Settings, scheduler: str | None = None, aging_divisor: float | None = None,
            swap_affinity_bonus: float | None = None, affinity_budget: str | None = None
            ) -> tuple[Settings, list[str]]:
    """Today's settings with the given ones in their place, and notes on what was changed to
    make them replayable. Raises `WhatIfError` for values the settings page refuses (a divisor
    ≤ 0, a negative or fractional bonus, an unknown scheduler, a budget that is not auto,
    seconds or off)."""
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise WhatIfError(f"scheduler {scheduler!r}: use serial or fifo")
    budget = today.affinity_budget
    if affinity_budget is not None:
        try:
            budget = parse_budget(affinity_budget).text()
        except ValueError as exc:
            raise WhatIfError(f"affinityBudget: {exc}") from None
    divisor = today.aging_divisor if aging_divisor is None else aging_divisor
    bonus = today.swap_affinity_bonus if swap_affinity_bonus is None else swap_affinity_bonus
    notes = []
    if isinstance(bonus, int | float) and math.isfinite(bonus) and bonus > MAX_BONUS \
            and bonus == int(bonus):
        notes.append(f"swapAffinityBonus {int(bonus)} is above {MAX_BONUS}, which the settings "
                     f"page refuses (it would break band isolation); replayed with {MAX_BONUS}")
        bonus = MAX_BONUS
    bad = problems(divisor, bonus)
    if bad:
        raise WhatIfError("; ".join(p.text.replace(" — refused on save", "") for p in bad))
    return Settings(scheduler or today.scheduler, float(divisor), int(bonus), budget), notes


@dataclass(frozen=True)
class Recorded:
    """One request of the window, as the activity log has it."""

    arrival: float  # seconds from the window's start (the arrival the scheduler aged from)
    model: str
    priority: int  # as the scheduler applied it
    service: float  # finished - dispatched, seconds
    wait: float  # the recorded queue wait: arrival → grant, seconds
    reported: bool = True  # counted in the figures (`--model` picks which)
    enters: float | None = None  # already waiting when the window began: enters at 0


@dataclass(frozen=True)
class Window:
    """A stretch of the activity log, ready to replay: what `activity/whatif.py` reads."""

    label: str  # "2026-12-04 05:00 → 2026-12-05 05:00 UTC (24 h)"
    rows: tuple[Recorded, ...]
    left_out: dict[str, int] = field(default_factory=dict)  # why → how many requests
    load: dict[str, float] = field(default_factory=dict)  # model → measured swap cost, s
    load_basis: dict[str, str] = field(default_factory=dict)  # model → how it was measured
    swap_cost: float = 10.0  # for a model with no measurement (or all, when given)
    preload: tuple[str, ...] = ()  # models loaded when the window starts
    recorded_swaps: int | None = None  # loads the log has in the window, when it knows


@dataclass(frozen=True)
class BandFigures:
    n: int
    p50: float
    p95: float
    max: float


@dataclass(frozen=True)
class Outcome:
    """One replay's figures: waits (arrival → start of service) per band, swaps, makespan."""

    settings: Settings
    bands: dict[str, BandFigures]
    swaps: int
    makespan: float
    affinity_picks: int  # picks the affinity term changed (serial)
    aging_picks: int  # picks the aging term changed (serial)
    idle_unloads: int = 0  # models unloaded by their ttl


@dataclass(frozen=True)
class Fidelity:
    """The replay under today's settings against what happened: the grant waits (arrival →
    grant, the `queue_wait_ms` column's meaning) side by side."""

    recorded: dict[str, BandFigures]
    replayed: dict[str, BandFigures]
    error_p50: float  # per request |replayed - recorded|, seconds
    error_p95: float
    within: int  # requests within the tolerance
    n: int
    recorded_swaps: int | None
    replayed_swaps: int

    @property
    def share_within(self) -> float | None:
        """None when nothing was compared (no request of the figures in the window)."""
        return self.within / self.n if self.n else None


@dataclass(frozen=True)
class Report:
    window: Window
    today: Outcome
    other: Outcome
    fidelity: Fidelity
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON for the settings page (NaN, from an empty band, becomes null)."""
        w = self.window  # its rows stay out: a window may hold 100,000 of them
        out: dict[str, Any] = _jsonable({
            "today": dataclasses.asdict(self.today),
            "other": dataclasses.asdict(self.other),
            "fidelity": dataclasses.asdict(self.fidelity)
            | {"share_within": self.fidelity.share_within},
            "verdict": verdict(self.fidelity),
            "verdict_level": verdict_level(self.fidelity),
            "notes": list(self.notes),
            "tolerance": {"seconds": TOLERANCE_S, "share": TOLERANCE_SHARE},
            "window": {"label": w.label, "requests": len(w.rows),
                       "reported": sum(r.reported for r in w.rows), "left_out": w.left_out,
                       "load": w.load, "load_basis": w.load_basis, "swap_cost": w.swap_cost,
                       "preload": list(w.preload), "recorded_swaps": w.recorded_swaps}})
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 3)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def replay_config(config: SchedulerConfig, settings: Settings) -> SchedulerConfig:
    """Today's models, slots and swap rules under `settings`, admitting everything: the
    window holds only requests that ran, so a limit that refuses one would replay a different
    day."""
    budget = parse_budget(settings.affinity_budget)
    return dataclasses.replace(
        config,
        models={m: dataclasses.replace(c, concurrency_limit=UNLIMITED)
                for m, c in config.models.items()},
        scheduler=settings.scheduler, aging_divisor=settings.aging_divisor,
        swap_affinity_bonus=settings.swap_affinity_bonus,
        affinity_budget=budget.seconds, affinity_budget_swaps=budget.swaps,
        max_waiting=0, max_waiting_per_band={}, report_positions=False)


def run(window: Window, config: SchedulerConfig, settings: Settings,
        ttl: dict[str, float] | None = None) -> Replay:
    rows = [Row(r.arrival, r.model, r.priority, r.service, r.enters) for r in window.rows]
    return replay(rows, replay_config(config, settings), window.swap_cost, dict(window.load),
                  window.preload, label=settings.describe(), ttl=ttl)


#: `compare`'s arguments, as activity/whatif.py's `prepare` reads them
Replayable = tuple["Window", SchedulerConfig, "Settings", tuple[str, ...],
                   dict[str, float] | None]


def compare(window: Window, config: SchedulerConfig, other: Settings,
            notes: Sequence[str] = (), ttl: dict[str, float] | None = None) -> Report:
    """Replay `window` under the settings of `config` (today's) and under `other`; `ttl`:
    each model's idle unload, seconds (the catalog's), replayed as the upstream does it."""
    if not window.rows:
        raise WhatIfError(f"no request to replay in {window.label}: "
                          + (_left_out_text(window.left_out) or "the activity log has none"))
    today = settings_of(config)
    base = run(window, config, today, ttl)
    alt = base if other == today else run(window, config, other, ttl)
    return Report(window, outcome(window, base, today), outcome(window, alt, other),
                  fidelity(window, base), tuple(notes))


def outcome(window: Window, done: Replay, settings: Settings) -> Outcome:
    waits: dict[str, list[float]] = {b: [] for b in BANDS}
    for rec, job in zip(window.rows, done.jobs, strict=True):
        if rec.reported and job.started is not None:
            waits[band(rec.priority)].append(job.started - rec.arrival)
    stats = done.stats
    return Outcome(settings, _figures(waits), done.swaps, done.makespan,
                   stats.pick_changed_by_affinity if stats else 0,
                   stats.pick_changed_by_aging if stats else 0, done.idle_unloads)


def fidelity(window: Window, done: Replay) -> Fidelity:
    recorded: dict[str, list[float]] = {b: [] for b in BANDS}
    replayed: dict[str, list[float]] = {b: [] for b in BANDS}
    errors = []
    within = 0
    for rec, job in zip(window.rows, done.jobs, strict=True):
        if not rec.reported or job.granted is None:
            continue
        got = job.granted - rec.arrival
        recorded[band(rec.priority)].append(rec.wait)
        replayed[band(rec.priority)].append(got)
        errors.append(abs(got - rec.wait))
        within += errors[-1] <= max(TOLERANCE_S, TOLERANCE_SHARE * rec.wait)
    return Fidelity(_figures(recorded), _figures(replayed), percentile(errors, 50),
                    percentile(errors, 95), within, len(errors), window.recorded_swaps,
                    done.swaps)


def _figures(waits: dict[str, list[float]]) -> dict[str, BandFigures]:
    out = {b: BandFigures(len(w), percentile(w, 50), percentile(w, 95), max(w, default=math.nan))
           for b, w in waits.items() if w}
    every = [x for w in waits.values() for x in w]
    out["all"] = BandFigures(len(every), percentile(every, 50), percentile(every, 95),
                             max(every, default=math.nan))
    return out


# ---- the text the command prints -------------------------------------------------------------


def _s(x: float) -> str:
    return "-" if math.isnan(x) else format_duration(x)


def _left_out_text(left_out: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {why}" for why, n in left_out.items() if n)


def render(report: Report) -> str:
    w, a, b, f = report.window, report.today, report.other, report.fidelity
    reported = sum(r.reported for r in w.rows)
    lines = [f"What if: {len(w.rows):,} requests of {w.label} replayed through the scheduling "
             "core" + (f" ({reported:,} of them in the figures)" if reported != len(w.rows)
                       else "")]
    if w.left_out:
        lines.append("  not replayed: " + _left_out_text(w.left_out))
    loads = [f"{m} {format_duration(c)} ({w.load_basis.get(m, '')})"
             for m, c in sorted(w.load.items())]
    unmeasured = sorted({r.model for r in w.rows} - w.load.keys())
    if unmeasured:
        loads.append(", ".join(unmeasured) + f" {format_duration(w.swap_cost)}"
                     + (" (not measured: give --swap-cost)" if w.load else ""))
    lines.append("  swap cost: " + "; ".join(loads))
    lines.append("  loaded when the window starts: " + (", ".join(w.preload) or "nothing"))
    lines += [f"  note: {n}" for n in report.notes]
    lines += ["", f"  today:   {a.settings.describe()}", f"  what if: {b.settings.describe()}",
              "", "Waits, arrival → start of service:",
              f"  {'':<19}{'today':>{3 * COL}}{'what if':>{3 * COL}}",
              f"  {'band':<13}{'n':>6}" + "".join(f"{h:>{COL}}" for h in ("p50", "p95", "max")) * 2]
    for name in (*BANDS, "all"):
        x, y = a.bands.get(name), b.bands.get(name)
        if x is None or y is None:
            continue
        lines.append(f"  {name:<13}{x.n:>6}" + "".join(
            f"{_s(v):>{COL}}" for v in (x.p50, x.p95, x.max, y.p50, y.p95, y.max)))
    lines.append(f"  {'swaps':<19}{a.swaps:>{3 * COL},}{b.swaps:>{3 * COL},}")
    if a.idle_unloads or b.idle_unloads:
        lines.append(f"  {'unloads by ttl':<19}{a.idle_unloads:>{3 * COL},}"
                     f"{b.idle_unloads:>{3 * COL},}")
    lines.append(f"  {'makespan':<19}{_s(a.makespan):>{3 * COL}}{_s(b.makespan):>{3 * COL}}")
    lines += ["", "Does the replay of today's settings match what happened? (queue waits, "
                  "arrival → grant)",
              f"  {'band':<13}{'n':>6}" + "".join(f"{h:>{COL}}" for h in (
                  "recorded p50", "p95", "replayed p50", "p95"))]
    for name in (*BANDS, "all"):
        rec, rep = f.recorded.get(name), f.replayed.get(name)
        if rec is None or rep is None:
            continue
        lines.append(f"  {name:<13}{rec.n:>6}" + "".join(
            f"{_s(v):>{COL}}" for v in (rec.p50, rec.p95, rep.p50, rep.p95)))
    lines.append(f"  per request: |replayed - recorded| median {_s(f.error_p50)}, p95 "
                 f"{_s(f.error_p95)}; {f.within:,} of {f.n:,} "
                 f"({'-' if f.share_within is None else format(f.share_within, '.0%')}) within "
                 f"{TOLERANCE_S:g} s or {TOLERANCE_SHARE:.0%}")
    lines.append("  swaps: " + (f"recorded {f.recorded_swaps:,}, " if f.recorded_swaps is not None
                                else "") + f"replayed {f.replayed_swaps:,}")
    lines.append("  " + verdict(f))
    return "\n".join(lines)


def verdict_level(f: Fidelity) -> str:
    """"matches", "roughly", "no" or "nothing" (compared): how far to trust the what-if
    column, from how well today's replay matched; the panel styles by it."""
    share = f.share_within
    if share is None:
        return "nothing"
    return "matches" if share >= 0.9 else "roughly" if share >= 0.6 else "no"


def verdict(f: Fidelity) -> str:
    """One line: how far to trust the what-if column, from how well today's replay matched."""
    level = verdict_level(f)
    if level == "nothing":
        return ("nothing to compare: no request of the figures ran in the window, so the "
                "replay cannot be checked against the log")
    if level == "matches":
        return ("the replay matches: trust the what-if figures as far as the limits in "
                "docs/scheduling.md (\"What if\") allow")
    if level == "roughly":
        return ("the replay roughly matches: read the what-if figures as a direction, not "
                "as numbers (docs/scheduling.md, \"What if\", lists why a replay drifts)")
    return ("the replay does NOT match what happened: do not rely on the what-if figures "
            "(docs/scheduling.md, \"What if\", lists why: parallel slots, unloads by ttl, "
            "requests that never ran)")


def answer_in_child(conn: Connection, args: Replayable) -> None:
    """A process's whole work: `compare(*args)` as JSON-ready data, sent down `conn` as
    ("ok", data), ("whatif", message) or ("error", what went wrong). The settings page's
    replays run here, in a process of their own (gpuproxy/api/whatif.py): minutes of pure
    Python on the proxy's own process would hold its interpreter lock and slow every
    request it serves. Imports nothing of Django: the child needs only this module."""
    try:
        conn.send(("ok", compare(*args).as_dict()))
    except WhatIfError as exc:
        conn.send(("whatif", str(exc)))
    except Exception as exc:  # the parent logs it, with its type
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()
