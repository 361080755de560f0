"""llama-swap's `/api/events`: one Server-Sent Events stream of what the proxy does, for its UI
and for scripts (`internal/server/apigroup.go`, `handleAPIEvents`).

Every frame is `event:message` with `data:{"type": T, "data": "<JSON as a string>"}`:

* `modelStatus`: every configured model and its process state (on connect, and whenever a
  state or the catalog changes, only when the list differs from the last one sent);
* `logData`: `{"source": "proxy" | "upstream", "data": text}`: the history on connect, then
  new lines as they come (`upstream` is every model's output);
* `activity`: `{"id": N}` for each new `activity_requestlog` row;
* `profileChanged`: `{"active": name|null}`, the profile whose pins apply (on connect, and
  when a reload brings another one: `PUT /api/profiles/active`, the admin);
* `inflight`: `{"operation": "snapshot", "requests": [...]}` on connect, then `upsert` (a
  request granted, or its byte count moved) and `remove` (it ended).

One `Bus` per process feeds every stream that process answers, and runs only while one is
open: N clients cost one log feed, one poll of the table and one poll of the requests, not N.
Why polls, under `serve --workers N`: the stream is answered by one request process, while
the activity rows are written by every process's writer thread and the requests run in
every request process. The table is the one place all rows meet, so new ids are read from it
every `ACTIVITY_POLL` seconds (looking back `ACTIVITY_LOOKBACK` ids, because two writers'
transactions can commit out of id order); the requests in flight come from
`ProxyPort.requests_view` (every process's) every `INFLIGHT_POLL` seconds, llama-swap's own
byte-count throttle, and at once on a change in this process. Model states and logs are
already pushed to every process (the hub's mirror, `log_feed`), so they are not polled.

A client never slows the proxy: the bus offers each frame to each client's bounded queue
and drops it there when full (as llama-swap's send buffer does), so a stream that is not read
costs its own queue and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from activity.models import RequestLog
from gpuproxy.api.profiles import active_in
from gpuproxy.observe import inflight, published
from gpuproxy.proxy.model_list import render_capabilities
from gpuproxy.shell import runtime
from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.logbuffer import PROXY
from gpuproxy.upstream.states import State

logger = logging.getLogger("gpuproxy.api.events")

CLIENT_QUEUE = 1024  # frames waiting for one client (llama-swap's send buffer)
ACTIVITY_POLL = 1.0  # seconds between reads of new activity ids
ACTIVITY_LOOKBACK = 256  # ids below the highest seen that may still commit
INFLIGHT_POLL = 0.25  # seconds between reads of the requests in flight (llama-swap's 250 ms)
CATALOG_CHECK = 1.0  # seconds between checks that the upstream log covers every model

# The fields of llama-swap's `InflightRequestEntry`: the dashboard's extra ones stay out.
INFLIGHT_FIELDS = ("id", "timestamp", "model", "req_path", "method", "req_headers",
                   "remote_ip", "resp_headers", "resp_bytes", "elapsed_ms")


def frame(kind: str, data: Any) -> bytes:
    """One SSE frame, byte for byte as llama-swap writes it."""
    envelope = {"type": kind, "data": json.dumps(data, separators=(",", ":"))}
    return b"event:message\ndata:" + json.dumps(envelope, separators=(",", ":")).encode() + \
        b"\n\n"


def model_status(rt: ProxyPort) -> list[dict[str, Any]]:
    """llama-swap's `apiModel` list, sorted by id (peers: none, gpuproxy has no peers); the
    optional fields only where they say something, as Go's `omitempty`."""
    models = []
    for model_id, meta in sorted(rt.catalog.models.items()):
        proc = rt.upstream(model_id)
        entry: dict[str, Any] = {
            "id": model_id, "name": meta.name, "description": meta.description,
            "state": (proc.state if proc is not None else State.STOPPED).value,
            "unlisted": meta.unlisted, "peerID": ""}
        if meta.aliases:
            entry["aliases"] = list(meta.aliases)
        rendered = render_capabilities(meta.capabilities)  # as /v1/models renders them
        for key in ("capabilities", "context_length"):
            if rendered.get(key):
                entry[key] = rendered[key]
        models.append(entry)
    return models


def inflight_entry(view: dict[str, Any]) -> dict[str, Any]:
    """One request of `requests_view()["in_flight"]` as llama-swap's entry."""
    entry = {k: view[k] for k in INFLIGHT_FIELDS if k in view}
    entry["metadata"] = {"priority": str(view.get("priority", 0)),
                         "band": str(view.get("band", ""))}
    return entry


def profile_data(rt: ProxyPort) -> dict[str, Any]:
    return {"active": active_in(rt.catalog)}


def snapshot_data(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-swap omits an empty `requests` list (Go's `omitempty`)."""
    return {"operation": "snapshot", **({"requests": entries} if entries else {})}


class Client:
    """One open stream: a bounded queue of frames (dropped, never waited for, when full)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(CLIENT_QUEUE)
        self.dropped = 0

    def offer(self, data: bytes) -> None:
        try:
            self.queue.put_nowait(data)
        except asyncio.QueueFull:
            if not self.dropped:
                logger.warning("/api/events: a client does not keep up; frames are dropped")
            self.dropped += 1


class Bus:
    """The feeds of every stream this process answers; running while one is open."""

    def __init__(self) -> None:
        self.clients: set[Client] = set()
        self._task: asyncio.Task[None] | None = None
        self._models: list[dict[str, Any]] | None = None
        self._profile: dict[str, Any] | None = None
        self._inflight: dict[str, dict[str, Any]] = {}
        self._states_changed = asyncio.Event()  # a model's state or the catalog changed
        self._requests_changed = asyncio.Event()  # a request here started or ended
        self._listening = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def broadcast(self, kind: str, data: Any) -> None:
        payload = frame(kind, data)
        for client in list(self.clients):
            client.offer(payload)

    def join(self, client: Client, rt: ProxyPort) -> None:
        self.clients.add(client)
        if not self._listening:  # module-level callbacks are for good: add them once
            self._listening = True
            published.on_change(lambda: self._states_changed.set())
            inflight.on_change(lambda: self._requests_changed.set())
        if self._task is None or self._task.done():
            # made on the loop that runs the bus (an Event belongs to the first loop it waits on)
            self._states_changed, self._requests_changed = asyncio.Event(), asyncio.Event()
            self._models = model_status(rt)  # what the new client is about to get
            self._profile = profile_data(rt)
            self._task = asyncio.get_running_loop().create_task(self._run(rt),
                                                                name="api-events")

    async def leave(self, client: Client) -> None:
        self.clients.discard(client)
        if not self.clients and self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._inflight = {}

    async def _run(self, rt: ProxyPort) -> None:
        pumps: list[Callable[[ProxyPort], Coroutine[Any, Any, None]]] = [
            self._proxy_log, self._upstream_log, self._model_states, self._activity,
            self._requests]
        tasks = [asyncio.ensure_future(pump(rt)) for pump in pumps]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _forward(self, queue: asyncio.Queue[str], source: str) -> None:
        """What a feed holds now, in one frame, each time it has something."""
        lines = [await queue.get()]
        while not queue.empty():
            lines.append(queue.get_nowait())
        self.broadcast("logData", {"source": source, "data": "\n".join(lines) + "\n"})

    async def _proxy_log(self, rt: ProxyPort) -> None:
        async with rt.log_feed([PROXY], history=False) as (_, queue):
            while True:
                await self._forward(queue, "proxy")

    async def _upstream_log(self, rt: ProxyPort) -> None:
        """Every model's output; the feed opens again when the models defined change."""
        while True:
            models = sorted(rt.catalog.models)
            async with rt.log_feed(models, history=False) as (_, queue):
                while sorted(rt.catalog.models) == models:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(CATALOG_CHECK):
                            await self._forward(queue, "upstream")

    async def _model_states(self, rt: ProxyPort) -> None:
        while True:
            await self._states_changed.wait()
            self._states_changed.clear()
            now = model_status(rt)
            if now != self._models:
                self._models = now
                self.broadcast("modelStatus", now)
            profile = profile_data(rt)  # a new catalog wakes this loop too
            if profile != self._profile:
                self._profile = profile
                self.broadcast("profileChanged", profile)

    async def _requests(self, rt: ProxyPort) -> None:
        """Every `INFLIGHT_POLL` seconds (other processes' requests, byte counts), and at
        once when one of this process's requests starts or ends."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(INFLIGHT_POLL):
                    await self._requests_changed.wait()
            self._requests_changed.clear()
            await self._requests_once(rt)

    async def _requests_once(self, rt: ProxyPort) -> None:
        """Upserts for new requests and moved byte counts, removes for ended ones."""
        try:
            views = (await rt.requests_view())["in_flight"]
        except Exception as exc:  # the scheduler process may be gone a moment: next poll
            logger.debug("/api/events: no in-flight list (%s)", exc)
            return
        self._diff(views)

    def _diff(self, views: list[dict[str, Any]]) -> None:
        now = {v["id"]: inflight_entry(v) for v in views}
        for rid, entry in now.items():
            known = self._inflight.get(rid)
            if known is None or known["resp_bytes"] != entry["resp_bytes"]:
                self.broadcast("inflight", {"operation": "upsert", "request": entry})
        for rid in self._inflight.keys() - now.keys():
            self.broadcast("inflight", {"operation": "remove", "id": rid})
        self._inflight = now

    async def _activity(self, rt: ProxyPort) -> None:
        ids = NewIds()
        while True:
            try:
                read = await runtime.run_db(functools.partial(_ids_above, ids.floor,
                                                              ids.first))
                for row_id in ids.news(read):
                    self.broadcast("activity", {"id": row_id})
            except Exception as exc:  # the database is away: the rows wait for its return
                logger.debug("/api/events: no activity ids (%s)", exc)
            await asyncio.sleep(ACTIVITY_POLL)


class NewIds:
    """Which activity ids are news. Ids are handed out when a row is inserted but seen when
    its transaction commits, and two writers (two processes) can commit out of id order: so
    each read starts `ACTIVITY_LOOKBACK` ids below the highest seen, and the ids seen there
    are remembered, not told twice."""

    def __init__(self) -> None:
        self.first = True  # the first read only says where the table stands: no news
        self.top = 0  # the highest id seen
        self.seen: set[int] = set()  # those above `floor`

    @property
    def floor(self) -> int:
        return self.top - ACTIVITY_LOOKBACK

    def news(self, read: list[int]) -> list[int]:
        """The ids of `read` (ids above `floor`, in order) not seen before."""
        fresh = [] if self.first else [i for i in read if i not in self.seen]
        self.first = False
        self.seen.update(read)
        self.top = max([self.top, *read])
        self.seen = {i for i in self.seen if i > self.floor}
        return fresh


def _ids_above(floor: int, first: bool) -> list[int]:
    """The activity ids above `floor`, in order (the first read of a big table jumps to its
    last `ACTIVITY_LOOKBACK` ids by the index instead of reading them all)."""
    if first:
        last = RequestLog.objects.order_by("-id").values_list("id", flat=True).first()
        floor = max(0, (last or 0) - ACTIVITY_LOOKBACK)
    return list(RequestLog.objects.filter(id__gt=floor).order_by("id")
                .values_list("id", flat=True))


BUS = Bus()


async def stream(rt: ProxyPort) -> AsyncIterator[bytes]:
    """One client's frames: the initial payload (llama-swap's order: proxy log, upstream log,
    models, the active profile, in-flight snapshot), then what the bus offers, until the
    client leaves (Django closes this generator)."""
    client = Client()
    BUS.join(client, rt)  # first, so nothing between the payload and the feed is lost
    try:
        async with rt.log_feed([PROXY], history=True) as (past, _):
            proxy_history = past
        async with rt.log_feed(sorted(rt.catalog.models), history=True) as (past, _):
            upstream_history = past
        views = (await rt.requests_view())["in_flight"]
        yield b"".join([
            frame("logData", {"source": "proxy", "data": _text(proxy_history)}),
            frame("logData", {"source": "upstream", "data": _text(upstream_history)}),
            frame("modelStatus", model_status(rt)),
            frame("profileChanged", profile_data(rt)),
            frame("inflight", snapshot_data([inflight_entry(v) for v in views])),
        ])
        while True:
            data = [await client.queue.get()]
            while not client.queue.empty():
                data.append(client.queue.get_nowait())
            yield b"".join(data)
    finally:
        await BUS.leave(client)


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)
