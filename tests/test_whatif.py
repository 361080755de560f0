"""What if (issue 22): the activity log's own requests replayed under other settings.

The pure half (scheduling/whatif.py) on windows whose answers are worked out here by hand; the
window as activity/whatif.py reads it from the tables (arrivals, swap costs, what was loaded,
what is left out); and the command. The real proxy's own log replayed is
tests/test_whatif_e2e.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import random
import uuid

import pytest
from django.core.management import CommandError, call_command

from activity import events
from activity import whatif as window_reader
from activity.models import ModelEvent, RequestLog
from scheduling.core.config import ModelConfig, SchedulerConfig
from scheduling.core.priority import band
from scheduling.core.swapper import GroupSwapper
from scheduling.models import ModelDefinition, ProxySettings
from scheduling.replay import Row, replay
from scheduling.whatif import (
    Recorded,
    Settings,
    WhatIfError,
    Window,
    compare,
    render,
    run,
    variant,
)


def one_at_a_time(*models: str, bonus: int = 10, divisor: float = 60.0) -> SchedulerConfig:
    return SchedulerConfig(models={m: ModelConfig() for m in models},
                           swapper=GroupSwapper([], list(models)), scheduler="serial",
                           aging_divisor=divisor, swap_affinity_bonus=bonus)


# ---- the pure half, by hand ------------------------------------------------------------------

# A is loaded; A (10 s) arrives at 0, B (2 s) at 1, A (3 s) at 2, all priority 0; a swap is 5 s.
# At t = 10 both wait. Bonus 10: A scores 10 + 8/60 against B's 9/60, so A runs 10-13, then the
# swap 13-18, B 18-20: waits 0, 17, 8; one swap; makespan 20. Bonus 0: B (9/60 > 8/60) swaps
# 10-15, runs 15-17, A swaps back 17-22, runs 22-25: waits 0, 14, 20; two swaps; makespan 25.
HAND = Window(label="by hand", rows=(
    Recorded(0.0, "A", 0, 10.0, wait=0.0),
    Recorded(1.0, "B", 0, 2.0, wait=17.0),
    Recorded(2.0, "A", 0, 3.0, wait=12.0),  # recorded 4 s off what the replay gives (8 s)
), swap_cost=5.0, preload=("A",), recorded_swaps=1)


def test_a_hand_worked_window_under_today_and_bonus_0():
    report = compare(HAND, one_at_a_time("A", "B"), Settings("serial", 60.0, 0))
    today, other = report.today, report.other
    assert (today.bands["normal"].n, today.bands["normal"].p50, today.bands["normal"].max) == \
        (3, 8.0, 17.0)
    assert (today.swaps, today.makespan) == (1, 20.0)
    assert (other.bands["normal"].p50, other.bands["normal"].max) == (14.0, 20.0)
    assert (other.swaps, other.makespan) == (2, 25.0)
    assert today.affinity_picks == 1 and other.affinity_picks == 0


def test_fidelity_compares_each_recorded_wait_with_its_replay():
    f = compare(HAND, one_at_a_time("A", "B"), Settings()).fidelity
    # errors 0, 0 and 4 s: the third is outside max(1 s, 10 % of 12 s)
    assert (f.n, f.within, f.error_p50, f.error_p95) == (3, 2, 0.0, 4.0)
    assert f.recorded["normal"].p95 == 17.0 and f.replayed["normal"].max == 17.0
    assert (f.recorded_swaps, f.replayed_swaps) == (1, 1)
    assert "roughly matches" in render(compare(HAND, one_at_a_time("A", "B"), Settings()))


def test_only_the_chosen_models_are_counted_but_all_are_replayed():
    rows = tuple(Recorded(r.arrival, r.model, r.priority, r.service, r.wait,
                          reported=r.model == "B") for r in HAND.rows)
    window = Window("by hand", rows, swap_cost=5.0, preload=("A",))
    report = compare(window, one_at_a_time("A", "B"), Settings("serial", 60.0, 0))
    # B alone in the figures, still behind A's 10 s: 17 s today, 14 s with bonus 0
    assert report.today.bands["all"].n == 1
    assert (report.today.bands["all"].max, report.other.bands["all"].max) == (17.0, 14.0)
    assert report.today.swaps == 1  # the swap count is the box's, every request's


@pytest.mark.parametrize("arrival_order", [False, True])
def test_a_model_idle_for_its_ttl_unloads_and_the_next_request_pays_its_load(arrival_order):
    """A loaded, ttl 30 s, loads in 10 s. A at 0 runs to 5; A at 20 runs 20-25 (idle only
    15 s); A at 100 finds it unloaded since 55 (25 + 30) and waits for a load: 10 s. It
    unloads again at 135, idle since 105."""
    rows = [Row(0.0, "A", 0, 5.0), Row(20.0, "A", 0, 5.0), Row(100.0, "A", 0, 5.0)]
    config = one_at_a_time("A")
    kept = replay(rows, config, 10.0, preload=("A",), arrival_order=arrival_order)
    assert [j.started - j.row.arrival for j in kept.jobs] == [0.0, 0.0, 0.0]
    idle = replay(rows, config, 10.0, preload=("A",), arrival_order=arrival_order,
                  ttl={"A": 30.0})
    assert [j.started - j.row.arrival for j in idle.jobs] == [0.0, 0.0, 10.0]
    assert (idle.swaps, idle.idle_unloads) == (1, 2)


def test_the_affinity_budget_replayed():
    """issue 23's starvation trap in miniature: loaded A gets a request every 4 s (5 s each,
    more than the box serves) and one B arrives at 30 s. Affinity alone holds B back until
    aging gets it in (bonus x divisor = 600 s). With a 60 s budget it waits at most for the
    service running when it arrived (its first lost pick comes when that ends), the budget,
    the service running when the budget runs out, and its own swap: 5 + 60 + 5 + 5 s."""
    rows = [Recorded(4.0 * i, "A", 0, 5.0, wait=0.0) for i in range(300)]
    rows.append(Recorded(30.5, "B", 0, 5.0, wait=0.0))
    window = Window("trap", tuple(sorted(rows, key=lambda r: r.arrival)), swap_cost=5.0,
                    preload=("A",))
    other, notes = variant(Settings(), affinity_budget="60")
    assert (other.affinity_budget, notes) == ("60", [])
    report = compare(window, one_at_a_time("A", "B"), other)
    lone = [i for i, r in enumerate(window.rows) if r.model == "B"]
    assert report.other.settings.describe().endswith("affinityBudget 60")

    def b_wait(settings: Settings) -> float:
        done = run(window, one_at_a_time("A", "B"), settings)
        job = done.jobs[lone[0]]
        assert job.started is not None
        return job.started - job.row.arrival

    assert b_wait(Settings()) > 500
    assert b_wait(other) <= 5 + 60 + 5 + 5
    with pytest.raises(WhatIfError, match="affinityBudget: 'soon' is not a budget"):
        variant(Settings(), affinity_budget="soon")


def test_a_model_loaded_when_the_window_begins_unloads_by_its_ttl_too():
    """A is loaded at the start (ttl 30 s, used last at some time before): unused, it
    unloads by 30 s at the latest, so a request at 100 waits for its load (10 s)."""
    done = replay([Row(100.0, "A", 0, 5.0)], one_at_a_time("A"), 10.0, preload=("A",),
                  ttl={"A": 30.0})
    assert (done.jobs[0].started - 100.0, done.swaps) == (10.0, 1)


def test_nothing_to_compare_is_not_a_match():
    """No request of the figures in the window (`--model` naming one that did not run):
    nothing was checked, and the verdict says so instead of "trust"."""
    rows = tuple(dataclasses.replace(r, reported=False) for r in HAND.rows)
    report = compare(dataclasses.replace(HAND, rows=rows), one_at_a_time("A", "B"), Settings())
    assert (report.fidelity.n, report.fidelity.share_within) == (0, None)
    assert report.as_dict()["verdict_level"] == "nothing"
    assert "nothing to compare" in render(report) and "trust" not in render(report)


def test_settings_are_checked_as_the_settings_page_checks_them():
    today = Settings("serial", 60.0, 10)
    assert variant(today) == (today, [])
    capped, notes = variant(today, swap_affinity_bonus=150)
    assert capped.swap_affinity_bonus == 99 and "150 is above 99" in notes[0]
    assert variant(today, "fifo", 30, 0)[0] == Settings("fifo", 30.0, 0)
    for kwargs, words in (({"aging_divisor": 0}, "agingDivisor ≤ 0"),
                          ({"aging_divisor": -5}, "agingDivisor ≤ 0"),
                          ({"swap_affinity_bonus": -1}, "bonus < 0"),
                          ({"swap_affinity_bonus": 2.5}, "whole number"),
                          ({"aging_divisor": math.nan}, "not a number"),
                          ({"scheduler": "lifo"}, "serial or fifo")):
        with pytest.raises(WhatIfError, match=words):
            variant(today, **kwargs)


def test_an_empty_window_says_why():
    with pytest.raises(WhatIfError,
                       match=r"no request to replay in the last hour: 3 never dispatched$"):
        compare(Window("the last hour", (), left_out={"never dispatched": 3}),
                one_at_a_time("A"), Settings())


def test_the_json_has_no_nan_and_says_the_tolerance():
    data = compare(HAND, one_at_a_time("A", "B"), Settings()).as_dict()
    json.dumps(data, allow_nan=False)  # an empty band's figures would be NaN
    assert data["tolerance"] == {"seconds": 1.0, "share": 0.1}
    assert data["window"]["requests"] == 3 and data["fidelity"]["within"] == 2
    assert "rows" not in data["window"] and data["verdict"].startswith("the replay roughly")


# ---- the window from the tables ---------------------------------------------------------------

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)
T0 = NOW - dt.timedelta(hours=2)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def log_row(model: str, received: float, dispatched: float | None, finished: float | None,
            priority: int = 0, wait: float | None = None, scheduler: str = "serial",
            swap: float | None = None) -> RequestLog:
    return RequestLog(
        request_id=uuid.uuid4(), received_at=at(received),
        dispatched_at=None if dispatched is None else at(dispatched),
        finished_at=None if finished is None else at(finished), model=model,
        model_requested=model, priority=priority, band=band(priority),
        outcome="ok" if dispatched is not None else "rejected", scheduler=scheduler,
        queue_wait_ms=None if wait is None else wait * 1000,
        swap_ms=None if swap is None else swap * 1000)


def define(*models: str) -> None:
    for m in models:
        ModelDefinition.objects.create(model_id=m, cmd="x", proxy="http://127.0.0.1:1")


def event(model: str, kind: str, seconds: float, duration: float | None = None,
          reason: str = events.REQUEST) -> ModelEvent:
    return ModelEvent(model=model, kind=kind, reason=reason, at=at(seconds),
                      duration_ms=None if duration is None else duration * 1000)


@pytest.mark.django_db
def test_the_window_read_from_the_tables():
    define("A", "B")
    RequestLog.objects.bulk_create([
        log_row("A", 100, 100, 110, wait=0),
        # a trusted peer's request that had already waited 30 s elsewhere: it arrived, for
        # the scheduler, at dispatched - queue_wait = 90, before it reached this box
        log_row("B", 120, 125, 127, wait=35, swap=5.0),
        log_row("A", 130, None, 130),  # refused: no service time
        log_row("peer1/x", 131, 131, 140, scheduler="peer"),
        log_row("gone", 132, 132, 140, wait=0),  # its definition was deleted since
        log_row("A", 133, 133, None, wait=0),  # still running
        log_row("A", -10, -10, 1, wait=0),  # before the window
    ])
    ModelEvent.objects.bulk_create([
        event("A", events.LOAD, 10), event("A", events.READY, 14, 4.0),
        event("B", events.LOAD, 20), event("B", events.READY, 25, 5.0),
        event("B", events.UNLOAD, 30, 1.0, reason=events.SWAP),
        # inside the window: B loads in 6 s and 8 s, A's stop for it takes 2 s
        event("A", events.UNLOAD, 120, 2.0, reason=events.SWAP),
        event("B", events.LOAD, 120), event("B", events.READY, 126, 6.0),
        event("B", events.READY, 200, 8.0),
    ])
    config = one_at_a_time("A", "B")
    w = window_reader.read_window(at(60), at(600), config)
    assert [(r.model, r.arrival, r.service, r.wait) for r in w.rows] == [
        ("B", 30.0, 2.0, 35.0), ("A", 40.0, 10.0, 0.0)]
    assert w.left_out == {window_reader.NEVER_RAN: 1, window_reader.PEER: 1,
                          window_reader.UNDEFINED: 1, window_reader.UNFINISHED: 1}
    # B: the median of its two loads in the window (7 s) + the window's median stop (2 s);
    # A: no load in the window, so its last one before it (4 s) + the stop
    assert w.load == {"B": 9.0, "A": 6.0}
    assert "2 loads in the window" in w.load_basis["B"] and "before" in w.load_basis["A"]
    assert w.preload == ("A",)  # A's last event before the window is its ready; B's an unload
    assert w.recorded_swaps == 1  # one LOAD inside the window
    given = window_reader.read_window(at(60), at(600), config, swap_cost=3.0)
    assert (given.load, given.swap_cost) == ({}, 3.0)


@pytest.mark.django_db
def test_a_request_running_when_the_window_begins_still_holds_the_box():
    """The window starts at 100 while A's request (95-110) runs. B arrives at 101 and waits
    for it, then for its own 5 s load: 14 s. Replayed without A, B would have found the box
    free and waited only for the load (5 s). A is replayed but not counted."""
    define("A", "B")
    RequestLog.objects.bulk_create([log_row("A", 95, 95, 110, wait=0),
                                    log_row("B", 101, 115, 117, wait=14, swap=5)])
    ModelEvent.objects.bulk_create([
        event("A", events.LOAD, 50), event("A", events.READY, 55, 5.0),
        event("B", events.LOAD, 110), event("B", events.READY, 115, 5.0)])
    report = window_reader.report(at(100), at(200), config=one_at_a_time("A", "B"))
    f = report.fidelity
    assert (f.n, f.within, f.replayed["normal"].max) == (1, 1, 14.0)
    assert (f.recorded_swaps, f.replayed_swaps) == (1, 1)
    assert report.window.preload == ("A",)
    assert [(r.model, r.arrival, r.reported) for r in report.window.rows] == [
        ("A", -0.001, False), ("B", 1.0, True)]  # A holds its slot from the start to 110


@pytest.mark.django_db
def test_what_began_before_the_window_is_read_at_its_start():
    """A request ran for six hours up to 50 s into the window, B's loads and unloads came and
    went before it (30 of them), and a request for B has waited since 10 s before the
    window: it enters at the start, aged from its arrival, waits for A's end (50 s) and its
    load (5 s), 65 s as recorded. What was loaded and the loads counted are the window's own:
    A, and B's one load in it. A request for B at 60 s finds B loaded."""
    define("A", "B")
    RequestLog.objects.bulk_create([
        log_row("A", 100 - 6 * 3600, 100 - 6 * 3600, 150, wait=0),
        log_row("B", 90, 155, 156, wait=65, swap=5),
        log_row("B", 160, 160, 161, wait=0),
    ])
    early = [event("A", events.LOAD, -6 * 3600), event("A", events.READY, -6 * 3600 + 5, 5.0)]
    for k in range(30):
        t = -20000 + 600 * k
        early += [event("B", events.LOAD, t), event("B", events.READY, t + 5, 5.0),
                  event("B", events.UNLOAD, t + 60, 0.0, reason=events.ADMIN)]
    ModelEvent.objects.bulk_create([*early, event("B", events.LOAD, 150),
                                    event("B", events.READY, 155, 5.0)])
    report = window_reader.report(at(100), at(300), config=one_at_a_time("A", "B"))
    w = report.window
    assert [(r.model, r.arrival, r.enters, r.reported) for r in w.rows] == [
        ("B", -10.0, 0.0, False), ("A", -0.001, None, False), ("B", 60.0, None, True)]
    assert w.preload == ("A",)
    f = report.fidelity
    assert (f.n, f.within, f.recorded_swaps, f.replayed_swaps) == (1, 1, 1, 1)
    done = run(w, one_at_a_time("A", "B"), report.today.settings)
    assert done.jobs[0].granted - w.rows[0].arrival == pytest.approx(65.0)


@pytest.mark.django_db
def test_a_window_longer_than_one_replay_takes_its_newest(monkeypatch):
    """At most 2 here: the newest two (arrived 35 and 25) are replayed from 25; the one that
    arrived at 15 still ran at 25 (20-30), so it is replayed uncounted, holding its slot from
    the start (1 ms before it) to 30; the one of 10 is not. Both older ones are said to be
    left out."""
    monkeypatch.setattr(window_reader, "MAX_REQUESTS", 2)
    define("A")
    RequestLog.objects.bulk_create([log_row("A", 10, 10, 20, wait=0),
                                    log_row("A", 15, 20, 30, wait=5),
                                    log_row("A", 25, 30, 40, wait=5),
                                    log_row("A", 35, 40, 50, wait=5)])
    w = window_reader.read_window(at(0), at(100), one_at_a_time("A"))
    assert [(r.arrival, r.reported, r.service) for r in w.rows] == [
        (-0.001, False, 5.001), (0.0, True, 10.0), (10.0, True, 10.0)]
    assert w.left_out == {window_reader.TRIMMED.format(n=2): 2}
    assert w.label.startswith(f"{at(25):%Y-%m-%d %H:%M:%S} →")


@pytest.mark.django_db
def test_a_log_without_model_events_falls_back_on_the_requests():
    define("A", "B")
    RequestLog.objects.bulk_create([
        log_row("A", 100, 100, 110, wait=0.2),
        log_row("B", 101, 120, 122, wait=19.0, swap=9.0),
        log_row("B", 102, 122, 124, wait=20.0, swap=4.0),
    ])
    w = window_reader.read_window(at(60), at(600), one_at_a_time("A", "B"))
    assert w.load == {"B": 6.5} and "median wait of 2" in w.load_basis["B"]
    assert w.preload == ("A",)  # the first request waited for no load
    assert w.recorded_swaps is None  # the log knows nothing of loads
    assert "A 10 s" in render(compare(w, one_at_a_time("A", "B"), Settings()))


# ---- the test: a synthetic trace's log replayed ------------------------------------


def record_trace(seed: int = 7) -> tuple[dt.datetime, dt.datetime]:
    """Fill the tables as the proxy would have after serving a synthetic trace under the
    default settings: three models on a one-at-a-time box, loads of 8 s. The log's load times
    are spread around the true one (7-9 s), as real loads are, so the replay measures 8 s
    only as their median; refused and peer requests are in the log too."""
    rnd = random.Random(seed)
    trace = sorted((Row(rnd.uniform(0, 3000), rnd.choice("ABC"), rnd.choice((100, 0, -100)),
                        round(rnd.uniform(1, 8), 3)) for _ in range(400)),
                   key=lambda r: r.arrival)
    done = replay(trace, one_at_a_time("A", "B", "C"), 8.0)
    start = T0 - dt.timedelta(minutes=5)
    rows = [log_row(j.row.model, j.row.arrival, j.granted, j.done, j.row.priority,
                    wait=j.granted - j.row.arrival) for j in done.jobs]
    rows += [log_row("A", 50.0 * k, None, 50.0 * k, priority=-100) for k in range(20)]
    rows += [log_row("peer/x", 77.0, 77.0, 80.0, scheduler="peer")]
    RequestLog.objects.bulk_create(rows)
    ModelEvent.objects.bulk_create(
        e for i, (t, m, _evicted) in enumerate(done.swap_log)
        for e in (event(m, events.LOAD, t), event(m, events.READY, t + 8, 7.0 + (i % 3))))
    define("A", "B", "C")
    return start, NOW


@pytest.mark.django_db
def test_a_synthetic_traces_log_replays_as_it_happened_and_bonus_0_swaps_more(capsys):
    start, end = record_trace()
    today = window_reader.report(start, end)
    f = today.fidelity
    # Stated tolerance: every request within max(1 s, 10 %) of its recorded wait, the same
    # number of swaps. (The measured load is the median of 7, 8 and 9 s: exactly 8 s.)
    assert (f.n, f.within) == (400, 400)
    assert f.recorded_swaps == f.replayed_swaps == today.today.swaps
    assert today.window.left_out == {window_reader.NEVER_RAN: 20, window_reader.PEER: 1}
    bonus0 = window_reader.report(start, end, swap_affinity_bonus=0)
    assert bonus0.other.swaps > bonus0.today.swaps
    call_command("whatif", "--since", "3h", "--swap-affinity-bonus", "0")
    out = capsys.readouterr().out
    assert "swapAffinityBonus 0" in out and "400 of 400 (100%)" in out
    swaps = next(line for line in out.splitlines() if line.strip().startswith("swaps "))
    assert swaps.split()[1:] == [f"{bonus0.today.swaps:,}", f"{bonus0.other.swaps:,}"]


@pytest.mark.django_db
def test_a_slower_load_than_recorded_shows_in_the_fidelity():
    """The same log with a swap cost of 20 s given instead of the measured 8: the replay no
    longer matches, and the report says not to rely on it."""
    start, end = record_trace()
    report = window_reader.report(start, end, swap_cost=20.0)
    assert report.fidelity.share_within < 0.6
    assert "does NOT match" in render(report)


@pytest.mark.django_db
def test_todays_settings_come_from_the_settings_page():
    start, end = record_trace()
    ProxySettings.objects.filter(pk=ProxySettings.load().pk).update(swap_affinity_bonus=0)
    report = window_reader.report(start, end, swap_affinity_bonus=10)
    assert report.today.settings.swap_affinity_bonus == 0
    assert report.other.settings.swap_affinity_bonus == 10
    assert report.fidelity.share_within < 1.0  # the log was made with 10, replayed with 0


@pytest.mark.django_db
def test_the_catalogs_ttl_is_replayed():
    """A's ttl (60 s on its definition) unloads it between two requests 10 min apart: today's
    replay loads it twice, as the log did, and says so (it unloads at 175 and 775)."""
    ModelDefinition.objects.create(model_id="A", cmd="x", proxy="http://127.0.0.1:1", ttl=60)
    RequestLog.objects.bulk_create([log_row("A", 100, 110, 115, wait=10, swap=10),
                                    log_row("A", 700, 710, 715, wait=10, swap=10)])
    ModelEvent.objects.bulk_create([
        event("A", events.LOAD, 100), event("A", events.READY, 110, 10.0),
        event("A", events.IDLE_UNLOAD, 175, 0.1, reason=events.TTL),
        event("A", events.LOAD, 700), event("A", events.READY, 710, 10.0)])
    report = window_reader.report(at(0), at(1000))
    f = report.fidelity
    assert (f.within, f.n, f.recorded_swaps, f.replayed_swaps) == (2, 2, 2, 2)
    assert report.today.idle_unloads == 2
    assert "unloads by ttl" in render(report)


@pytest.mark.django_db
def test_the_command_refuses_what_it_cannot_replay():
    record_trace()
    for args, words in ((["--aging-divisor", "0"], "agingDivisor ≤ 0"),
                        (["--swap-cost", "fast"], "give auto or a number"),
                        (["--affinity-budget", "soon"], "affinityBudget: 'soon' is not"),
                        (["--swap-cost", "0"], "positive number"),
                        (["--swap-cost", "inf"], "positive number"),
                        (["--to", "2026-01-01"], "--to goes with --from"),
                        (["--from", "2026-01-02", "--to", "2026-01-01"], "ends before"),
                        (["--from", "2020-01-01", "--to", "2020-01-02"],
                         r"no request to replay.*try a longer window \(--since 7d\)"),
                        (["--since", "yesterday"], "not a time")):
        with pytest.raises(CommandError, match=words):
            call_command("whatif", *args)


@pytest.mark.django_db
def test_the_command_prints_json(capsys):
    record_trace()
    call_command("whatif", "--since", "3h", "--json", "--model", "B", "--scheduler", "fifo")
    data = json.loads(capsys.readouterr().out)
    assert data["other"]["settings"]["scheduler"] == "fifo"
    assert data["window"]["reported"] == data["today"]["bands"]["all"]["n"] > 0
    assert data["window"]["reported"] < data["window"]["requests"]
