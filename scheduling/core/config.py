"""What a scheduler is told about the models and the knobs; rebuilt on every settings change."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.core.swapper import GroupSwapper, Swapper

DEFAULT_CONCURRENCY_LIMIT = 10  # llama-swap's, for an unset concurrencyLimit under fifo


@dataclass(frozen=True)
class ModelConfig:
    # Admitted at once, queued + served, beyond which 429; 0 = not set: fifo applies
    # llama-swap's 10, serial no cap of its own (the queue caps bound it). See ledger.limit_of.
    concurrency_limit: int = 0
    parallel: int = 1  # requests the upstream serves at once (its slots)
    fifo_priority: int = 0  # routing.scheduler.settings.fifo.priority
    # What the running process was started from (its command, env, URL...): when it changes
    # while the model runs, the scheduler restarts it once it is idle.
    revision: str = ""


@dataclass(frozen=True)
class SelectorConfig:
    """`selectors.<id>`: a name whose target the scheduler chooses when it dispatches
    (scheduling/core/selectors.py)."""

    strategy: str  # "warm" | "pin" | "spillover"
    targets: tuple[str, ...]  # resolved, in order: local model ids or `<peer>/<model>`
    spillover: int = 1  # spillover: reserved requests per active target before the next


@dataclass(frozen=True)
class SchedulerConfig:
    models: dict[str, ModelConfig] = field(default_factory=dict)
    swapper: Swapper = field(default_factory=lambda: GroupSwapper([], []))
    scheduler: str = "fifo"  # "fifo" | "serial"
    aging_divisor: float = 60.0  # serial: seconds of waiting per point of score
    swap_affinity_bonus: int = 10  # serial: bonus for the loaded model, 0..99
    # serial: the affinity budget (issue 23; the rule and its bound: scheduling/core/budget.py).
    # Once a waiting request has lost picks only because of affinity for this long, affinity
    # is ignored until it is served. Off by default: the seed's behaviour is unchanged.
    affinity_budget: float = 0.0  # seconds; 0 = off (unless affinity_budget_swaps is set)
    # `auto`: k x the measured swap cost of the waiting request's model; 0 = not auto. When
    # set, it wins over affinity_budget. The docs recommend k = 6.
    affinity_budget_swaps: float = 0.0
    assumed_swap_cost: float = 10.0  # auto: seconds a swap costs before it was ever measured
    # Caps on requests admitted and not yet dispatched; 0 or absent = no cap.
    max_waiting: int = 0
    max_waiting_per_band: dict[str, int] = field(default_factory=dict)
    selectors: dict[str, SelectorConfig] = field(default_factory=dict)
    # Peers' models (`<peer>/<model>`) a selector may bind to: granted at once, never swapped.
    peer_models: frozenset[str] = frozenset()
    # Models (ids and aliases) placed on other nodes of a fleet only -> those nodes: never
    # admitted here; the 404 names them (issue 24).
    elsewhere: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Tell waiting requests their queue position (the loading stream shows it). A replay
    # (scheduling/replay.py) has no client to tell: off, it saves about half its time.
    report_positions: bool = True
