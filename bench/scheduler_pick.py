"""Does a scheduling decision stay cheap when the queue is long? serial and fifo side by side.

Issue 4 asks for a pick that costs O(log n) or O(models), never a full sort per decision. At
10, 1k, 10k and 100k queued requests this prints, for serial and fifo:

  pick         `scheduler.pick(now)`: the current winner, no side effects (both expose it;
               fifo's is its queue head, serial's the best of the per-model heap heads);
  decision     one full decision, the way the run loop makes them: a Cancelled for a random
               queued request plus the RequestArrived of a fresh one (same model and priority,
               so the queue keeps its size). Each event runs the whole handler: serial's walk
               and position reports, fifo's drain of the whole queue;
  uncontended  one request that waits for nothing: it arrives for a ready, idle model with
               nobody queued for it, is granted, and its ServeDone comes back. The queued work
               is for other models; this should not grow with the queue.

The box: models A B C D in the default group (one at a time), A loaded and serving one
request, so nothing queued can run (every queued request would have to evict busy A); the
queue holds requests for B, C and D with priorities uniform in -150..150 (all three bands;
fifo would grant queued requests for A at once through its fast path, so there are none,
for either scheduler). Z, a persistent side model that is ready and idle, takes the
uncontended requests. The queue is built by handing a state over (`from_state`, what a live
policy switch does) rather than by n arrivals, which would take minutes at 100k.

Times are means over many repetitions (time.perf_counter_ns around a batch), in µs. fifo's
drain walks the queue with a list.remove per request, O(n²): above `--fifo-max` (default
10k) it is not run, and the table says so.

    .venv/bin/python bench/scheduler_pick.py [--sizes 10,1000,10000,100000] [--fifo-max N]
        [--router group|matrix]

`--router matrix` describes the same box as one matrix set, `(A | B | C | D) & Z`: the
schedulers ask the matrix swapper (cached per target and running set) where they asked the
group swapper, so the two runs side by side say what the matrix costs a decision.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

from scheduling.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from scheduling.core.effects import FAILED, READY, STOPPED, Scheduler  # noqa: E402
from scheduling.core.errors import SchedulingError  # noqa: E402
from scheduling.core.events import Cancelled, Request, RequestArrived, ServeDone  # noqa: E402
from scheduling.core.fifo import Fifo  # noqa: E402
from scheduling.core.handover import SchedulerState  # noqa: E402
from scheduling.core.matrix import MatrixSwapper  # noqa: E402
from scheduling.core.serial import Serial  # noqa: E402
from scheduling.core.swapper import Group, GroupSwapper, Swapper  # noqa: E402

MODELS = ("A", "B", "C", "D", "Z")
QUEUED_FOR = ("B", "C", "D")
GOAL_PICK_US = 20.0  # the goal for serial's pick at 100k queued
NOW = 10_000.0  # the virtual `now` of every event: the queued requests arrived in 0..NOW


class QuietEffects:
    """Effects that only keep states: recording every call would measure the recorder."""

    def __init__(self) -> None:
        self.states = {"A": READY, "Z": READY}

    def model_state(self, model: str) -> str:
        return self.states.get(model, STOPPED)

    def running_models(self) -> list[str]:
        return sorted(m for m, s in self.states.items() if s not in (STOPPED, FAILED))

    def start_swap(self, model: str, evict: list[str]) -> None:
        raise AssertionError(f"no swap may start in this bench (to {model!r})")

    def grant_serve(self, req: Request, model: str) -> bool:
        return True

    def grant_error(self, req: Request, error: SchedulingError) -> None:
        raise AssertionError(f"request seq={req.seq} refused: {error.message}")

    def stop_processes(self, models: Iterable[str], handle: object) -> None:
        raise AssertionError("no unload in this bench")

    def position_changed(self, req: Request, position: int) -> None:
        pass


ROUTER = "group"  # --router: the same box as groups or as a matrix


def config(kind: str) -> SchedulerConfig:
    if ROUTER == "matrix":  # one of A B C D, always beside Z: the groups' box as sets
        swapper: Swapper = MatrixSwapper.compile([("box", "(A | B | C | D) & Z")], {}, {},
                                                 MODELS)
    else:
        side = Group("side", frozenset({"Z"}), swap=True, exclusive=False, persistent=True)
        swapper = GroupSwapper([side], MODELS)
    return SchedulerConfig(
        models={m: ModelConfig(concurrency_limit=10**9, parallel=1) for m in MODELS},
        swapper=swapper, scheduler=kind)


def build(kind: str, n: int, seed: int = 7) -> tuple[Scheduler, list[Request], Callable[[], int]]:
    """A scheduler of `kind` holding `n` queued requests and one in flight on A; returns it,
    the queued requests, and a source of fresh sequence numbers."""
    rnd = random.Random(seed)
    queued = [Request(i + 2, rnd.choice(QUEUED_FOR), rnd.uniform(0, NOW), rnd.randint(-150, 150))
              for i in range(n)]
    busy = Request(1, "A", 0.0, 0)
    state = SchedulerState(queued=list(queued), serving={busy: "A"}, now=NOW)
    cls = Serial if kind == "serial" else Fifo
    s = cls.from_state(state, config(kind), QuietEffects())
    waiting = s.queued()
    if len(waiting) != n:
        raise AssertionError(f"{kind}: {len(waiting)} queued after the build, expected {n}")
    counter = iter(range(n + 2, 10**12))
    return s, queued, lambda: next(counter)


def mean_us(op: Callable[[], None], budget_s: float, max_reps: int) -> tuple[float, int]:
    """Mean µs per call of `op`: batches of doubling size until `budget_s` or `max_reps`."""
    reps, total_ns, batch = 0, 0, 1
    while reps < max_reps and total_ns < budget_s * 1e9:
        batch = min(batch, max_reps - reps)
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            op()
        total_ns += time.perf_counter_ns() - t0
        reps += batch
        batch *= 2
    return total_ns / reps / 1000, reps


def measure(kind: str, n: int, budget_s: float) -> dict[str, tuple[float, int]]:
    """The three costs for one scheduler at one queue size."""
    s, queued, fresh = build(kind, n)
    rnd = random.Random(n)
    live = list(queued)
    out = {"pick": mean_us(lambda: s.pick(NOW), budget_s, 200_000)}

    def decision() -> None:
        i = rnd.randrange(len(live))
        old = live[i]
        s.on_cancel(Cancelled(old, NOW))
        new = Request(fresh(), old.model, NOW, old.priority)
        live[i] = new
        s.on_request(RequestArrived(new, NOW))

    out["decision"] = mean_us(decision, budget_s, 100_000)

    def uncontended() -> None:
        r = Request(fresh(), "Z", NOW, 0)
        s.on_request(RequestArrived(r, NOW))
        s.on_serve_done(ServeDone(r, NOW))  # raises unless it was granted at once

    out["uncontended"] = mean_us(uncontended, budget_s, 100_000)
    if len(s.queued()) != n:
        raise AssertionError(f"{kind}: the queue changed size during the bench")
    return out


def fmt(cell: tuple[float, int] | None) -> str:
    if cell is None:
        return "-"
    us, _ = cell
    return f"{us:,.2f} µs" if us < 1000 else f"{us / 1000:,.1f} ms"


def label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,1000,10000,100000",
                    help="queue sizes, comma-separated (10,1000,10000,100000)")
    ap.add_argument("--fifo-max", type=int, default=10_000,
                    help="largest queue fifo is measured at (its drain is O(n²)); 10000")
    ap.add_argument("--budget", type=float, default=0.3,
                    help="seconds of repetitions per cell, at least one repetition (0.3)")
    ap.add_argument("--router", choices=("group", "matrix"), default="group",
                    help="the box described as groups (default) or as a matrix set, "
                         "`(A | B | C | D) & Z`: what the matrix router costs a decision")
    args = ap.parse_args(argv)
    global ROUTER
    ROUTER = args.router
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    kinds = ["serial", "fifo"]
    print(f"scheduler_pick: µs per operation (mean); Python {platform.python_version()}, "
          f"{platform.machine()} {cpu_name()}")
    print(f"  box ({args.router} router): A B C D one at a time, A loaded and busy; queued "
          "for B C D, priorities -150..150; Z idle on the side")
    whats = ("pick", "decision", "uncontended")
    w = 11
    print(("  " + " " * 7 + "".join(f"{what:^{w * len(kinds) + 2}}" for what in whats)).rstrip())
    print("  " + f"{'queued':>7}" + "".join(
        "  " + "".join(f"{k:>{w}}" for k in kinds) for _ in whats))
    results: dict[tuple[str, int], dict[str, tuple[float, int]]] = {}
    for n in sizes:
        for k in kinds:
            if k == "fifo" and n > args.fifo_max:
                continue
            results[(k, n)] = measure(k, n, args.budget)
        print("  " + f"{label(n):>7}" + "".join(
            "  " + "".join(f"{fmt(results.get((k, n), {}).get(what)):>{w}}" for k in kinds)
            for what in whats))
    print("  pick = scheduler.pick(now); decision = a Cancelled + a RequestArrived (two full "
          "handlers);\n  uncontended = arrive + granted + ServeDone for the idle side model; "
          f"fifo not run above {label(args.fifo_max)} (O(n²) drain)")
    if sizes:
        big, small = max(sizes), min(sizes)
        pick = results[("serial", big)]["pick"][0]
        un_big = results[("serial", big)]["uncontended"][0]
        un_small = results[("serial", small)]["uncontended"][0]
        dec_big = results[("serial", big)]["decision"][0]
        dec_small = results[("serial", small)]["decision"][0]
        print(f"serial pick at {label(big)}: {pick:,.2f} µs (goal ≤ {GOAL_PICK_US:g} µs: "
              f"{'PASS' if pick <= GOAL_PICK_US else 'FAIL'}); "
              f"decision {label(big)}/{label(small)} = {dec_big / dec_small:,.1f}x; "
              f"uncontended {label(big)}/{label(small)} = {un_big / un_small:,.1f}x")
        fifo_top = max((n for k, n in results if k == "fifo"), default=None)
        if fifo_top is not None:
            f_dec = results[("fifo", fifo_top)]["decision"][0]
            s_dec = results[("serial", fifo_top)]["decision"][0]
            print(f"at {label(fifo_top)} queued: fifo/serial decision = {f_dec / s_dec:,.1f}x")
    return 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
