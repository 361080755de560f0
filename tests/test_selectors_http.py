"""Selectors through HTTP: `serve` (at --workers 1 and 2), fake upstreams, PostgreSQL.

A request names a selector; the scheduler picks the target when it dispatches it, and the
activity row says which target served it (`model`) and what was asked (`model_requested`).
"""

from __future__ import annotations

import pytest

from tests.conftest import FAKE, free_port
from tests.helpers import Chat, open_gate, queue_until, until

pytestmark = pytest.mark.django_db(transaction=True)


def config(start: int) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      a:
        cmd: {FAKE}
      b:
        cmd: {FAKE}
    groups:
      duo:
        swap: false
        exclusive: false
        members: [a, b]
    selectors:
      auto:
        strategy: warm
        targets: [a, b]
      pool:
        strategy: spillover
        targets: [a, b]
        settings:
          spillover: 1
    """


def rows_for(proxy, requested: str, count: int) -> list[dict]:
    """The activity rows of requests that asked for `requested`, once `count` are written
    (the writer batches them off the request's path)."""
    def found() -> list[dict]:
        data = proxy.http.get("/api/activity?limit=50").json()["data"]
        rows = [d for d in data if d["model_requested"] == requested]
        return rows if len(rows) >= count else []
    return until(f"{count} activity rows for {requested!r}", found)


def test_warm_selector_is_served_by_the_loaded_target(serve):
    """b is loaded, a (listed first) is not: warm sends the request to b, loads nothing,
    and the row names b as the model that served `auto`."""
    proxy = serve(config(free_port()))
    assert proxy.http.post("/api/models/load/b").status_code == 200
    chat = Chat(proxy.base, "auto")
    r = chat.answered()
    assert r.status_code == 200, r.text
    running = proxy.http.get("/running").json()["running"]
    assert [m["model"] for m in running] == ["b"], running
    [row] = rows_for(proxy, "auto", 1)
    assert (row["model"], row["outcome"]) == ("b", "ok")


def test_spillover_fills_the_first_target_then_starts_the_second(serve):
    """spillover 1: the first request goes to a (nothing loaded: the first cold target) and
    is held there; the second finds a full and starts b. Each row names its target."""
    start = free_port()
    proxy = serve(config(start))
    first = Chat(proxy.base, "pool", gate="hold")
    queue_until(proxy, lambda q: q["in_flight"].get("a") == 1, within=30)
    second = Chat(proxy.base, "pool")
    assert second.answered().status_code == 200
    open_gate(start, "hold")  # a sorts first: the first port
    assert first.answered().status_code == 200
    rows = rows_for(proxy, "pool", 2)
    assert sorted(row["model"] for row in rows) == ["a", "b"]
