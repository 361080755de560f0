"""Choosing the scheduling policy, and switching it live without losing a request.

The shell calls `make_scheduler(config, fx)` at start, and `make_scheduler(config, fx,
previous)` when a SettingsChanged changes `config.scheduler` ("serial" <-> "fifo"). Then it
stops sending events to `previous` and sends them to the returned scheduler, starting with
the SettingsChanged itself (harmless: the new scheduler has already applied it). For any other
settings change `previous.on_settings_changed` is all it needs.
"""

from __future__ import annotations

from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import Effects, Scheduler
from scheduling.core.events import SettingsChanged
from scheduling.core.fifo import Fifo
from scheduling.core.serial import Serial

POLICIES: dict[str, type[Fifo] | type[Serial]] = {"serial": Serial, "fifo": Fifo}


def make_scheduler(config: SchedulerConfig, fx: Effects, previous: Scheduler | None = None
                   ) -> Scheduler:
    """The scheduler `config.scheduler` names ("serial" or "fifo"; anything else raises
    ValueError, since the config importer only produces these two).

    - `previous` None: a fresh scheduler.
    - `previous` already of that policy: `previous` itself, given `on_settings_changed(config)`
      if its config is another object (`fx` is then unused: it keeps its own).
    - `previous` of the other policy: `previous.export_state()` (which leaves `previous`
      empty and refusing) adopted by the new class's `from_state(state, config, fx)`: the
      queue, active swaps with their waiters and evict sets, in-flight requests and counts,
      admission slots, pending unloads, the shutdown flag and the counters carry over; then
      `on_settings_changed` semantics apply (404 for undefined models, re-rank, drain).
    """
    cls = POLICIES.get(config.scheduler)
    if cls is None:
        raise ValueError(f"unknown scheduler {config.scheduler!r}; expected one of "
                         f"{', '.join(sorted(POLICIES))}")
    if previous is None:
        return cls(config, fx)
    if type(previous) is cls:
        if previous.config is not config:
            previous.on_settings_changed(SettingsChanged(config, previous.now))
        return previous
    export = getattr(previous, "export_state", None)
    if export is None:
        raise TypeError(f"{type(previous).__name__} cannot hand its state over")
    return cls.from_state(export(), config, fx)
