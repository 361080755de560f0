"""The one task that owns the scheduler: events in, effects out (llama-swap's `baseRouter.run`).

Consumers, views, swap tasks and admin saves never touch scheduler state; they post events to
one queue. `RunLoop.run()` takes them one at a time and calls the scheduler, whose decisions
come back through the `Effects` methods below. Slow work (swaps, stops) runs in tasks of its
own and reports back as events, so the loop never awaits anything but its queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from activity import events as mev
from gpuproxy.observe import metrics, published
from gpuproxy.shell.upstreams import Upstreams
from gpuproxy.upstream.processes import StartFailed, State, UpstreamProcess
from scheduling.core import effects as fx
from scheduling.core.config import SchedulerConfig
from scheduling.core.effects import Scheduler
from scheduling.core.errors import QueueTimeout, SchedulingError, ShuttingDown
from scheduling.core.events import (
    Cancelled,
    Dispatch,
    Event,
    ModelExited,
    Request,
    RequestArrived,
    RestartRequested,
    ServeDone,
    SettingsChanged,
    Shutdown,
    SwapDone,
    UnloadDone,
    UnloadRequested,
)

logger = logging.getLogger("gpuproxy.shell.run_loop")
T = TypeVar("T")

SchedulerFactory = Callable[[SchedulerConfig, "RunLoop", Scheduler | None], Scheduler]

_STATE = {
    State.STOPPED: fx.STOPPED,
    State.STARTING: fx.STARTING,
    State.READY: fx.READY,
    State.STOPPING: fx.STOPPING,
    State.FAILED: fx.FAILED,
}


@dataclass(eq=False)
class Waiting:
    """The shell's side of one request: the future its consumer awaits, and its position."""

    future: asyncio.Future[str]
    position: int = 0  # 1-based place in the queue; 0 while waiting on a model load
    position_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the scheduler has admitted the request and made it wait (queued, or behind a
    # load): a rejection can no longer come, so a stream may start telling the client.
    waits: asyncio.Event = field(default_factory=asyncio.Event)
    model: str = ""
    swap_wait: float | None = None  # seconds this request waited for a model load
    request_id: str = ""  # its activity row's: a load it causes names it (model events)


@dataclass(eq=False)
class _Inspect(Generic[T]):
    """A read of the scheduler posted to the run loop (`RunLoop.inspect`): not an event,
    the scheduler never sees it, and nothing is published after it."""

    read: Callable[[Scheduler, float], T]
    answer: asyncio.Future[T]

    def run(self, loop: RunLoop) -> None:
        if self.answer.done():  # the asker left
            return
        try:
            self.answer.set_result(self.read(loop.scheduler, loop.now()))
        except Exception as exc:
            self.answer.set_exception(exc)


class Grant:
    """A request allowed to reach its upstream; `release()` exactly once when done."""

    __slots__ = ("_loop", "_released", "model", "req", "swap_wait")

    def __init__(self, loop: RunLoop, req: Request, model: str) -> None:
        self._loop = loop
        self.req = req
        self.model = model
        self._released = False
        self.swap_wait: float | None = req.handle.swap_wait

    @property
    def dispatch(self) -> Dispatch | None:
        return self.req.dispatch

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._loop.post(ServeDone(self.req, self._loop.now()))


class RunLoop:
    """Owns the scheduler; implements its Effects with the upstream processes."""

    def __init__(self, upstreams: Upstreams, config: SchedulerConfig,
                 make_scheduler: SchedulerFactory) -> None:
        self.upstreams = upstreams
        upstreams.on_exit = self._process_exited
        self._events: asyncio.Queue[Event | _Inspect[Any]] = asyncio.Queue()
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._make_scheduler = make_scheduler
        self._swap_times: dict[str, tuple[float, float]] = {}  # model -> last load (start, end)
        self._unloads: dict[str, int] = {}  # model -> unloads decided so far (see `_swap`)
        self._restarts_asked: set[str] = set()  # restarts an operator asked (the others: config)
        self._swaps: dict[str, asyncio.Task[None]] = {}  # model -> its load in progress
        self.scheduler = make_scheduler(config, self, None)
        # Test hook: when set, every processed event is put here after its handler ran.
        self.processed: asyncio.Queue[Event] | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="run-loop")

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def post(self, event: Event) -> None:
        self._events.put_nowait(event)

    async def run(self) -> None:
        while True:
            event = await self._events.get()
            if isinstance(event, _Inspect):
                event.run(self)
                continue
            try:
                self._dispatch(event)
            except Exception:
                # A scheduler bug must not wedge every other request: log it loudly and go on.
                logger.exception("scheduler failed on %r", event)
            # Published once the loop has caught up, not after each of a burst of events
            # (at 32 requests in flight, most events find others queued behind them): a
            # reader sees the books as they stand whenever the loop is idle. With the test
            # hook, after every event, as a test reads the snapshot after each.
            if self.processed is not None or self._events.empty() or isinstance(
                    event, Shutdown):
                try:
                    self._publish()
                except Exception:
                    logger.exception("publishing the scheduler snapshot failed after %r", event)
            if self.processed is not None:
                self.processed.put_nowait(event)
            if isinstance(event, Shutdown):
                return

    def _dispatch(self, event: Event) -> None:
        s = self.scheduler
        match event:
            case RequestArrived():
                s.on_request(event)
                waiting: Waiting = event.req.handle
                if isinstance(waiting, Waiting) and not waiting.future.done():
                    waiting.waits.set()
            case Cancelled():
                s.on_cancel(event)
            case SwapDone():
                s.on_swap_done(event)
            case ServeDone():
                try:
                    s.on_serve_done(event)
                finally:  # even past a scheduler bug: the process must not stay busy forever
                    self._maybe_idle(event.req)
            case UnloadRequested():
                s.on_unload(event)
            case UnloadDone():
                s.on_unload_done(event)
            case RestartRequested():
                s.on_restart(event)
            case ModelExited():
                s.on_model_exited(event)
            case SettingsChanged():
                if event.config.scheduler != s.config.scheduler:
                    # A policy switch (fifo <-> serial) hands the queue, swaps and in-flight
                    # books to the new scheduler; nothing waiting is lost.
                    logger.info("scheduler changed from %s to %s", s.config.scheduler,
                                event.config.scheduler)
                    s = self.scheduler = self._make_scheduler(event.config, self, s)
                s.on_settings_changed(event)
            case Shutdown():
                s.on_shutdown(event)

    def _publish(self) -> None:
        """Hand the metrics a fresh, immutable view of the books (O(bands + models)); the
        scrape thread reads only this, never the scheduler."""
        s = self.scheduler
        published.publish_scheduler(published.SchedulerSnapshot(
            waiting=s.waiting_by_band(),
            stats=s.stats(),
            in_flight={m: n for m in s.config.models if (n := s.in_flight(m))},
            clock_offset=time.monotonic() - self.now(),
            scheduler=s.config.scheduler,
            restart_pending=s.restart_pending(),
        ))

    async def shutdown(self) -> None:
        """Answer every waiter, then stop every upstream."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None and not self._task.done():
            self.post(Shutdown(self.now()))
            await self._task
        while not self._events.empty():  # reads posted just before the end: answer them
            if isinstance(left := self._events.get_nowait(), _Inspect):
                left.run(self)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the API for consumers and views --------------------------------------------------

    async def acquire(self, model: str, priority: int = 0,
                      deadline: float | None = None,
                      watch: Callable[[Waiting], None] | None = None, *,
                      age: float = 0.0, request_id: str = "") -> Grant:
        """Wait until the scheduler grants `model` (an id or an unknown name) to this caller.

        Raises the SchedulingError the scheduler chose, or QueueTimeout after `deadline`
        seconds of waiting (the request is withdrawn like a client that left).
        Cancellation-safe: a caller that is cancelled while waiting is withdrawn, and a grant
        that raced the cancel is released.

        `age`: seconds the request had already waited before it reached this node (a trusted
        peer's `X-LlamaSwap-Arrived`): it enters the queue that much older, so its aging does
        not restart at each hop (docs/scheduling.md, "Priority across peers").
        """
        if deadline:
            try:
                async with asyncio.timeout(deadline):
                    return await self.acquire(model, priority, watch=watch, age=age,
                                              request_id=request_id)
            except TimeoutError:
                raise QueueTimeout(model, deadline) from None
        if self._closed:  # the loop takes no more events: waiting would be forever
            raise ShuttingDown()
        loop = asyncio.get_running_loop()
        waiting = Waiting(loop.create_future(), model=model, request_id=request_id)
        if watch is not None:
            watch(waiting)  # e.g. a stream that reports the wait to its client
        now = loop.time()
        req = Request(next(self._seq), model, now - age, priority, waiting)
        self.post(RequestArrived(req, now))
        try:
            # Not shielded: a cancel here cancels the future itself, which the scheduler's
            # grant sees as the client gone; a grant that won the race leaves the future
            # done, and the cancel still lands here (the task's own flag).
            granted_model = await waiting.future
        except asyncio.CancelledError:
            if waiting.future.done() and not waiting.future.cancelled() \
                    and waiting.future.exception() is None:
                # granted as we left: give the slot back
                self.post(ServeDone(req, loop.time()))
            else:
                if not waiting.future.done():
                    waiting.future.cancel()
                self.post(Cancelled(req, loop.time()))
            raise
        return Grant(self, req, granted_model)

    async def load(self, model: str) -> str:
        """Make `model` ready through the scheduler and return its id: an ordinary request,
        released as soon as it is granted, so it queues, joins swaps and respects work in
        flight like an inference request. Raises the SchedulingError (404, 502, ...)."""
        grant = await self.acquire(model)
        grant.release()
        return grant.model

    async def unload(self, models: Iterable[str]) -> None:
        """Stop these models through the scheduler (so no swap races the stop). After the
        run loop's shutdown there is nothing to do: shutdown stops every upstream."""
        if self._closed:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.post(UnloadRequested(tuple(models), self.now(), done))
        await done

    async def unload_all(self) -> None:
        """Stop every model that is loaded or loading when the scheduler handles this: the
        list is the scheduler's at that moment, not one read earlier (a model loading since
        would be missed; one stopped since would be stopped twice)."""
        if self._closed:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.post(UnloadRequested((), self.now(), done, everything=True))
        await done

    async def inspect(self, read: Callable[[Scheduler, float], T]) -> T:
        """Run `read(scheduler, now)` on this loop's task between two events, and return
        what it returns: the only way code off the loop reads the books as they are. Once the
        loop has ended (after Shutdown, or before it started) nothing changes them any more:
        they are read at once, as they were left."""
        if self._task is None or self._task.done():
            return read(self.scheduler, self.now())
        query = _Inspect(read, asyncio.get_running_loop().create_future())
        self._events.put_nowait(query)
        return await query.answer

    def _process_exited(self, model: str) -> None:
        """A model's process exited (Upstreams.on_exit): the scheduler hears it as an event,
        ahead of the process's own state change."""
        if not self._closed:
            self.post(ModelExited(model, self.now()))

    def restart(self, models: Iterable[str]) -> None:
        """Restart these models once each is idle (work in flight is never cut off)."""
        self._restarts_asked.update(models)
        self.post(RestartRequested(tuple(models), self.now()))

    def settings_changed(self, config: SchedulerConfig) -> None:
        self.post(SettingsChanged(config, self.now()))

    # ---- Effects (called by the scheduler, on the run loop's task) -------------------------

    def model_state(self, model: str) -> str:
        proc = self.upstreams.existing(model)
        return fx.STOPPED if proc is None else _STATE[proc.state]

    def running_models(self) -> list[str]:
        return self.upstreams.running_ids()

    def start_swap(self, model: str, evict: list[str]) -> None:
        for m in evict:  # why they stop, for their model events
            if m == model:
                asked = m in self._restarts_asked
                self._restarts_asked.discard(m)
                self.upstreams.restarting(m, mev.ADMIN if asked else mev.CONFIG)
            else:
                self.upstreams.cause(m, mev.SWAP, f"for {model}")
        if model not in evict:  # the load names the request it is for: its first waiter
            first = self.scheduler.active_swaps().get(model, [None])[0]
            self.upstreams.cause(model, mev.REQUEST, load=True,
                                 request_id=getattr(first and first.handle, "request_id", ""))
        task = self._spawn(self._swap(model, evict, self._unloads.get(model, 0)),
                           f"swap:{model}")
        self._swaps[model] = task
        task.add_done_callback(lambda t: self._swaps.pop(model, None)
                               if self._swaps.get(model) is t else None)

    async def _swap(self, model: str, evict: list[str], unloads: int) -> None:
        """Evict, then load. `unloads`: the model's unload count when the scheduler started
        this swap; an unload of the model decided since (before its process exists, or while
        the evicted ones stop) aborts the load here, since there is no process yet to stop."""
        error: str | None = None
        timed_out = False
        started = self.now()
        try:
            if evict:
                logger.info("loading model %r: unloading %s first", model,
                            ", ".join(repr(m) for m in evict))
                await asyncio.gather(*(self.upstreams.process(m).stop() for m in evict))
            if self._unloads.get(model, 0) != unloads:
                logger.info("loading model %r: aborted, it was unloaded while %s stopped",
                            model, ", ".join(repr(m) for m in evict) or "nothing")
                # the words of a start a stop aborted (`Lifecycle._aborted`): the same event
                raise StartFailed(model, "aborted", "start aborted: stopped while starting "
                                  "(unloaded before its process was started)",
                                  summary="start aborted: stopped while starting")
            await self.upstreams.process(model).ensure_ready()
        except StartFailed as exc:
            # What clients read: the details (command line, output) are in the log already.
            error, timed_out = exc.public, exc.reason == "timeout"
        except Exception:  # a bug must still answer the waiters
            logger.exception("swap to %r failed", model)
            error = (f"model {model!r} could not be loaded: an internal error; the proxy's log "
                     "has it")
        self._swap_times[model] = (started, self.now())
        if error is None:
            metrics.observe_swap(model, self.now() - started)
        self.post(SwapDone(model, self.now(), error, timed_out))

    def grant_serve(self, req: Request, model: str) -> bool:
        waiting: Waiting = req.handle
        if waiting.future.done():  # the client left; no ServeDone will ever come
            return False
        load = self._swap_times.get(model)
        if load is not None and load[1] > req.arrived:  # it waited (partly) for this load
            waiting.swap_wait = load[1] - max(load[0], req.arrived)
        waiting.future.set_result(model)
        proc = self.upstreams.existing(model)  # None for a peer's model a selector chose
        if proc is not None:
            proc.serving(True)
        if req.dispatch is not None:
            metrics.observe_dispatch(req.dispatch.band, req.dispatch.queue_wait)
        return True

    def grant_error(self, req: Request, error: SchedulingError) -> None:
        waiting: Waiting = req.handle
        if not waiting.future.done():
            waiting.future.set_exception(error)

    def stop_processes(self, models: Iterable[str], handle: object) -> None:
        models = tuple(models)
        for m in models:  # a swap to one of them that has not loaded yet sees it (`_swap`)
            self._unloads[m] = self._unloads.get(m, 0) + 1
        self._spawn(self._stop(models, handle), "unload")

    async def _stop(self, models: tuple[str, ...], handle: object) -> None:
        # Loads of these models in progress: the stops below abort one already starting, and
        # one still evicting aborts itself (`_swap`). The unload is done when they have ended:
        # until its UnloadDone the models stay held, so a request arriving meanwhile queues
        # for a fresh load instead of joining the doomed one.
        loads = [t for m in models if (t := self._swaps.get(m)) is not None and not t.done()]
        try:
            procs = [p for m in models if (p := self.upstreams.existing(m)) is not None]
            for p in procs:  # an unload an operator asked, or a definition gone
                self.upstreams.cause(p.spec.model_id,
                                     mev.ADMIN if handle is not None else mev.CONFIG)
            by_timeout: dict[float, list[UpstreamProcess]] = {}
            for p in procs:  # smallest unload timeout first, llama-swap's order
                by_timeout.setdefault(p.spec.unload_timeout, []).append(p)
            for timeout in sorted(by_timeout):
                await asyncio.gather(*(p.stop() for p in by_timeout[timeout]))
            if loads:
                await asyncio.wait(loads)
        finally:
            self.post(UnloadDone(models, self.now()))
            if isinstance(handle, asyncio.Future) and not handle.done():
                handle.set_result(None)

    def position_changed(self, req: Request, position: int) -> None:
        waiting: Waiting = req.handle
        waiting.position = position
        waiting.position_changed.set()

    def _maybe_idle(self, req: Request) -> None:
        """After a granted request's ServeDone: when the scheduler counts none of its model in
        flight any more, its process may start its idle (TTL) clock. The scheduler's count is
        the only one (a grant sets the process busy in `grant_serve`)."""
        waiting = req.handle
        if not isinstance(waiting, Waiting) or not waiting.future.done() \
                or waiting.future.cancelled() or waiting.future.exception() is not None:
            return
        model = waiting.future.result()
        proc = self.upstreams.existing(model)
        if proc is not None and self.scheduler.in_flight(model) == 0:
            proc.serving(False)

    # ---- helpers ----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
