"""The live dashboard's data: one JSON state, rebuilt on the event loop when something changed.

`/` renders the page (dashboard/templates/dashboard/dashboard.html, with
static/dashboard/dashboard.js); the page opens
the WebSocket `/ws/dashboard`, served by `DashboardConsumer`. The consumer wakes when the run
loop publishes (after every scheduler event), when a process changes state or when a request
starts or ends, and sends a fresh `state()` at most `MAX_RATE` times a second: a burst of
events costs one message, and nothing is polled.

The state is built on the event loop, where the scheduler lives, so it reads the scheduler
directly (as `/api/queue` does); building it is O(queued), which is why a band lists at most
`WAITING_SHOWN` requests (its depth is always exact).

Messages, server → page:
  {"type": "state", "state": STATE}
  {"type": "log", "source": NAME, "lines": [...]}        (after a "logs" action)
  {"type": "result", "action": A, "target": T, "ok": bool, "message": "..."}
Page → server:
  {"action": "load" | "unload" | "restart", "model": ID}
  {"action": "unload_all"}                               (every model, as /api/models/unload)
  {"action": "cancel", "request_id": ID}
  {"action": "logs", "source": MODEL | "proxy" | null}   (null stops the tail)
  {"action": "profile", "name": PROFILE | null}          (the active profile; null for none)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any
from urllib.parse import quote, urlsplit

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import InterfaceError, OperationalError

from gpuproxy.observe import inflight, published
from gpuproxy.proxy.model_list import render_capabilities
from gpuproxy.shell import runtime
from gpuproxy.shell.port import ProxyPort
from gpuproxy.upstream.logbuffer import PROXY
from gpuproxy.upstream.states import State
from scheduling.catalog import Catalog, url_host
from scheduling.core.effects import Scheduler
from scheduling.core.errors import SchedulingError
from scheduling.core.events import Request
from scheduling.core.priority import BANDS, band
from scheduling.models import ProxySettings

logger = logging.getLogger("dashboard.consumer")

MAX_RATE = 4.0  # states per second, at most
IDLE_REFRESH = 5.0  # seconds between states when nothing happens (clocks and charts move)
BUSY_REFRESH = 1.0  # ... while requests are in flight (elapsed time and bytes move)
WAITING_SHOWN = 100  # requests listed per band
LOG_HISTORY = 200  # lines of history sent when a log tail starts
#: How long a profile switch waits for the catalog in force to show it, and how often it
#: looks (as `PUT /api/profiles/active`: a reload is a few reads; this bounds a failing one).
PROFILE_APPLY_WITHIN = 10.0
PROFILE_APPLY_POLL = 0.005


def _books(s: Scheduler, now: float) -> dict[str, Any]:
    """The scheduler's side of the page, read by the run loop itself (`ProxyPort.inspect`)
    between two events: who waits where, with which score, and what is in flight."""
    cfg = s.config
    score_of = getattr(s, "score", None)

    def score(r: Request) -> float:
        if score_of is not None:
            return round(score_of(r, now), 2)
        mc = cfg.models.get(r.model)  # fifo: the model's fifo priority plus the header
        return float((mc.fifo_priority if mc else 0) + r.priority)

    bands: dict[str, dict[str, Any]] = {
        b: {"band": b, "depth": n, "oldest_wait_s": 0.0 if oldest is None
            else round(now - oldest, 3), "waiting": []}
        for b, (n, oldest) in s.waiting_by_band().items()}

    def add(r: Request, position: int | None) -> None:
        listed = bands[band(r.priority)]["waiting"]
        if len(listed) < WAITING_SHOWN:
            listed.append({"seq": r.seq, "model": r.model, "priority": r.priority,
                           "score": score(r), "position": position,
                           "waited_s": round(now - r.arrived, 3),
                           "loading": position is None})

    for position, r in enumerate(s.queued(), start=1):
        add(r, position)
    for waiters in s.active_swaps().values():
        for r in waiters:
            add(r, None)
    return {
        "bands": [bands[b] for b in BANDS],
        "picks": _picks(s),
        "in_flight": {m: s.in_flight(m) for m in cfg.models},
        "restart_pending": s.restart_pending(),
        "scheduler": {"kind": cfg.scheduler, "aging_divisor": cfg.aging_divisor,
                      "swap_affinity_bonus": cfg.swap_affinity_bonus},
    }


def _picks(s: Scheduler) -> dict[str, str | None]:
    """The target each selector would get now: the scheduler's own pick from its books (the
    one a dispatch at this moment makes), so the page never guesses the strategy again."""
    return {selector_id: s.selector_pick(selector_id) for selector_id in s.config.selectors}


def routing(catalog: Catalog, picks: dict[str, str | None]) -> dict[str, Any]:
    """The routing in force, from the catalog the proxy runs with: the router (and the
    matrix's sets), peers (id, host, models, how the priority travels; never the apiKey),
    selectors (with the target each would get now) and the active profile with its pins."""
    profile = catalog.profiles.get(catalog.active_profile)
    return {
        "router": catalog.router,
        "matrix_sets": [{"name": n, "dsl": d} for n, d in catalog.matrix_sets],
        "peers": [{"id": p.peer_id, "host": url_host(p.proxy), "models": list(p.models),
                   "priority_forward": p.priority_forward}
                  for p in sorted(catalog.peers.values(), key=lambda p: p.peer_id)],
        "selectors": [{"id": sel.selector_id, "strategy": sel.strategy,
                       "targets": list(sel.targets), "spillover": sel.spillover,
                       "name": sel.name, "unlisted": sel.unlisted,
                       "pick": picks.get(sel.selector_id)}
                      for sel in sorted(catalog.selectors.values(),
                                        key=lambda sel: sel.selector_id)],
        "active_profile": None if not catalog.active_profile else {
            "name": catalog.active_profile, "defined": profile is not None,
            "description": profile.description if profile else "",
            "pins": dict(profile.pins) if profile else {}},
        "profiles": sorted(catalog.profiles),
    }


# llama-swap's capability flags (gpuproxy/proxy/model_list.py) as the page's tags
CAPABILITY_TAGS = (("vision", "vision"), ("function_calling", "tools"),
                   ("reranker", "reranker"), ("audio_transcriptions", "transcription"),
                   ("audio_speech", "speech"), ("image_generation", "image generation"),
                   ("image_to_image", "image to image"))


def capability_tags(capabilities: dict[str, Any]) -> list[str]:
    """What the model's `capabilities` say it can do, as `/v1/models` renders them (the same
    flags, the same context length): nothing is guessed from its name or command."""
    rendered = render_capabilities(capabilities)
    flags = rendered.get("capabilities", {})
    tags = [tag for flag, tag in CAPABILITY_TAGS if flags.get(flag)]
    context = rendered.get("context_length")
    if context:
        tags.append(f"{context // 1024}k context" if context % 1024 == 0
                    else f"{context:,} context")
    return tags


async def state(rt: ProxyPort) -> dict[str, Any]:
    """Everything the page shows: the books from the run loop, the rest from published data."""
    books = await rt.inspect(_books)
    models = []
    for model_id, meta in sorted(rt.catalog.models.items()):
        proc = rt.upstream(model_id)
        models.append({
            "id": model_id,
            "name": meta.name,
            "state": (proc.state if proc is not None else State.STOPPED).value,
            "pid": proc.pid if proc is not None else None,
            "in_flight": books["in_flight"].get(model_id, 0),
            "restart_needed": model_id in books["restart_pending"],
            "aliases": list(meta.aliases),
            "capabilities": capability_tags(meta.capabilities),
            # the model's own server (llama-server's web UI) through the proxy
            "upstream": f"/upstream/{quote(model_id)}/",
        })
    requests = await rt.requests_view()
    return {
        "time": time.time(),
        "scheduler": books["scheduler"],
        "routing": routing(rt.catalog, books["picks"]),
        "models": models,
        "bands": books["bands"],
        "in_flight": requests["in_flight"],
        "recent": requests["recent"],
        "history": requests["history"],
    }


async def _profile_in_force(rt: ProxyPort, name: str, version: int) -> bool:
    """`runtime.profile_in_force`, as PUT /api/profiles/active waits, within
    PROFILE_APPLY_WITHIN seconds."""
    return await runtime.profile_in_force(rt, name, version, within=PROFILE_APPLY_WITHIN,
                                          poll=PROFILE_APPLY_POLL)


def _same_origin(scope: dict[str, Any]) -> bool:
    """A browser sends `Origin` with every WebSocket: it must be this very host, so a page
    on another site cannot drive the dashboard with a staff member's session cookie (the
    WebSocket counterpart of CSRF). ALLOWED_HOSTS may be `*`, so that check is not enough."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin")
    if origin is None:  # not a browser; it still needs a staff session
        return True
    return urlsplit(origin.decode("latin-1")).netloc == headers.get(b"host", b"").decode(
        "latin-1")


class _Changes:
    """Wakes every connected dashboard; set on the event loop only."""

    def __init__(self) -> None:
        self.events: set[asyncio.Event] = set()

    def notify(self) -> None:
        for event in self.events:
            event.set()


CHANGES = _Changes()
published.on_change(CHANGES.notify)
inflight.on_change(CHANGES.notify)


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/dashboard`: staff only (the Django session, through AuthMiddlewareStack)."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if (user is None or not user.is_authenticated or not user.is_staff
                or not _same_origin(self.scope)):
            await self.close(code=4403)
            return
        self._wake = asyncio.Event()
        self._wake.set()  # the first state goes out at once
        CHANGES.events.add(self._wake)
        self._log_task: asyncio.Task | None = None
        await self.accept()
        self._watch = await runtime.port()
        self._watch.watch_changes(True)
        self._sender = asyncio.get_running_loop().create_task(self._send_states())

    async def disconnect(self, code: int) -> None:
        wake = getattr(self, "_wake", None)
        if wake is not None:
            CHANGES.events.discard(wake)
        watched = getattr(self, "_watch", None)
        if watched is not None:
            watched.watch_changes(False)
        for task in (getattr(self, "_sender", None), getattr(self, "_log_task", None)):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _send_states(self) -> None:
        rt = await runtime.port()
        busy = False  # requests were in flight at the last state (any process's)
        while True:
            refresh = BUSY_REFRESH if busy else IDLE_REFRESH
            with contextlib.suppress(TimeoutError):  # not wait_for: see runtime._watch
                async with asyncio.timeout(refresh):
                    await self._wake.wait()
            self._wake.clear()
            try:
                now = await state(rt)
                busy = bool(now["in_flight"])
                await self.send_json({"type": "state", "state": now})
            except Exception:
                logger.exception("dashboard: could not send the state")
                raise
            await asyncio.sleep(1 / MAX_RATE)  # a burst of events costs one message

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict):
            return
        action = content.get("action")
        rt = await runtime.port()
        if action in ("load", "unload", "restart"):
            model = rt.catalog.resolve(str(content.get("model", "")))
            if model is None:
                await self._result(action, content.get("model"), False, "no such model")
                return
            asyncio.get_running_loop().create_task(self._model_action(rt, action, model))
        elif action == "unload_all":
            asyncio.get_running_loop().create_task(self._unload_all(rt))
        elif action == "cancel":
            request_id = str(content.get("request_id", ""))
            ok = await rt.cancel_request(request_id)
            await self._result("cancel", request_id, ok,
                               "cancelled" if ok else "it is no longer in flight")
        elif action == "logs":
            await self._tail(content.get("source"))
        elif action == "profile":
            asyncio.get_running_loop().create_task(self._profile(rt, content.get("name")))

    async def _model_action(self, rt: ProxyPort, action: str, model: str) -> None:
        try:
            if action == "load":
                await rt.load(model)
                message = f"{model} is ready"
            elif action == "unload":
                await rt.unload([model])
                message = f"{model} is stopped"
            else:
                rt.restart([model])
                message = f"{model} restarts when idle"
            await self._result(action, model, True, message)
        except SchedulingError as exc:
            await self._result(action, model, False, exc.message)

    async def _unload_all(self, rt: ProxyPort) -> None:
        try:
            await rt.unload_all()
        except SchedulingError as exc:
            await self._result("unload_all", None, False, exc.message)
        else:
            await self._result("unload_all", None, True, "every model is stopped")

    async def _profile(self, rt: ProxyPort, name: Any) -> None:
        """The active profile, through its one writer (`ProxySettings.set_active_profile`, as
        `PUT /api/profiles/active` and the admin); answered once the catalog this process
        routes by shows it, so the page's next state already has the new pins."""
        if name is not None and not isinstance(name, str):
            await self._result("profile", None, False, "a profile name is a string, or null "
                                                       "for none")
            return
        name = name or ""
        target = name or None
        if any(ord(c) < 32 or ord(c) == 127 for c in name):  # no profile has one
            await self._result("profile", target, False,
                               f"no profile {name!r} (the admin's Profiles page lists them)")
            return
        try:
            found, before, version = await runtime.run_db(
                lambda: ProxySettings.set_active_profile(name))
        except (OperationalError, InterfaceError) as exc:
            detail = (str(exc) if isinstance(exc, runtime.DatabaseUnavailable)
                      else f"database error ({type(exc).__name__})")
            await self._result("profile", target, False,
                               f"the active profile cannot be changed: {detail}; retry later")
            return
        if not found:
            await self._result("profile", target, False,
                               f"no profile {name!r} (the admin's Profiles page lists them)")
            return
        if before != name:
            user = self.scope["user"].get_username()
            logger.info("active profile changed from %r to %r (dashboard, %s)",
                        before, name, user)
        said = f"profile {name} is active" if name else "no profile is active"
        if not await _profile_in_force(rt, name, version):
            await self._result("profile", target, False,
                               f"saved, but the running proxy did not reload its definitions "
                               f"within {PROFILE_APPLY_WITHIN:g} s (is the database "
                               f"reachable? /health says); {said} at the next reload")
            return
        CHANGES.notify()  # every open dashboard shows the new pins now, not at its refresh
        await self._result("profile", target, True, said)

    async def _result(self, action: str, target: Any, ok: bool, message: str) -> None:
        with contextlib.suppress(Exception):  # the page may have gone meanwhile
            await self.send_json({"type": "result", "action": action, "target": target,
                                  "ok": ok, "message": message})

    async def _tail(self, source: Any) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._log_task
            self._log_task = None
        if source is None:
            return
        rt = await runtime.port()
        name = PROXY if source == "proxy" else rt.catalog.resolve(str(source))
        if name is None:
            await self._result("logs", source, False, "no such model")
            return
        self._log_task = asyncio.get_running_loop().create_task(self._pump_log(name))

    async def _pump_log(self, name: str) -> None:
        rt = await runtime.port()
        async with rt.log_feed([name], history=True) as (past, queue):
            await self.send_json({"type": "log", "source": name,
                                  "lines": past[-LOG_HISTORY:], "reset": True})
            while True:
                lines = [await queue.get()]
                await asyncio.sleep(1 / MAX_RATE)  # batch what arrives meanwhile
                while not queue.empty():
                    lines.append(queue.get_nowait())
                await self.send_json({"type": "log", "source": name, "lines": lines})
