"""The simulator behind issue 4's acceptance figures (`bench/simulate.py`) is itself right.

Its numbers are only evidence if the virtual shell is: these cases have answers worked out by
hand (swap counts on tiny traces), and the last one is the issue's own acceptance figure on the
shipped flood trace. No database, no clock: the simulation is a pure function of the trace.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_simulate() -> ModuleType:
    """Import bench/simulate.py by path: `bench` is a folder of scripts, not a package."""
    spec = importlib.util.spec_from_file_location("bench_simulate", ROOT / "bench" / "simulate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


sim = _load_simulate()

SERIAL = sim.Policy("serial", "serial", bonus=10, divisor=60.0)
ARRIVAL = sim.Policy("arrival", "arrival")


def rows(*spec: tuple[float, str, int, float]) -> list:
    return [sim.Row(*s) for s in spec]


@pytest.mark.parametrize("policy", [SERIAL, ARRIVAL], ids=lambda p: p.name)
def test_one_model_serves_everything_with_one_cold_load(policy):
    """With a single model nothing can be evicted: every request is served, in one load, and
    none starts before it arrived or overlaps another (parallel 1)."""
    trace = rows(*[(float(i // 2), "A", (-100, 0, 100)[i % 3], 2.0) for i in range(12)])
    run = sim.simulate(trace, policy, swap_cost=10.0)
    assert run.swaps == 1
    assert all(j.done is not None and j.error is None for j in run.jobs)
    assert all(j.started >= j.row.arrival for j in run.jobs)
    spans = sorted((j.started, j.done) for j in run.jobs)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert spans[0][0] == 10.0  # the cold load first, then back-to-back service


def test_round_robin_a_b_a_b_swaps_by_hand():
    """A loaded, then A B A B arriving together at equal priority. Strict arrival: A, swap to B,
    swap to A, swap to B = 3 swaps. Serial (bonus 10): the second A outscores the older B by
    the bonus, so A A, then one swap, B B = 1 swap (the issue's `A A B C` example)."""
    trace = rows((0.0, "A", 0, 1.0), (0.0, "B", 0, 1.0), (0.0, "A", 0, 1.0), (0.0, "B", 0, 1.0))
    arrival = sim.simulate(trace, ARRIVAL, swap_cost=10.0, preload=["A"])
    serial = sim.simulate(trace, SERIAL, swap_cost=10.0, preload=["A"])
    assert arrival.swaps == 3
    assert serial.swaps == 1
    order = [j.row.model for j in sorted(serial.jobs, key=lambda j: j.started)]
    assert order == ["A", "A", "B", "B"]
    # By hand, in trace order: A [0, 1], A [1, 2], swap [2, 12], B [12, 13], B [13, 14].
    assert [j.started for j in serial.jobs] == [0.0, 12.0, 1.0, 13.0]


def test_flood_trace_serial_interactive_p99_within_service_plus_swap():
    """Issue 4's acceptance figure: during a batch flood, an interactive request waits at
    most for the batch request in flight (≤ the longest service) and one swap."""
    trace = sim.load_trace(ROOT / "bench" / "traces" / "flood.csv")
    assert len(trace) >= 500
    swap_cost = 10.0
    run = sim.simulate(trace, SERIAL, swap_cost=swap_cost)
    p99 = sim.percentile(run.waits("interactive"), 99)
    assert p99 <= max(r.service for r in trace) + swap_cost


def test_dispatch_record_agrees_with_the_simulated_wait():
    """The core's Dispatch record (what the activity log will show) must tell the same story
    as the simulation: queue_wait is the wait, and the score is docs/scheduling.md's formula
    on the trace's priority and that wait, with SERIAL's divisor (60 s) and bonus (10)."""
    trace = sim.load_trace(ROOT / "bench" / "traces" / "roundrobin.csv")
    run = sim.simulate(trace, SERIAL)
    for j in run.jobs:
        d = j.dispatch
        wait = j.started - j.row.arrival
        assert d is not None and d.band == "normal" and d.priority == j.row.priority
        assert d.queue_wait == pytest.approx(wait)
        assert d.aging == pytest.approx(wait / 60)
        # parallel 1 in one group: a request is granted only on its own model, once loaded
        assert d.affinity == 10.0
        assert d.score == pytest.approx(j.row.priority + 10 + wait / 60)
    assert run.stats is not None and sum(run.stats.dispatched.values()) == len(trace)


def test_arrival_baseline_never_reorders():
    """The strict-arrival baseline serves in arrival order, whatever the priorities."""
    trace = rows((0.0, "A", -100, 1.0), (0.5, "B", 100, 1.0), (0.6, "A", 0, 1.0),
                 (0.7, "B", 100, 1.0))
    run = sim.simulate(trace, ARRIVAL)
    assert [j.index for j in sorted(run.jobs, key=lambda j: j.started)] == [0, 1, 2, 3]
    assert run.swaps == 4


def test_percentile_is_nearest_rank():
    """p99 of 100 values is the 99th smallest: a value that occurred, no interpolation."""
    values = [float(v) for v in range(1, 101)]
    assert sim.percentile(values, 99) == 99.0
    assert sim.percentile(values, 50) == 50.0
    assert sim.percentile([7.0], 99) == 7.0


def test_shipped_traces_are_what_the_generator_writes(tmp_path):
    """The committed CSVs are reproducible: regenerating gives the same bytes."""
    sim.generate(tmp_path)
    for name in sim.SHIPPED:
        shipped = (ROOT / "bench" / "traces" / f"{name}.csv").read_text()
        assert (tmp_path / f"{name}.csv").read_text() == shipped, name


# ---- a matrix box (issue 19) ----------------------------------------------------------------

FIFO = sim.Policy("fifo", "fifo")


def test_matrix_swaps_and_evictions_by_hand():
    """Sets `ae: A & E` and `b: B`, every load 10 s, service 1 s. By hand: A and E arrive at 0
    and share a set, so both load at once (0-10) and serve 10-11. B (t=5) is in no set with
    them: its swap evicts both once they are idle (11-21). E at 30 evicts B; A at 40 joins E
    in `ae`, evicting nothing. Five swaps under either real scheduler; under a one-at-a-time
    group every model change would evict, and E would wait for A's load."""
    box = sim.Box(sets=(("ae", "A & E"), ("b", "B")), vars={}, evict_costs={}, load={},
                  parallel={})
    trace = rows((0.0, "A", 0, 1.0), (0.0, "E", 0, 1.0), (5.0, "B", 0, 1.0),
                 (30.0, "E", 0, 1.0), (40.0, "A", 0, 1.0))
    for policy in (SERIAL, FIFO):
        run = sim.simulate(trace, policy, swap_cost=10.0, box=box)
        assert run.swaps == 5, policy.name
        assert run.swap_log == ((0.0, "A", ()), (0.0, "E", ()), (11.0, "B", ("A", "E")),
                                (30.0, "E", ("B",)), (40.0, "A", ())), policy.name
        assert [j.started for j in run.jobs] == [10.0, 10.0, 21.0, 40.0, 50.0], policy.name
    grouped = sim.simulate(trace, SERIAL, swap_cost=10.0)
    assert all(evicted for _, _, evicted in grouped.swap_log[1:])


def test_a_box_files_load_time_and_costs_are_used():
    """The box file's own load times: a 60 s model's first request starts at 60, a 5 s one
    beside it at 5 (they share a set, so the loads overlap)."""
    box = sim.load_box(ROOT / "bench" / "traces" / "gpu8.yaml")
    trace = rows((0.0, "llama-70b", 100, 1.0), (0.0, "embed", -100, 1.0))
    run = sim.simulate(trace, SERIAL, box=box)
    assert [j.started for j in run.jobs] == [60.0, 5.0]
    assert box.evict_costs == {"L": 30, "Q": 30, "v": 10}


# The gpu8 box by hand (gpu8.yaml's comments): GPUs each model needs, and the largest
# combinations its four sets allow (each set's expansion, written out).
GPUS = {"llama-70b": 4, "qwen-72b": 4, "chat-a": 1, "chat-b": 1, "chat-c": 1, "vision": 2,
        "embed": 0}
ALLOWED = [frozenset(s.split()) for s in (
    "llama-70b qwen-72b embed",
    *(f"{big} {pair} vision embed" for big in ("llama-70b", "qwen-72b")
      for pair in ("chat-a chat-b", "chat-a chat-c", "chat-b chat-c")),
    "llama-70b chat-a chat-b chat-c embed", "qwen-72b chat-a chat-b chat-c embed",
    "chat-a chat-b chat-c vision embed")]


@pytest.fixture(scope="module")
def gpu8_runs():
    trace = sim.load_trace(ROOT / "bench" / "traces" / "gpu8.csv")
    box = sim.load_box(ROOT / "bench" / "traces" / "gpu8.yaml")
    return trace, {p.name: sim.simulate(trace, p, box=box) for p in (SERIAL, FIFO)}


def test_gpu8_never_runs_what_the_box_cannot_hold(gpu8_runs):
    """After every swap, what runs (loading included) fits one of the matrix's combinations
    and at most 8 GPUs, under both schedulers."""
    _, runs = gpu8_runs
    for name, run in runs.items():
        running: set[str] = set()
        for when, target, evicted in run.swap_log:
            running = (running - set(evicted)) | {target}
            assert any(running <= combo for combo in ALLOWED), (name, when, sorted(running))
            assert sum(GPUS[m] for m in running) <= 8, (name, when, sorted(running))


def test_gpu8_embedding_model_is_never_evicted(gpu8_runs):
    """embed is in every set: no chat, vision or 70B load ever stops it, so it loads once, at
    its first request, and beside whatever runs no batch embedding waits longer than that
    load (5 s), though the batch band is last in line for everything else."""
    trace, runs = gpu8_runs
    first = min(r.arrival for r in trace if r.model == "embed")
    for name, run in runs.items():
        assert [e for _, _, e in run.swap_log if "embed" in e] == [], name
        assert [w for w, t, _ in run.swap_log if t == "embed"] == [first], name
        waits = [j.started - j.row.arrival for j in run.jobs if j.row.model == "embed"]
        assert max(waits) == pytest.approx(5.0), name


def test_gpu8_serial_keeps_people_waiting_less_than_fifo(gpu8_runs):
    """The batch job to qwen-72b queues in its upstream under fifo, so a chat model that
    needs its GPUs waits for the whole job; serial lets the interactive band go first: its
    interactive p95 is below fifo's, by more than a 70B's load (60 s)."""
    trace, runs = gpu8_runs
    p95 = {n: sim.percentile(r.waits("interactive"), 95) for n, r in runs.items()}
    assert p95["serial"] + 60 < p95["fifo"], p95
    assert all(j.done is not None for r in runs.values() for j in r.jobs)
    assert len(trace) == len(runs["serial"].jobs) == 1740


def test_a_box_file_with_a_mistake_names_it(tmp_path):
    """A set naming a model that is not in the trace or the box stops the run, naming it."""
    box = tmp_path / "box.yaml"
    box.write_text("matrix:\n  sets:\n    s1: 'A & nosuch'\n")
    with pytest.raises(SystemExit, match="nosuch"):
        sim.simulate(rows((0.0, "A", 0, 1.0)), SERIAL, box=sim.load_box(box))
    box.write_text("matrix: {}\n")
    with pytest.raises(SystemExit, match=r"matrix\.sets"):
        sim.load_box(box)


# ---- the affinity budget (issue 23) ----------------------------------------------------------


def budget(k: float) -> object:
    return sim.Policy(f"serial-budget-k{k:g}", "serial", bonus=10, divisor=60.0, budget_k=k)


def test_trap_b_waits_by_hand_under_each_policy():
    """The shipped trap at swap 5 s, by hand. A's cold load runs 0-5; A's are served back to
    back from 5, A(k) (arrived 4.2k) at 5 + 5k. B arrives at 10.5 while A(4.2) runs; at 15
    the older A(8.4) goes; at 20 B, now the oldest, loses to A(12.6) only by affinity. Bonus
    0: B goes at 20, swap 20-25, wait 14.5. Budget k x 5 s, from 20: k = 2 spends it at the
    pick at 30 (swap 30-35, wait 24.5), k = 6 at 50 (wait 44.5). Serial: B outscores only an
    A that arrived more than 600 s after it, A(146) at 613.2, the head once A(145) ends at
    735: swap 735-740, wait 729.5. Each run swaps 3 times (the cold load, B, back to A)."""
    trace = sim.load_trace(ROOT / "bench" / "traces" / "trap.csv")
    waits = {}
    for policy in (SERIAL, budget(2), budget(6), sim.Policy("bonus0", "serial", bonus=0)):
        run = sim.simulate(trace, policy, swap_cost=5.0)
        waits[policy.name] = next(j.started - j.row.arrival for j in run.jobs
                                  if j.row.model == "B")
        assert run.swaps == 3, policy.name
        assert run.stats.affinity_budget_overrides == (1 if policy.budget_k else 0)
    assert waits == pytest.approx({"serial": 729.5, "serial-budget-k2": 24.5,
                                   "serial-budget-k6": 44.5, "bonus0": 14.5})


def test_roundrobin3_with_a_budget_still_batches_and_bonus0_swaps_every_time():
    """`A B C …` one a second, 2 s each, swap 5 s: without affinity every request is a swap
    (60; the last, arrived at 59, starts at 5 + 59 x 7 = 418: 359 s); with the budget (k = 2
    or 6) serial still batches: at most half of those swaps."""
    trace = sim.load_trace(ROOT / "bench" / "traces" / "roundrobin3.csv")
    zero = sim.simulate(trace, sim.Policy("bonus0", "serial", bonus=0), swap_cost=5.0)
    assert zero.swaps == 60 and max(zero.waits()) == 359.0
    for k in (2, 6):
        assert sim.simulate(trace, budget(k), swap_cost=5.0).swaps <= 30, k


@pytest.mark.parametrize("swap_cost", [5.0, 10.0])
def test_mixed_budget_costs_at_most_the_stated_fraction_of_swaps(swap_cost):
    """The swap-bound mixed workload: the recommended budget (k = 6) spends budgets (else this
    would show nothing) and raises serial's swaps by at most MIXED_SWAP_RISE (10%)."""
    trace = sim.load_trace(ROOT / "bench" / "traces" / "mixed.csv")
    serial = sim.simulate(trace, SERIAL, swap_cost=swap_cost)
    with_budget = sim.simulate(trace, budget(6), swap_cost=swap_cost)
    assert with_budget.stats.affinity_budget_overrides > 0
    assert sim.MIXED_SWAP_RISE == 0.10
    assert with_budget.swaps <= serial.swaps * 1.10, (with_budget.swaps, serial.swaps)


def test_budget_sweep_runs_one_policy_per_k_and_states_its_figures(capsys):
    """`--budget-k 2,6` runs serial-budget-k2 and -k6 beside the others and prints the
    trap's figures as PASS lines; a k that is not a positive number stops with a message."""
    assert sim.main(["--trace", "trap", "--swap-cost", "5", "--budget-k", "2,6"]) == 0
    out = capsys.readouterr().out
    assert "serial-budget-k2" in out and "serial-budget-k6" in out
    assert "PASS  trap: B waits serial 729.5 s, serial-budget-k6 (k=6) 44.5 s" in out
    with pytest.raises(SystemExit):
        sim.main(["--trace", "trap", "--budget-k", "0"])
    assert "--budget-k" in capsys.readouterr().err
