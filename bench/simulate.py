"""What would each scheduling policy do with this traffic? A discrete-event replay.

Replays a trace (CSV `arrival,model,priority,service`, seconds) through the REAL scheduling core
on a virtual clock: a heap of future events, no asyncio, no sleeps, no wall clock, so a run is
exact and repeatable. The engine is the product's (scheduling/replay.py; `gpuproxy whatif`
runs it on the activity log). Its shell, `SimEffects`: a swap takes `--swap-cost` seconds (the
evicted models stop and the target is ready at its end), a granted request occupies one of its
upstream's `parallel` slots for its service time. Every model is in one swap+exclusive group
(one at a time, the default group) unless `--groups` says otherwise; `parallel` is 1 and the
concurrency limit is 10**9, so nothing is refused.

A trace may come with a box: `<trace>.yaml` beside the CSV (or `--box FILE`) describes the
machine as llama-swap's matrix (`matrix: {vars, evict_costs, sets}`, compiled by the real
`MatrixSwapper`) and, per model, its load time and slots (`models: {id: {load, parallel}}`).
Swaps whose evictions do not overlap then run side by side, as on a multi-GPU box. The shipped
`gpu8` trace is an 8-GPU box described that way (`bench/traces/gpu8.yaml`).

    .venv/bin/python bench/simulate.py                 # every shipped trace (= --all)
    .venv/bin/python bench/simulate.py --trace flood   # one shipped trace, or a CSV path
    .venv/bin/python bench/simulate.py --swap-cost 30 --aging-divisor 0.5 --bonus 20
    .venv/bin/python bench/simulate.py --trace my.csv --box my-box.yaml   # a matrix box
    .venv/bin/python bench/simulate.py --generate      # rewrite bench/traces/*.csv
    .venv/bin/python bench/simulate.py --swap-cost 5 --budget-k 2,6 --trace trap

Policies, all in the same run: `serial` (the settings given, defaults bonus 10 and divisor 60),
`serial-budget` (the same with the affinity budget of issue 23 at k x the measured swap cost,
k = 6; `--budget-k 2,6` runs one per k, named `serial-budget-k2`, ...), `serial-bonus0` (the
same with bonus 0), `fifo` (llama-swap's, with the header added to its per-model priority)
and `arrival` (strict arrival order, a baseline defined here).

The wait of a request is arrival → start of service on its upstream. For serial and arrival
that is the grant (they never grant more than `parallel`); fifo forwards everything it grants
and the upstream queues the surplus in its own slots, as llama-swap does, so its grant comes
earlier than its service and the grant alone would flatter it.

The output ends with the issue's acceptance figures, each a fact computed from the run and
printed PASS or FAIL: serial's interactive p99 on `flood` within one service time plus one
swap, serial's swaps on `roundrobin` at most half of strict arrival's, and every batch wait
within the bound of docs/scheduling.md ("Guarantees": how long can a request wait?). On
`gpu8` (issue 19): the embedding model, in every set, is never evicted, and serial's
interactive p95 wait is below fifo's. Issue 23's (the affinity budget): on `trap`, the lone B
waits at most its bonus-0 wait plus the budget plus one service; on `roundrobin3`, the budget
keeps serial's batching (swaps at most half of strict arrival's); on `mixed`, a swap-bound
mixed workload, the budget raises swaps by at most 10% over serial's.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

from scheduling.affinity_budget import AUTO_SWAPS  # noqa: E402
from scheduling.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from scheduling.core.matrix import MatrixError, MatrixSwapper  # noqa: E402
from scheduling.core.priority import band  # noqa: E402
from scheduling.core.swapper import Group, GroupSwapper  # noqa: E402
from scheduling.replay import Job, Replay, Row, percentile, replay  # noqa: E402

TRACES = ROOT / "bench" / "traces"
SHIPPED = ("flood", "roundrobin", "starvation", "gpu8", "roundrobin3", "trap", "mixed")
DEFAULT_BUDGET_K = AUTO_SWAPS  # the affinity budget's `auto`: k x the measured swap cost
MIXED_SWAP_RISE = 0.10  # on `mixed`, the budget may raise serial's swaps by at most this
BAND_ORDER = ("interactive", "normal", "batch")
BAND_GAP = 100  # bands sit 100 apart (docs/scheduling.md)
UNLIMITED = 10**9  # concurrency limit: nothing is refused, every request is served


# ---- the trace ------------------------------------------------------------------------------


def load_trace(path: Path) -> list[Row]:
    """Read a trace CSV (header `arrival,model,priority,service`), sorted by arrival; ties keep
    the file's order, which is the order they arrive in."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"arrival", "model", "priority", "service"} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit(f"{path}: missing column(s) {', '.join(sorted(missing))}; the "
                             "header must be arrival,model,priority,service")
        rows = [Row(float(r["arrival"]), r["model"].strip(), int(r["priority"]),
                    float(r["service"])) for r in reader]
    return sorted(rows, key=lambda r: r.arrival)


def write_trace(path: Path, rows: Iterable[Row]) -> int:
    """Write `rows` as a trace CSV; return how many."""
    n = 0
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["arrival", "model", "priority", "service"])
        for r in rows:
            w.writerow([f"{r.arrival:.3f}", r.model, r.priority, f"{r.service:g}"])
            n += 1
    return n


def gen_flood(seed: int = 1) -> list[Row]:
    """An interactive trickle during a batch flood: 600 batch requests to A (service 5 s) in
    the first minute, and an interactive request to B (service 2 s) every 60 ± 10 s for 80
    minutes, so they keep coming until the flood is over. The question: does a person wait
    behind 50 minutes of batch work?"""
    rnd = random.Random(seed)
    rows = [Row(rnd.uniform(0, 60), "A", -100, 5.0) for _ in range(600)]
    rows += [Row(30 + 60 * k + rnd.uniform(-10, 10), "B", 100, 2.0) for k in range(80)]
    return sorted(rows, key=lambda r: r.arrival)


def gen_roundrobin(seed: int = 2) -> list[Row]:
    """`A B A C A B A C …` at equal priority (0), one every 2 s for 20 minutes, service 3 s:
    arrivals outpace service, so a queue forms and the policy decides how often to swap."""
    del seed  # fully regular: no randomness needed
    pattern = "ABAC"
    return [Row(2.0 * i, pattern[i % 4], 0, 3.0) for i in range(600)]


def gen_starvation(seed: int = 3) -> list[Row]:
    """A steady stream to A (normal, one every 4 s for an hour, service 5 s: faster than it
    can be served) while one normal request to B arrives at t = 300 s. With A loaded, fifo
    serves A's stream first (llama-swap #612); aging must get B in."""
    del seed
    rows = [Row(4.0 * i, "A", 0, 5.0) for i in range(900)]
    rows.append(Row(300.5, "B", 0, 5.0))
    return sorted(rows, key=lambda r: r.arrival)


def gen_gpu8(seed: int = 4) -> list[Row]:
    """An hour on the 8-GPU box of `gpu8.yaml`. People chat with three 8B models (one
    interactive request each every 40 ± 20 s, 2-6 s), ask llama-70b (every 3 min, 20 s) and the
    vision model (every 5 min, 8 s); a batch job sends 240 summaries to qwen-72b in the first
    ten minutes (15 s each: an hour of work) and embeds 1,200 chunks over the hour (0.5 s).
    Both 70Bs fit together, and one 70B fits beside two 8Bs and the vision model: the chat
    models and the batch 70B keep displacing each other. The question: does a person wait
    behind the batch job, and how often does the box swap?"""
    rnd = random.Random(seed)
    rows: list[Row] = []
    for model in ("chat-a", "chat-b", "chat-c"):
        t = rnd.uniform(0, 40)
        while t < 3600:
            rows.append(Row(t, model, 100, float(rnd.randint(2, 6))))
            t += rnd.uniform(20, 60)
    rows += [Row(60 + 180 * k + rnd.uniform(-30, 30), "llama-70b", 100, 20.0)
             for k in range(20)]
    rows += [Row(150 + 300 * k + rnd.uniform(-60, 60), "vision", 100, 8.0) for k in range(12)]
    rows += [Row(rnd.uniform(0, 600), "qwen-72b", -100, 15.0) for _ in range(240)]
    rows += [Row(rnd.uniform(0, 3600), "embed", -100, 0.5) for _ in range(1200)]
    return sorted(rows, key=lambda r: r.arrival)


def gen_roundrobin3(seed: int = 6) -> list[Row]:
    """Issue 23's round robin: `A B C A B C …` at equal priority (0), one every second, 60
    requests of 2 s each. Every request is a model change, so order decides the swaps."""
    del seed
    return [Row(float(i), "ABC"[i % 3], 0, 2.0) for i in range(60)]


def gen_trap(seed: int = 7) -> list[Row]:
    """Issue 23's starvation trap: a steady stream to A (normal, one every 4.2 s for an hour,
    5 s each: a little faster than A serves it, so one is always queued) and one normal
    request to B at 10.5 s. Every A that arrives within bonus x divisor (600 s) of B outscores
    it; the affinity budget is what lets B in sooner."""
    del seed
    rows = [Row(4.2 * i, "A", 0, 5.0) for i in range(int(3600 / 4.2))]
    rows.append(Row(10.5, "B", 0, 5.0))
    return sorted(rows, key=lambda r: r.arrival)


def gen_mixed(seed: int = 5) -> list[Row]:
    """A swap-bound mixed workload, where the budget must not cost swaps: for an hour, a
    session starts every 8-44 s on one of four models (A B C D), in one band (interactive
    1 in 5, batch 1 in 5, else normal), and sends 3-10 requests 2-6 s apart, 1-4 s each. The
    box is busy nearly all the time and most of it would be swapping without affinity."""
    rnd = random.Random(seed)
    rows: list[Row] = []
    t = 0.0
    while t < 3600:
        model = rnd.choice("ABCD")
        priority = rnd.choice((100, 0, 0, 0, -100))
        u = t
        for _ in range(rnd.randint(3, 10)):
            rows.append(Row(u, model, priority, float(rnd.randint(1, 4))))
            u += rnd.uniform(2, 6)
        t += rnd.uniform(8, 44)
    return sorted(rows, key=lambda r: r.arrival)


GENERATORS: dict[str, Callable[[], list[Row]]] = {
    "flood": gen_flood,
    "roundrobin": gen_roundrobin,
    "starvation": gen_starvation,
    "gpu8": gen_gpu8,
    "roundrobin3": gen_roundrobin3,
    "trap": gen_trap,
    "mixed": gen_mixed,
}


def generate(directory: Path = TRACES) -> None:
    """Write the shipped traces (deterministic: fixed seeds)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, gen in GENERATORS.items():
        n = write_trace(directory / f"{name}.csv", gen())
        print(f"wrote {directory / f'{name}.csv'}: {n} requests")


def resolve_trace(name: str) -> Path:
    """A shipped trace's name (`flood`, `flood.csv`) or a path."""
    p = Path(name)
    if p.exists():
        return p
    shipped = TRACES / (name if name.endswith(".csv") else f"{name}.csv")
    if shipped.exists():
        return shipped
    raise SystemExit(f"no trace {name!r}: give a CSV path or one of {', '.join(SHIPPED)}")


# ---- the box --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    """The machine a trace runs on, when it is more than one model at a time: llama-swap's
    matrix (`sets` in definition order, `vars`, `evict_costs`) and each model's load time
    (seconds; `--swap-cost` for a model not named) and upstream slots (`parallel`, 1)."""

    sets: tuple[tuple[str, str], ...]
    vars: dict[str, str]
    evict_costs: dict[str, int]
    load: dict[str, float]
    parallel: dict[str, int]

    @property
    def models(self) -> set[str]:
        return {*self.vars.values(), *self.load, *self.parallel}

    def swapper(self, models: Iterable[str]) -> MatrixSwapper:
        return MatrixSwapper.compile(self.sets, self.vars, self.evict_costs, models)


def load_box(path: Path) -> Box:
    """Read a box file: `matrix: {vars, evict_costs, sets}` as in llama-swap's config (its
    legacy top-level form), and `models: {id: {load: seconds, parallel: n}}`. A mistake stops
    the run naming the file and the key."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
        matrix = data.get("matrix") or {}
        sets = matrix.get("sets") or {}
        if not isinstance(sets, dict) or not sets:
            raise ValueError("matrix.sets: give at least one set, name: expression")
        models = data.get("models") or {}
        return Box(sets=tuple((str(k), str(v)) for k, v in sets.items()),
                   vars={str(k): str(v) for k, v in (matrix.get("vars") or {}).items()},
                   evict_costs={str(k): v for k, v in (matrix.get("evict_costs") or {}).items()},
                   load={m: float(c["load"]) for m, c in models.items() if "load" in (c or {})},
                   parallel={m: int(c["parallel"]) for m, c in models.items()
                             if "parallel" in (c or {})})
    except (OSError, yaml.YAMLError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise SystemExit(f"{path}: not a box file ({exc}); see bench/traces/gpu8.yaml") from None


def box_beside(trace: Path) -> Path | None:
    """A trace's own box: `gpu8.csv` runs on `gpu8.yaml` when that file exists."""
    box = trace.with_suffix(".yaml")
    return box if box.exists() else None


# ---- policies -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # "serial" | "fifo" | "arrival"
    bonus: int = 10
    divisor: float = 60.0
    budget_k: float = 0.0  # serial: affinity budget of k x the measured swap cost; 0 = off


def policies(bonus: int = 10, divisor: float = 60.0,
             budget_ks: Sequence[float] = (DEFAULT_BUDGET_K,)) -> list[Policy]:
    """The policies every run compares: serial, serial with the affinity budget (one per k;
    named `serial-budget` for the default k alone), serial with bonus 0, fifo, arrival."""
    named = list(budget_ks) != [DEFAULT_BUDGET_K]
    return [Policy("serial", "serial", bonus, divisor),
            *(Policy(f"serial-budget-k{k:g}" if named else "serial-budget", "serial", bonus,
                     divisor, budget_k=k) for k in budget_ks),
            Policy("serial-bonus0", "serial", 0, divisor),
            Policy("fifo", "fifo", bonus, divisor),
            Policy("arrival", "arrival", bonus, divisor)]


def budgeted(runs: Sequence[Run]) -> list[Run]:
    return [r for r in runs if r.policy.budget_k > 0]


def build_config(models: Sequence[str], policy: Policy,
                 groups: Sequence[Sequence[str]] = (), box: Box | None = None
                 ) -> SchedulerConfig:
    """The scheduler config of a run: unlimited admission, `parallel` 1 unless the box says
    otherwise. With a box, its matrix decides evictions; else `groups` become swap,
    non-exclusive groups (one member at a time, beside the other groups), and the models in
    none share the default group (swap + exclusive: one at a time)."""
    swapper: GroupSwapper | MatrixSwapper
    if box is not None:
        try:
            swapper = box.swapper(models)
        except MatrixError as exc:
            raise SystemExit(f"the box's matrix: {exc}") from None
    else:
        group_objs = [Group(f"g{i}", frozenset(g), swap=True, exclusive=False)
                      for i, g in enumerate(groups, start=1)]
        swapper = GroupSwapper(group_objs, models)
    slots = box.parallel if box is not None else {}
    return SchedulerConfig(
        models={m: ModelConfig(concurrency_limit=UNLIMITED, parallel=slots.get(m, 1))
                for m in models},
        swapper=swapper,
        scheduler="serial" if policy.kind == "serial" else "fifo",
        aging_divisor=policy.divisor,
        swap_affinity_bonus=policy.bonus,
        affinity_budget_swaps=policy.budget_k,
        report_positions=False,  # no client listens: about half a long replay's time
    )


# ---- the simulation (scheduling/replay.py runs it) --------------------------------------


@dataclass
class Run(Replay):
    """The outcome of one policy on one trace: the replay and what it ran under."""

    policy: Policy = field(default_factory=lambda: Policy("serial", "serial"))
    swap_cost: float = 10.0
    one_at_a_time: bool = True  # every model in one swap group: the box is a size-1 resource


def simulate(rows: Sequence[Row], policy: Policy, swap_cost: float = 10.0,
             groups: Sequence[Sequence[str]] = (), preload: Iterable[str] = (),
             box: Box | None = None) -> Run:
    """Replay `rows` through `policy` (scheduling/replay.py) and return what happened to each
    request. `preload`: models READY at t = 0. `box`: a matrix machine instead of `groups`."""
    models = sorted({r.model for r in rows} | (box.models if box is not None else set()))
    # The budget's `auto` measures each model's swaps; until then it assumes the run's cost
    # (a live box assumes 10 s, `SchedulerConfig.assumed_swap_cost`, until its first swap).
    config = replace(build_config(models, policy, groups, box), assumed_swap_cost=swap_cost)
    done = replay(rows, config, swap_cost, box.load if box is not None else None, preload,
                  arrival_order=policy.kind == "arrival", label=policy.name)
    return Run(done.jobs, done.swaps, done.stats, done.swap_log, policy=policy,
               swap_cost=swap_cost, one_at_a_time=not groups and box is None)


# ---- reading a run --------------------------------------------------------------------------


def wait_bound(run: Run, job: Job) -> float:
    """docs/scheduling.md's bound on `job`'s wait under serial, from the trace and the run.

    On a one-at-a-time box (parallel 1), the requests that can be dispatched before `job` are
    those in the system when it arrived (queued, waiting on a swap or in flight) and those
    arriving within T = (p_max - p + bonus) * agingDivisor after it: nothing later can
    outscore it. Each of them holds the box for at most one service and two swaps: its own,
    and one it may have made useless (a swap still loading when it arrived, whose waiters it
    then outranked). Its own swap comes last:
        wait ≤ (ahead + arrivals within T) * (max service + 2 * swap) + swap.
    """
    p = run.policy
    rows = [j.row for j in run.jobs]
    p_max = max(r.priority for r in rows)
    horizon = max(0, p_max - job.row.priority + p.bonus) * p.divisor
    e = job.row.arrival
    ahead = sum(1 for j in run.jobs if j is not job and j.row.arrival <= e
                and j.done is not None and j.done > e)
    later = sum(1 for j in run.jobs if j is not job and e < j.row.arrival <= e + horizon)
    s_max = max(r.service for r in rows)
    return (ahead + later) * (s_max + 2 * run.swap_cost) + run.swap_cost


def fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.1f} s"


def bands_in(rows: Sequence[Row]) -> list[str]:
    present = {band(r.priority) for r in rows}
    return [b for b in BAND_ORDER if b in present]


def table(name: str, rows: Sequence[Row], runs: Sequence[Run], swap_cost: float,
          box: str = "") -> str:
    """The per-policy, per-band wait table of one trace, and its ratio line."""
    counts = {b: sum(1 for r in rows if band(r.priority) == b) for b in bands_in(rows)}
    serial = next((r.policy for r in runs if r.policy.name == "serial"), None)
    settings = (f"serial agingDivisor {serial.divisor:g} s, bonus {serial.bonus}"
                if serial else "serial not available")
    ks = [r.policy.budget_k for r in budgeted(runs)]
    if ks:
        settings += (", budget " + "/".join(f"{k:g}" for k in ks)
                     + " x each model's measured swap")
    out = [f"{name}: {len(rows)} requests ("
           + ", ".join(f"{b} {n}" for b, n in counts.items())
           + f"), models {' '.join(sorted({r.model for r in rows}))}, "
           + (f"matrix box {box} (its load times), " if box else
              f"swap cost {swap_cost:g} s, ")
           + settings,
           f"  {'policy':<18}{'band':<13}{'n':>5}{'p50 wait':>12}{'p99 wait':>12}"
           f"{'max wait':>12}{'swaps':>7}{'makespan':>12}"]
    for run in runs:
        for b in [*counts, "all"]:
            w = run.waits(None if b == "all" else b)
            extra = (f"{run.swaps:>7}{fmt_s(run.makespan):>12}" if b == "all" else "")
            out.append(f"  {run.policy.name:<18}{b:<13}{len(w):>5}{fmt_s(percentile(w, 50)):>12}"
                       f"{fmt_s(percentile(w, 99)):>12}{fmt_s(max(w)):>12}{extra}")
    by_name = {r.policy.name: r for r in runs}
    if "serial" in by_name:
        s = by_name["serial"]
        parts = []
        for other in ("arrival", "fifo"):
            o = by_name.get(other)
            if o is None:
                continue
            ratios = [f"swaps={ratio(s.swaps, o.swaps)}"]
            ratios += [f"p99[{b}]={ratio(percentile(s.waits(b), 99), percentile(o.waits(b), 99))}"
                       for b in counts]
            parts.append(f"serial/{other} " + " ".join(ratios))
        out.append("  ratios: " + "; ".join(parts))
    counters = [f"{r.policy.name} {r.stats.pick_changed_by_aging}/"
                f"{r.stats.pick_changed_by_affinity}"
                for r in runs if r.policy.kind == "serial" and r.stats is not None]
    if counters:
        out.append("  picks won by aging/affinity (the winner would differ without that term): "
                   + ", ".join(counters))
    overrides = [f"{r.policy.name} {r.stats.affinity_budget_overrides}"
                 for r in budgeted(runs) if r.stats is not None]
    if overrides:
        out.append("  affinity budget spent (a request's model then ranked as loaded): "
                   + ", ".join(overrides))
    return "\n".join(out)


def ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.00" if a == 0 else "inf"
    return f"{a / b:.2f}"


# ---- the acceptance figures -----------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    what: str
    ok: bool

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.what}"


def checks(name: str, rows: Sequence[Row], runs: Sequence[Run]) -> list[Check]:
    """The issue's "Done when" figures that apply to this trace, computed from its runs."""
    by_name = {r.policy.name: r for r in runs}
    s = by_name.get("serial")
    if s is None:
        return []
    out = []
    if name == "flood":
        p99 = percentile(s.waits("interactive"), 99)
        limit = max(r.service for r in rows) + s.swap_cost
        out.append(Check(f"flood: serial interactive p99 wait {fmt_s(p99)} ≤ one service "
                         f"({max(r.service for r in rows):g} s) + one swap ({s.swap_cost:g} s) "
                         f"= {limit:g} s", p99 <= limit))
    if name == "roundrobin" and "arrival" in by_name:
        a = by_name["arrival"].swaps
        out.append(Check(f"roundrobin: serial swaps {s.swaps} ≤ half of strict arrival's "
                         f"{a} = {a / 2:g}", s.swaps <= a / 2))
    if s.one_at_a_time:
        batch = [j for j in s.jobs if band(j.row.priority) == "batch"]
        if batch:
            worst = max(batch, key=lambda j: j.started - j.row.arrival)
            wait, bound = worst.started - worst.row.arrival, wait_bound(s, worst)
            over = [j for j in batch if j.started - j.row.arrival > wait_bound(s, j)]
            out.append(Check(f"{name}: serial batch max wait {fmt_s(wait)} ≤ its bound "
                             f"{fmt_s(bound)}; batch requests over their bound: {len(over)}",
                             not over))
        over = [j for j in s.jobs if j.started - j.row.arrival > wait_bound(s, j)]
        out.append(Check(f"{name}: serial requests over their wait bound (all bands): "
                         f"{len(over)} of {len(s.jobs)}", not over))
    if name == "gpu8":
        evicted = {r.policy.name: sum(1 for _, _, e in r.swap_log if "embed" in e) for r in runs}
        out.append(Check("gpu8: the embedding model (in every set) evicted " + ", ".join(
            f"{k} {v}" for k, v in evicted.items()) + " times", not any(evicted.values())))
        f = by_name.get("fifo")
        if f is not None:
            a, b = percentile(s.waits("interactive"), 95), percentile(f.waits("interactive"), 95)
            out.append(Check(f"gpu8: serial interactive p95 wait {fmt_s(a)} < fifo's "
                             f"{fmt_s(b)}", a < b))
    out += budget_checks(name, rows, runs)
    if name == "starvation":
        lone = [j for j in s.jobs if j.row.model == "B"]
        if lone:
            waits = {r.policy.name: next(j.started - j.row.arrival for j in r.jobs
                                         if j.row.model == "B") for r in runs}
            j = lone[0]
            bound = wait_bound(s, j)
            out.append(Check("starvation: the B request waits " + ", ".join(
                f"{k} {fmt_s(v)}" for k, v in waits.items())
                + f"; serial within its bound {fmt_s(bound)}", waits["serial"] <= bound))
    return out


def budget_checks(name: str, rows: Sequence[Row], runs: Sequence[Run]) -> list[Check]:
    """Issue 23's figures: the budget lets the trapped B in (within its bonus-0 wait plus the
    budget plus one service), keeps the round robin batched, and costs `mixed` at most
    MIXED_SWAP_RISE more swaps than serial."""
    by_name = {r.policy.name: r for r in runs}
    s, zero = by_name.get("serial"), by_name.get("serial-bonus0")
    out: list[Check] = []
    for b in budgeted(runs):
        label = f"{b.policy.name} (k={b.policy.budget_k:g})"
        if name == "trap" and s is not None and zero is not None:
            waits = [next(j.started - j.row.arrival for j in r.jobs if j.row.model == "B")
                     for r in (s, b, zero)]
            budget = b.policy.budget_k * b.swap_cost
            limit = waits[2] + budget + max(r.service for r in rows)
            out.append(Check(f"trap: B waits serial {fmt_s(waits[0])}, {label} {fmt_s(waits[1])}"
                             f" ≤ bonus-0's {fmt_s(waits[2])} + budget {budget:g} s + one "
                             f"service = {limit:g} s", waits[1] <= limit))
        if name == "roundrobin3" and "arrival" in by_name:
            a = by_name["arrival"].swaps
            out.append(Check(f"roundrobin3: {label} swaps {b.swaps} ≤ half of strict "
                             f"arrival's {a} = {a / 2:g}", b.swaps <= a / 2))
        if name == "mixed" and s is not None:
            limit = s.swaps * (1 + MIXED_SWAP_RISE)
            out.append(Check(f"mixed: {label} swaps {b.swaps} ≤ serial's {s.swaps} + "
                             f"{MIXED_SWAP_RISE:.0%} = {limit:g}", b.swaps <= limit))
    return out


# ---- the command ----------------------------------------------------------------------------


def parse_groups(text: str | None) -> list[list[str]]:
    """`A,B/C` → [[A, B], [C]]: groups separated by '/', members by ','."""
    if not text:
        return []
    return [[m.strip() for m in g.split(",") if m.strip()] for g in text.split("/") if g.strip()]


def run_trace(path: Path, swap_cost: float, bonus: int, divisor: float,
              groups: Sequence[Sequence[str]] = (), box_path: Path | None = None,
              budget_ks: Sequence[float] = (DEFAULT_BUDGET_K,)) -> tuple[str, list[Check]]:
    """Run every policy on one trace (on its box: `box_path`, else the one beside it, unless
    groups are given); return its printed table and its checks."""
    rows = load_trace(path)
    if box_path is None and not groups:
        box_path = box_beside(path)
    box = load_box(box_path) if box_path is not None else None
    runs = [simulate(rows, p, swap_cost, groups, box=box)
            for p in policies(bonus, divisor, budget_ks)]
    name = path.stem
    return (table(path.name, rows, runs, swap_cost, box_path.name if box_path else ""),
            checks(name, rows, runs))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append",
                    help="a shipped trace name (" + ", ".join(SHIPPED) + ") or a CSV "
                         "path; repeatable (default: every shipped trace)")
    ap.add_argument("--all", action="store_true", help="run every shipped trace")
    ap.add_argument("--swap-cost", type=float, default=10.0, help="seconds per swap (10)")
    ap.add_argument("--aging-divisor", type=float, default=60.0,
                    help="serial: seconds of waiting per point (60)")
    ap.add_argument("--bonus", type=int, default=10, help="serial: swap affinity bonus (10)")
    ap.add_argument("--budget-k", default=f"{DEFAULT_BUDGET_K:g}",
                    help="serial-budget: the affinity budget in swaps, k x each model's "
                         "measured swap cost; a list (2,6) runs one policy per k (6)")
    ap.add_argument("--groups", help="swap groups, e.g. A,B/C (each one at a time, beside "
                                     "the others); default: all models in one group")
    ap.add_argument("--box", type=Path,
                    help="a box file (llama-swap's matrix, per-model load and parallel) for "
                         "every trace given; default: <trace>.yaml beside the CSV, if any")
    ap.add_argument("--generate", action="store_true",
                    help="rewrite the shipped traces in bench/traces/ and exit")
    args = ap.parse_args(argv)
    if args.generate:
        generate()
        return 0
    if args.aging_divisor <= 0:
        ap.error("--aging-divisor must be > 0")
    try:
        budget_ks = [float(k) for k in args.budget_k.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--budget-k: give numbers of swaps separated by commas, e.g. 2,6 "
                 f"(not {args.budget_k!r})")
    if not budget_ks or any(not k > 0 or not math.isfinite(k) for k in budget_ks):
        ap.error("--budget-k: every k must be a positive number of swaps, e.g. 2,6")
    if args.box is not None and args.groups:
        ap.error("--box and --groups both say how models share the box: give one")
    names = list(args.trace or [])
    if args.all or not names:
        names = [*SHIPPED, *[n for n in names if n not in SHIPPED]]
    all_checks: list[Check] = []
    for n in names:
        text, cs = run_trace(resolve_trace(n), args.swap_cost, args.bonus, args.aging_divisor,
                             parse_groups(args.groups), args.box, budget_ks)
        print(text + "\n")
        all_checks += cs
    if all_checks:
        print("acceptance (issues 4, 19 and 23, computed from the runs above):")
        for c in all_checks:
            print(f"  {c}")
    return 0 if all(c.ok for c in all_checks) else 1


if __name__ == "__main__":
    sys.exit(main())
