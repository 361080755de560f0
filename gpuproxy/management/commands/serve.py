"""`gpuproxy serve`: migrate, import a llama-swap config, run Daphne, preload, stop cleanly.

Stopping, in order (`Stopping`):

1. SIGTERM or SIGINT starts a drain: every new request gets 503 `shutting_down` at the edge
   (gpuproxy/proxy/edge.py), the run loop answers every queued or loading request the same way, and
   the requests in flight may finish for GPUPROXY_SHUTDOWN_GRACE_SECONDS. The log says what it
   waits for. A second signal ends the wait at once.
2. Then the reactor stops; a "before shutdown" trigger stops every upstream (graceful signal,
   then SIGKILL after each model's unload timeout) before the process exits, so no inference
   server outlives the proxy, and Daphne cancels what is still running.

The exit status tells a service manager what happened: 0 for a requested stop; non-zero (with
the reason on stderr) when the port cannot be listened on, or when the one-proxy-per-database
lock went to another instance (gpuproxy/shell/instance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

# Daphne installs Twisted's asyncio reactor on import; it must come before anything else
# imports twisted.internet.reactor.
import daphne.server  # noqa: F401  # isort:skip
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpuproxy.management.config_watch import ConfigSource, Reimporter, on_sighup
from gpuproxy.management.listening import (
    ProxyServer,
    endpoint_for,
    parse_listen,
    quiet_twisted_http,
    tls_context,
    use_tls,
)
from gpuproxy.management.stopping import Stopping
from gpuproxy.proxy import edge
from gpuproxy.shell.instance import AlreadyServing, InstanceLock, SetupTimeout

logger = logging.getLogger("gpuproxy.serve")


async def start(preload_models: list[str], reimporter: Reimporter | None = None,
                watch: bool = False) -> None:
    """Once listening: watch the database (and, with `-watch-config`, the config file) for
    changes, then run the preload hook."""
    from gpuproxy.shell import runtime

    rt = await runtime.get()
    rt.start_watcher()
    if watch and reimporter is not None:
        reimporter.watch()
    await preload(preload_models)


async def preload(models: list[str]) -> None:
    """llama-swap's `hooks.on_startup.preload`: load each in order; a failure is logged only."""
    from gpuproxy.shell import runtime
    from scheduling.core.errors import SchedulingError

    rt = await runtime.get()
    for name in models:
        route = rt.catalog.route(name, profiles=False)
        if route.kind == "fleet":  # placed on other nodes: theirs to preload
            logger.info("preload of %r skipped: it is placed on node(s) %s, not on this "
                        "node (%s)", name, ", ".join(route.nodes), rt.catalog.node)
            continue
        try:
            loaded = await rt.run_loop.load(rt.catalog.resolve(name) or name)
        except SchedulingError as exc:
            logger.error("preload of %r failed: %s", name, exc.message)
        else:
            logger.info("preloaded model %r", loaded)


async def hangup(reimporter: Reimporter | None) -> None:
    """SIGHUP in one process: once the runtime it acts on is up (a SIGHUP during start-up
    waits for it), as `on_sighup` says."""
    from gpuproxy.shell import runtime

    rt = await runtime.get()
    on_sighup(reimporter, rt.request_reload)


async def linked(ready_fd: int | None) -> None:
    """A request process: reach the scheduler process, then tell the supervisor it is ready."""
    from gpuproxy.shell import runtime

    await runtime.port()
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)


class _Version(argparse.Action):
    """`--version` and llama-swap's `-version`: this build (gpuproxy/version.py), not
    Django's version, which is what BaseCommand's own `--version` prints."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from gpuproxy.version import version_line

        sys.stdout.write(version_line() + "\n")  # stdout, as argparse's own version action
        parser.exit()


DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_LISTEN_TLS = "127.0.0.1:8443"


class Command(BaseCommand):
    help = ("Run the proxy: migrate, import --config (a llama-swap config.yaml) when it "
            "changed, serve with Daphne. llama-swap's single-dash flags are accepted too.")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        # "resolve": our --version replaces Django's (which prints Django's version).
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve",
                                     **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        # llama-swap's flags are Go's, single-dash (`-config F`, `-listen :8080`); each is
        # an alias of ours, so a llama-swap unit file's command line runs unchanged.
        parser.add_argument("--config", "-config",
                            help="a llama-swap config.yaml, imported when its content "
                                 "changed since the last import, and again on SIGHUP")
        parser.add_argument("--config-dir", "-config-dir", dest="config_dir",
                            help="a directory of llama-swap *.yaml/*.yml files, merged in "
                                 "name order (instead of --config)")
        parser.add_argument("--force-import", action="store_true",
                            help="import the config even when unchanged since the last "
                                 "import (replaces edits made in the admin since)")
        parser.add_argument("--watch-config", "-watch-config", action="store_true",
                            dest="watch_config",
                            help="re-import the config when the file changes (a 2 s poll), "
                                 "as SIGHUP does")
        parser.add_argument("--listen", "-listen", default=None,
                            help=f"HOST:PORT to listen on (default {DEFAULT_LISTEN}, "
                                 f"{DEFAULT_LISTEN_TLS} with TLS; :PORT is every interface)")
        parser.add_argument("--tls-cert-file", "-tls-cert-file", dest="tls_cert_file",
                            help="serve HTTPS with this PEM certificate (chain after it); "
                                 "needs --tls-key-file")
        parser.add_argument("--tls-key-file", "-tls-key-file", dest="tls_key_file",
                            help="the PEM private key of --tls-cert-file")
        parser.add_argument("--version", "-version", action=_Version,
                            help="print this build's version and exit")
        parser.add_argument("--no-migrate", action="store_true",
                            help="do not apply database migrations at start")
        parser.add_argument("--workers", type=int, default=None,
                            help="request processes behind one scheduler process (default: 1 "
                                 "on a box of at most 2 cores or on SQLite, else one per core, "
                                 "at most 8)")
        # How `--workers N` starts its own processes (gpuproxy/management/workers.py).
        parser.add_argument("--role", choices=("scheduler", "worker"), help=argparse.SUPPRESS)
        parser.add_argument("--hub", help=argparse.SUPPRESS)
        parser.add_argument("--fd", help=argparse.SUPPRESS)
        parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    def handle(self, *args, **options) -> None:
        from django.db import connections

        from gpuproxy.management import workers as multi

        # A SIGHUP before its handler is in place must not end the process (its default):
        # `gpuproxy` ignores it from its first line (gpuproxy/cli.py); this covers
        # `manage.py serve` and call_command.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        source = self.config_source(options)
        tls = self.tls_files(options)
        listen = options["listen"] or (DEFAULT_LISTEN_TLS if tls else DEFAULT_LISTEN)
        host, port = parse_listen(listen)
        if options["role"] != "worker":  # the process with the run loop publishes the node
            from gpuproxy.shell import fleet

            fleet.serving_at(host, port)
        if options["watch_config"] and source is None:
            raise CommandError("-watch-config watches the file of -config (or -config-dir): "
                               "give one of them too")
        if options["role"] == "scheduler":
            self.scheduler_process(Path(options["hub"]), options["ready_fd"], source,
                                   options["watch_config"])
            return
        if options["role"] == "worker":
            self.serve_requests(host, port, None, tls=tls, hub=options["hub"],
                                fd=options["fd"], ready_fd=options["ready_fd"])
            return
        sqlite = connections["default"].vendor == "sqlite"
        count = options["workers"]
        if count is None:
            count = multi.default_workers(os.cpu_count(), sqlite)
        if count < 1:
            raise CommandError(f"--workers {count}: give 1 or more request processes")
        if count > 1 and sqlite:
            raise CommandError(f"--workers {count} needs PostgreSQL (DATABASE_URL): SQLite "
                               "takes one writer at a time. Use --workers 1 on SQLite.")
        if tls is not None:
            tls_context(*tls)  # a bad file stops here, before anything starts
        lock = self.lock_instance()
        setup = contextlib.ExitStack()
        try:
            setup.enter_context(lock.setup(say=self.stderr.write))  # one node at a time
            if not options["no_migrate"]:
                call_command("migrate", interactive=False, verbosity=0)
            if source is not None:
                self.import_config(source, force=options["force_import"])
        except SetupTimeout as exc:
            lock.release()
            raise CommandError(str(exc)) from None
        except BaseException:
            setup.close()
            lock.release()
            raise
        if count == 1:
            setup.close()
            self.serve_requests(host, port, lock, tls=tls, source=source,
                                watch=options["watch_config"])
            return
        self.supervise(host, port, count, lock, tls, source, options["watch_config"], setup)

    @staticmethod
    def config_source(options: dict[str, Any]) -> ConfigSource | None:
        """`-config FILE` or `-config-dir DIR`, checked: a clear error before anything starts."""
        config, config_dir = options["config"], options["config_dir"]
        if config and config_dir:
            # llama-swap merges -config before the directory's files; gpuproxy imports one
            # source, so that one fingerprint says whether anything changed.
            raise CommandError(f"-config {config} and -config-dir {config_dir} together: give "
                               "one (move the file into the directory to merge them)")
        if config:
            if not Path(config).is_file():
                raise CommandError(f"config file not found: {config}; pass a llama-swap "
                                   "config.yaml (see config.example.yaml)")
            return ConfigSource(Path(config))
        if config_dir:
            if not Path(config_dir).is_dir():
                raise CommandError(f"-config-dir {config_dir}: not a directory; pass one that "
                                   "holds llama-swap *.yaml/*.yml files")
            return ConfigSource(Path(config_dir))
        return None

    @staticmethod
    def tls_files(options: dict[str, Any]) -> tuple[str, str] | None:
        cert, key = options["tls_cert_file"], options["tls_key_file"]
        if bool(cert) != bool(key):
            raise CommandError("-tls-cert-file and -tls-key-file go together: HTTPS needs both "
                               f"(given: {'-tls-cert-file' if cert else '-tls-key-file'} only)")
        return (cert, key) if cert else None

    def supervise(self, host: str, port: int, count: int, lock: InstanceLock,
                  tls: tuple[str, str] | None, source: ConfigSource | None,
                  watch: bool, setup: contextlib.ExitStack) -> None:
        from django.conf import settings

        from gpuproxy.management.workers import Supervisor, listening_socket

        try:
            sock = listening_socket(host, port)
        except OSError as exc:
            setup.close()
            lock.release()
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}. Stop "
                               "what holds the port, or pass another --listen HOST:PORT."
                               ) from None
        # The scheduler process takes the lock itself; this one only made sure it was free.
        # Until it holds it, a node starting beside this one would find no serve of this node
        # and take the importer role (gpuproxy/management/importer_role.py): the setup lock,
        # which that node's claim waits for, is held until the handover is done.
        lock.release()
        done, once = threading.Event(), threading.Lock()

        def let_setup_go() -> None:
            with once:
                setup.close()

        def hand_over() -> None:
            lock.wait_taken_over(120.0, done)  # the scheduler process's own start limit
            let_setup_go()

        threading.Thread(target=hand_over, name="setup-handover", daemon=True).start()
        hub = settings.DATA_DIR / "scheduler.sock"
        supervisor = Supervisor(host, port, sock, count, hub, settings.GPUPROXY_SHUTDOWN_GRACE,
                                tls=tls, config=source.path if source else None, watch=watch)
        try:
            supervisor.run()
        finally:
            done.set()
            let_setup_go()
        if supervisor.failure is not None:
            raise CommandError(supervisor.failure)
        logger.info("gpuproxy stopped")

    def scheduler_process(self, hub: Path, ready_fd: int, source: ConfigSource | None,
                          watch: bool) -> None:
        from gpuproxy.management.workers import LOCK_EXIT, run_scheduler
        from scheduling.models import ProxySettings

        try:
            lock = self.lock_instance(pid=os.getppid())
        except CommandError as exc:
            self.stderr.write(f"CommandError: {exc}")
            sys.exit(LOCK_EXIT)
        models = list(ProxySettings.load().preload)
        code = run_scheduler(hub, ready_fd, lock, lambda: preload(models), source, watch)
        if code:
            sys.exit(code)

    def serve_requests(self, host: str, port: int, lock: InstanceLock | None,
                       tls: tuple[str, str] | None = None, source: ConfigSource | None = None,
                       watch: bool = False, hub: str | None = None, fd: str | None = None,
                       ready_fd: int | None = None) -> None:
        """Daphne, with the run loop in this process (`lock` held) or, as a request process
        of `--workers N`, a client of the scheduler process at `hub` accepting on `fd`.
        `source`: the config SIGHUP (and `watch`) re-imports, in this process."""
        from django.conf import settings
        from twisted.internet import defer, reactor

        from gpuproxy.asgi import application
        from gpuproxy.shell import runtime
        from scheduling.catalog_db import build_catalog
        from scheduling.models import ProxySettings

        if hub is not None:
            runtime.use_scheduler_process(hub)
        elif (left := runtime.upstream_records().sweep()):
            logger.warning("stopped %d upstream(s) left running by an earlier crash: %s",
                           len(left), ", ".join(left))

        preload_list = list(ProxySettings.load().preload)
        background: set[asyncio.Future] = set()

        def reread() -> None:
            rt = runtime.current()
            if isinstance(rt, runtime.Runtime):
                rt.request_reload()
        stopping = Stopping(settings.GPUPROXY_SHUTDOWN_GRACE, child=hub is not None)
        reimporter = (Reimporter(source, runtime.run_db, reread)
                      if source is not None and lock is not None else None)
        # A request process of `--workers N` keeps SIGHUP ignored (handle): the supervisor's
        # goes to the scheduler process; a request process has nothing to re-read (its
        # catalog is the scheduler process's).

        def on_running() -> None:
            # Everything loaded at start lives as long as the process: keep it out of the
            # collector's full passes, whose pauses otherwise set the p99 (BENCHMARKS.md).
            gc.collect()
            gc.freeze()
            stopping.install()
            if lock is not None:
                signal.signal(signal.SIGHUP, lambda signum, frame: reactor.callFromThread(
                    on_hangup))
                logger.info("gpuproxy listening on %s://%s:%d", "https" if tls else "http",
                            host, port)
                lock.watch(stopping.fail)
                task = asyncio.ensure_future(start(preload_list, reimporter, watch))
            else:
                task = asyncio.ensure_future(linked(ready_fd))
            background.add(task)
            task.add_done_callback(background.discard)

        def on_hangup() -> None:
            task = asyncio.ensure_future(hangup(reimporter))
            background.add(task)
            task.add_done_callback(background.discard)

        def before_shutdown() -> defer.Deferred:
            if reimporter is not None:
                reimporter.stop()
            if lock is not None:
                logger.info("gpuproxy stopping: unloading upstreams")
            return defer.Deferred.fromFuture(asyncio.ensure_future(runtime.shutdown()))

        quiet_twisted_http()
        at_start = build_catalog()
        if fd is not None:
            endpoints = [f"adopt:{fd}"]
        else:
            endpoints = [endpoint_for(host, port)]
        if tls is not None:
            use_tls(tls_context(*tls))
            endpoints = [f"tls:{e}" for e in endpoints]
        edge.install(settings.GPUPROXY_MAX_BODY_BYTES, settings.GPUPROXY_HEADER_TIMEOUT,
                     at_start.api_keys, at_start.admin_keys)
        reactor.callWhenRunning(on_running)
        # Twisted's interface stubs take the first argument for self: the call is right.
        reactor.addSystemEventTrigger("before", "shutdown",  # type: ignore[arg-type]
                                      before_shutdown)
        server = ProxyServer(
            application=application,
            endpoints=endpoints,
            signal_handlers=True,
            action_logger=None,
            # Never cut long streams: an inference can take minutes (stack notes §3).
            http_timeout=None,
            application_close_timeout=10,
            verbosity=0,
            # Name the product, not the stack under it (daphne, its version): no help to an
            # attacker, and what an operator sees in a client's error report.
            server_name="gpuproxy",
        )
        server.run()
        if lock is not None:
            lock.release()
        if server.listen_failure is not None:
            raise CommandError(f"cannot listen on {host}:{port}: {server.listen_failure}. Stop "
                               "what holds the port, or pass another --listen HOST:PORT.")
        if stopping.failure is not None:
            raise CommandError(stopping.failure)
        logger.info("gpuproxy stopped" if lock is not None else
                    f"request process {os.getpid()} stopped")

    def lock_instance(self, pid: int | None = None) -> InstanceLock:
        """One proxy per data dir and per node per database: refuse to start beside another.
        `pid`: the process to name as its holder (the supervisor, for the scheduler process)."""
        from django.conf import settings
        from django.db import connections

        from gpuproxy.shell.runtime import own_connection_params

        params = (own_connection_params() if connections["default"].vendor == "postgresql"
                  else None)
        lock = InstanceLock(settings.DATA_DIR, params, check_every=settings.GPUPROXY_LOCK_CHECK,
                            pid=pid, node=settings.GPUPROXY_NODE)
        try:
            lock.acquire()
        except AlreadyServing as exc:
            raise CommandError(str(exc)) from None
        return lock

    def import_config(self, source: ConfigSource, force: bool) -> None:
        """At start: import the config only when its content changed since the last import
        (or `--force-import`), so a restart keeps what was edited in the admin since. Only
        the fleet's importer writes (gpuproxy/management/importer_role.py): another node
        starts with the file the database last imported, and refuses a different one."""
        from django.conf import settings

        from gpuproxy.management import importer_role
        from scheduling.llamaswap import ConfigError
        from scheduling.nodes import ADMIN_ONLY

        node = settings.GPUPROXY_NODE
        try:
            with importer_role.claiming(node) as role:  # the claim and the import: one commit
                report = source.import_now(force=force) if role.imports else None
                if report is None and not importer_role.same_as_last_import(
                        source.fingerprint()):
                    raise CommandError(importer_role.refusal(node, role.importer, str(source)))
        except ConfigError as exc:
            raise CommandError(f"{source}: {exc}; nothing was changed") from None
        except OSError as exc:
            raise CommandError(f"{source}: cannot read it: {exc.strerror or exc}") from None
        role.log()
        if report is None:
            who = ("the admin" if role.importer == ADMIN_ONLY
                   else f"node {role.importer}")
            self.stdout.write(f"{source}: the same as the definitions' last import; nothing "
                              f"written (this node, {node}, does not import: {who} writes "
                              "the definitions)")
            return
        for warning in report.warnings:
            self.stderr.write(f"warning: {warning}")
        if report.unchanged:
            self.stdout.write(f"{source}: unchanged since the last import; the definitions in "
                              "the database are kept (admin edits included; --force-import "
                              "imports the file again)")
        else:
            self.stdout.write(report.summary(str(source)))
