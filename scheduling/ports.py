"""`${PORT}`: the one rule that hands out port numbers to models whose command asks for one.

Two callers keep to it: the llama-swap import (scheduling/llamaswap/model_entries.py, for
models whose `cmd` uses `${PORT}`) and the catalog (scheduling/catalog_db.py, for models added
in admin whose command or proxy still says `${PORT}`). The rule is llama-swap's: one port each,
in sorted model-id order, counting up from the start port. Pure: no Django, no I/O.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

MAX_PORT = 65535


class NoPortLeft(Exception):
    """The range ran out: `model_id`, the first in sorted order that found no port, gets none."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"no port left for {model_id!r}")
        self.model_id = model_id


def allocate_ports(model_ids: Iterable[str], start: int, *, taken: Container[int] = (),
                   last: int | None = None) -> dict[str, int]:
    """A port for each of `model_ids`, in sorted id order: the lowest number from `start` up
    that is neither in `taken` (ports other models already have) nor handed out before.

    With `last`, the first model whose port would pass it raises NoPortLeft; without, the
    numbers keep counting.
    """
    ports: dict[str, int] = {}
    candidate = start
    for model_id in sorted(set(model_ids)):
        while candidate in taken:
            candidate += 1
        if last is not None and candidate > last:
            raise NoPortLeft(model_id)
        ports[model_id] = candidate
        candidate += 1
    return ports
