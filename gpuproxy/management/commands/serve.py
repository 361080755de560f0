"""`gpuproxy serve`: migrate, import a llama-swap config, run Daphne, preload, stop cleanly.

On SIGTERM/SIGINT Daphne stops its reactor; a "before shutdown" trigger stops every upstream
(graceful signal, then SIGKILL after each model's unload timeout) before the process exits, so
no inference server outlives the proxy.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

# Daphne installs Twisted's asyncio reactor on import; it must come before anything else
# imports twisted.internet.reactor.
import daphne.server  # noqa: F401  isort:skip
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpuproxy.orphans import AlreadyServing, InstanceLock

logger = logging.getLogger("gpuproxy.serve")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise CommandError(f"--listen {value!r}: the port must be a number, "
                           "e.g. 127.0.0.1:8080") from None
    if not 0 < number < 65536:
        raise CommandError(f"--listen {value!r}: the port must be 1..65535")
    return host, number


def endpoint_for(host: str, port: int) -> str:
    interface = host.replace(":", r"\:")
    # Twisted's default listen backlog of 50 drops SYNs when a thousand clients connect at
    # once (they retry after 1 s); the scheduler, not the kernel, decides who waits.
    return f"tcp:port={port}:interface={interface}:backlog=1024"


async def start(preload_models: list[str]) -> None:
    """Once listening: watch the database for changes, then run the preload hook."""
    from gpuproxy import runtime

    rt = await runtime.get()
    rt.start_watcher()
    await preload(preload_models)


async def preload(models: list[str]) -> None:
    """llama-swap's `hooks.on_startup.preload`: load each in order; a failure is logged only."""
    from gpuproxy import runtime
    from scheduling.core.errors import SchedulingError

    rt = await runtime.get()
    for name in models:
        try:
            loaded = await rt.run_loop.load(rt.catalog.resolve(name) or name)
        except SchedulingError as exc:
            logger.error("preload of %r failed: %s", name, exc.message)
        else:
            logger.info("preloaded model %r", loaded)


def quiet_twisted_http() -> None:
    """Two things Twisted does per request that nobody here reads: it parses every
    form-encoded or multipart body on the event loop (a 10 MiB upload blocked it for 241 ms;
    the proxy relays bodies raw and Django parses its own forms), and it formats an access
    log line. Off, for 40-70 µs a request (BENCHMARKS.md)."""
    from daphne.http_protocol import HTTPFactory, WebRequest

    if getattr(WebRequest, "_gpuproxy_quiet", False):
        return
    original = WebRequest.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = init
    WebRequest._gpuproxy_quiet = True
    HTTPFactory.log = lambda self, request: None


class Command(BaseCommand):
    help = "Run the proxy: migrate, import --config (a llama-swap config.yaml), serve with Daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", help="a llama-swap config.yaml to import before serving")
        parser.add_argument("--listen", default="127.0.0.1:8080",
                            help="HOST:PORT to listen on (default 127.0.0.1:8080)")
        parser.add_argument("--no-migrate", action="store_true",
                            help="do not apply database migrations at start")

    def handle(self, *args, **options) -> None:
        host, port = parse_listen(options["listen"])
        lock = self.lock_instance()
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        if options["config"]:
            self.import_config(options["config"])

        from daphne.server import Server
        from twisted.internet import defer, reactor

        from gpuproxy import runtime
        from gpuproxy.asgi import application
        from scheduling.models import ProxySettings

        left = runtime.upstream_records().sweep()
        if left:
            logger.warning("stopped %d upstream(s) left running by an earlier crash: %s",
                           len(left), ", ".join(left))

        preload_list = list(ProxySettings.load().preload)
        background: set[asyncio.Future] = set()

        def on_running() -> None:
            # Everything loaded at start lives as long as the process: keep it out of the
            # collector's full passes, whose pauses otherwise set the p99 (BENCHMARKS.md).
            gc.collect()
            gc.freeze()
            logger.info("gpuproxy listening on http://%s:%d", host, port)
            task = asyncio.ensure_future(start(preload_list))
            background.add(task)
            task.add_done_callback(background.discard)

        def before_shutdown() -> defer.Deferred:
            logger.info("gpuproxy stopping: unloading upstreams")
            return defer.Deferred.fromFuture(asyncio.ensure_future(runtime.shutdown()))

        quiet_twisted_http()
        reactor.callWhenRunning(on_running)
        reactor.addSystemEventTrigger("before", "shutdown", before_shutdown)
        Server(
            application=application,
            endpoints=[endpoint_for(host, port)],
            signal_handlers=True,
            action_logger=None,
            # Never cut long streams: an inference can take minutes (stack notes §3).
            http_timeout=None,
            application_close_timeout=10,
            verbosity=0,
            # Name the product, not the stack under it (daphne, its version): no help to an
            # attacker, and what an operator sees in a client's error report.
            server_name="gpuproxy",
        ).run()
        lock.release()
        logger.info("gpuproxy stopped")

    def lock_instance(self) -> InstanceLock:
        """One proxy per data dir and per database: refuse to start beside another."""
        from django.conf import settings
        from django.db import connections

        from gpuproxy.runtime import own_connection_params

        params = (own_connection_params() if connections["default"].vendor == "postgresql"
                  else None)
        lock = InstanceLock(settings.DATA_DIR, params)
        try:
            lock.acquire()
        except AlreadyServing as exc:
            raise CommandError(str(exc)) from None
        return lock

    def import_config(self, path: str) -> None:
        if not Path(path).is_file():
            raise CommandError(f"config file not found: {path}; pass a llama-swap config.yaml "
                               "(see config.example.yaml)")
        call_command("import_config", path, stdout=self.stdout, stderr=self.stderr)
