"""Upstream commands that misbehave as processes, for tests against real processes (no mocks).

    python -m gpuproxy.testing.badprocess daemonize [--wait] -- CMD ...
    python -m gpuproxy.testing.badprocess wrap [--sidecar] -- CMD ...
    python -m gpuproxy.testing.badprocess printenv [--port P] [--exit CODE] [-- ARG ...]
    python -m gpuproxy.testing.badprocess holdport --port P [--http]

What each one is, and the real thing it stands for:

* `daemonize`: a launcher that daemonises its server (double fork, `setsid`), the daemon keeping
  the launcher's stdout and stderr. Without `--wait` the launcher exits 0 at once, as a
  `server &` script or a service wrapper does; with `--wait` it stays in the foreground until
  signalled, as `sh -c "setsid server & wait"` does. Either way the daemon is in a session
  and process group of its own, out of reach of a signal to the launcher's group, and it holds
  the pipe that asyncio's `Process.wait()` waits on.
* `wrap`: a wrapper script (`sh -c "server; ..."`): CMD runs as its child in the same process
  group and the wrapper exits with CMD's code, or at once on SIGTERM (it does not forward it).
  `--sidecar` also starts a helper in the same group that ignores SIGTERM and keeps stdout open
  for ever (a log shipper, a `tail -f`).
* `printenv`: prints its environment (`ENV NAME=VALUE`, one line each, sorted) and then its
  arguments (`ARGV ...`); then exits with `--exit` CODE, or serves `GET` 200 on `--port` until
  SIGTERM. The server that shows what an upstream can read: secrets on its command line or in its
  environment.
* `holdport`: listens on a port (a stranger, an orphan of a crash); with `--http` it answers
  every request with 200, so it passes any health check.

Each prints one flushed line when it is in place (`badprocess: daemon PID`, `badprocess:
sidecar PID`, `badprocess: holding port P`, `badprocess: serving on port P`), so a test can
wait for that line instead of sleeping. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROG = "python -m gpuproxy.testing.badprocess"


def _say(line: str) -> None:
    sys.stdout.write(f"badprocess: {line}\n")
    sys.stdout.flush()


def daemonize(argv: list[str], wait: bool) -> int:
    """Fork a daemon that runs `argv` in a new session with our stdout; see the module doc."""
    read_end, write_end = os.pipe()
    first = os.fork()
    if first == 0:  # the intermediate: new session, fork the daemon, exit
        os.close(read_end)
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.close(write_end)
            try:
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)
        os.write(write_end, str(daemon).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        daemon_pid = int(pipe.read() or b"0")
    os.waitpid(first, 0)
    _say(f"daemon {daemon_pid}")
    if not wait:
        return 0
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        signal.pause()


def wrap(argv: list[str], sidecar: bool) -> int:
    """Run `argv` as a child in our process group; exit with its code, or at once on SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    if sidecar:
        helper = subprocess.Popen(
            [sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, "
             "signal.SIG_IGN); signal.pause()"])
        _say(f"sidecar {helper.pid}")
    child = subprocess.Popen(argv)
    return child.wait()


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve_http(port: int, what: str) -> int:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    _say(f"{what} {port}")
    server.serve_forever()
    return 0


def printenv(args: list[str], port: int | None, code: int | None) -> int:
    for name in sorted(os.environ):
        sys.stdout.write(f"ENV {name}={os.environ[name]}\n")
    for arg in args:
        sys.stdout.write(f"ARGV {arg}\n")
    sys.stdout.flush()
    if code is not None or port is None:
        return code or 0
    return _serve_http(port, "serving on port")


def holdport(port: int, http: bool) -> int:
    if http:
        return _serve_http(port, "holding port")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        _say(f"holding port {port}")
        while True:
            conn, _ = s.accept()
            conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("daemonize")
    p.add_argument("--wait", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("wrap")
    p.add_argument("--sidecar", action="store_true")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("printenv")
    p.add_argument("--port", type=int)
    p.add_argument("--exit", type=int, dest="code")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("holdport")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--http", action="store_true")
    ns = parser.parse_args(argv)
    if ns.what in ("daemonize", "wrap"):
        cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
        if not cmd:
            parser.error(f"{ns.what} needs a command after --")
        return daemonize(cmd, ns.wait) if ns.what == "daemonize" else wrap(cmd, ns.sidecar)
    if ns.what == "printenv":
        return printenv(ns.args[1:] if ns.args[:1] == ["--"] else ns.args, ns.port, ns.code)
    return holdport(ns.port, ns.http)


if __name__ == "__main__":
    sys.exit(main())
