"""What does the proxy cost next to the upstream? The fake upstream alone vs through the proxy.

Starts a fake upstream (`gpuproxy.testing.fakellm`, as fast as it can go) on its own port for the
baseline, and the real `gpuproxy serve` (Daphne, SQLite in a temporary data directory, the
activity log on) with one model whose command is that same fake, loaded before measuring. The
same client then drives both, alternating direct and proxied rounds (A/B/B/A/...) after a
warm-up, so the drift of a noisy machine falls on both sides alike.

    .venv/bin/python bench/proxy_overhead.py [--seconds 1.5] [--rounds 4] [--profile DIR]

Cases:

- `json`: non-streaming chat completions (16 tokens) at concurrency 1 and 50: req/s, p50 and
  p99 latency, added latency (proxied - direct), the proxy's CPU per request.
- `sse100`: streamed chat completions (`max_tokens: 100`: 103 SSE events each) at concurrency
  1 and 32: events/s, time to the first event (TTFB) p50, and the proxy's CPU per relayed
  event.

The client is this process, separate from the proxy: asyncio protocols on raw sockets,
HTTP/1.1 keep-alive, one connection per concurrent client, so it costs little next to what it
measures. The proxy's CPU comes from `/proc/<serve pid>/stat` (utime + stime of the Daphne
process and its threads; the upstream is a child process and is not counted).

`--profile DIR` also records the proxy with py-spy during each proxied case (`pip install
py-spy`; it needs ptrace rights) and prints the top functions by own time.

The goals (issue 9) are printed PASS or GAP; nothing exits non-zero on a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- processes ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM (a proxy unloads its upstreams), SIGKILL if it is not gone within `grace`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads, not its children), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_main_thread(pid: int) -> float:
    """utime + stime of the main thread alone (Daphne's event loop: the request path)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fake_command(port: int | str, model: str = "solo", extra: str = "") -> str:
    return (f"{sys.executable} -m gpuproxy.testing.fakellm --port {port} --model {model} "
            f"{extra}").strip()


def start_fake(port: int, model: str = "solo", *extra: str) -> subprocess.Popen:
    """A fake upstream; returns once it answers /health (it prints "loaded")."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuproxy.testing.fakellm", "--port", str(port),
                             "--model", model, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # an event, not a sleep
        if "loaded" in line:
            break
    else:
        raise RuntimeError(f"the fake upstream on port {port} exited: {proc.wait()}")
    return proc


@dataclass
class Proxy:
    """A running `gpuproxy serve` on a temporary SQLite data directory."""

    proc: subprocess.Popen
    port: int
    work: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.work, ignore_errors=True)

    def log_tail(self, n: int = 30) -> str:
        path = self.work / "serve.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() \
            else ""


def start_proxy(config_yaml: str, prefix: str = "gpuproxy-bench-") -> Proxy:
    """The real `serve` command (migrate, import, Daphne) on SQLite; returns once /health
    answers. DATABASE_URL is removed from its environment."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    cfg = work / "config.yaml"
    cfg.write_text(textwrap.dedent(config_yaml))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(GPUPROXY_DATA_DIR=str(work), PYTHONPATH=str(ROOT))
    log = (work / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "serve", "--config",
                             str(cfg), "--listen", f"127.0.0.1:{port}"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    proxy = Proxy(proc, port, work)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpuproxy serve exited {proc.returncode}:\n{proxy.log_tail()}")
        try:
            status, _ = http("GET", proxy.port, "/health", timeout=2)
            if status == 200:
                return proxy
        except OSError:
            pass
        time.sleep(0.05)
    proxy.stop()
    raise RuntimeError("gpuproxy serve did not answer /health within 120 s")


def http(method: str, port: int, path: str, body: dict | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """One blocking request on a fresh connection (control calls, not measurements)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**hdrs, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def load_model(proxy: Proxy, model: str) -> None:
    status, body = http("POST", proxy.port, f"/api/models/load/{model}", timeout=60)
    if status != 200:
        raise RuntimeError(f"loading {model} failed: HTTP {status} {body[:300]!r}")


def running(proxy: Proxy) -> list[dict]:
    return json.loads(http("GET", proxy.port, "/running")[1])["running"]


# ---- the client: raw HTTP/1.1 on asyncio protocols ------------------------------------------

def request_bytes(port: int, body: dict, headers: dict[str, str] | None = None,
                  path: str = "/v1/chat/completions") -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}\r\n"
            ).encode() + data


@dataclass
class Result:
    status: int = 0
    sent: float = 0.0
    first_event: float | None = None  # first complete SSE event (b"\n\n") seen
    done: float = 0.0
    events: int = 0


class Conn(asyncio.Protocol):
    """One keep-alive connection; `request()` sends one request and returns when its whole
    response has arrived. Parses just enough HTTP/1.1: status, Content-Length, chunked."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.res = Result()
        self.state = "head"
        self.remaining = 0
        self.chunked = False
        self.last_nl = False
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(cls, port: int) -> Conn:
        loop = asyncio.get_running_loop()
        for attempt in range(50):
            try:
                _, conn = await loop.create_connection(cls, "127.0.0.1", port)
                return conn
            except OSError:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed mid-response"))

    async def request(self, data: bytes) -> Result:
        assert self.transport is not None
        self.res = Result(sent=time.perf_counter())
        self.state, self.last_nl = "head", False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _body(self, data: bytes | bytearray) -> None:
        n = data.count(b"\n\n")
        if self.last_nl and data[:1] == b"\n":
            n += 1
        self.last_nl = data[-1:] == b"\n"
        if n:
            if self.res.first_event is None:
                self.res.first_event = time.perf_counter()
            self.res.events += n

    def _finish(self) -> None:
        self.res.done = time.perf_counter()
        self.state = "idle"
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.res)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while True:
            if self.state == "head":
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                head = bytes(buf[pos:end]).lower()
                pos = end + 4
                self.res.status = int(head[9:12])
                self.chunked, length = False, 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name == b"content-length":
                        length = int(value)
                    elif name == b"transfer-encoding" and b"chunked" in value:
                        self.chunked = True
                if not self.chunked:
                    self.remaining = length
                    self.state = "length"
                    if self.remaining == 0:
                        self._finish()
                else:
                    self.state = "size"
            elif self.state == "length":
                take = min(self.remaining, len(buf) - pos)
                if take <= 0:
                    break
                self._body(buf[pos:pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self._finish()
            elif self.state == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(bytes(buf[pos:end]).split(b";", 1)[0], 16)
                pos = end + 2
                if size == 0:
                    self.state = "trailer"
                else:
                    self.remaining = size
                    self.state = "chunk"
            elif self.state == "chunk":
                take = min(self.remaining, len(buf) - pos)
                if take <= 0:
                    break
                self._body(buf[pos:pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = "chunk-end"
            elif self.state == "chunk-end":
                if len(buf) - pos < 2:
                    break
                pos += 2
                self.state = "size"
            elif self.state == "trailer":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                line_empty = end == pos
                pos = end + 2
                if line_empty:
                    self._finish()
            else:  # idle: bytes nobody asked for
                pos = len(buf)
                break
        del buf[:pos]


@dataclass
class Run:
    """What one round (or several, merged) measured."""

    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    cpu: float = 0.0  # seconds of the measured server process, when known
    cpu_main: float = 0.0  # of which its main thread

    def merge(self, other: Run) -> None:
        self.results += other.results
        self.seconds += other.seconds
        self.cpu += other.cpu
        self.cpu_main += other.cpu_main

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    def rate(self) -> float:
        return len(self.results) / self.seconds if self.seconds else 0.0

    def event_rate(self) -> float:
        return sum(r.events for r in self.results) / self.seconds if self.seconds else 0.0

    def latency_ms(self, q: float) -> float:
        return pct([(r.done - r.sent) * 1000 for r in self.ok], q)

    def ttfb_ms(self, q: float) -> float:
        return pct([(r.first_event - r.sent) * 1000 for r in self.ok
                    if r.first_event is not None], q)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def drive(port: int, data: bytes, concurrency: int, seconds: float,
                conns: list[Conn] | None = None) -> Run:
    """`concurrency` clients, each sending back-to-back requests for `seconds`; requests in
    flight at the deadline finish and count."""
    own = conns is None
    if conns is None:
        conns = [await Conn.open(port) for _ in range(concurrency)]
    results: list[Result] = []
    deadline = time.perf_counter() + seconds

    async def client(conn: Conn) -> None:
        while time.perf_counter() < deadline:
            res = await conn.request(data)
            results.append(res)

    t0 = time.perf_counter()
    # a proxy that stops answering ends the bench with an error instead of hanging it
    await asyncio.wait_for(asyncio.gather(*(client(c) for c in conns)), seconds + 60)
    elapsed = time.perf_counter() - t0
    if own:
        for c in conns:
            c.close()
    return Run(results, elapsed)


# ---- the benchmark --------------------------------------------------------------------------

JSON_BODY = {"model": "solo", "max_tokens": 16,
             "messages": [{"role": "user", "content": "hello there"}]}
SSE_BODY = {**JSON_BODY, "max_tokens": 100, "stream": True}
CASES = [("json", 1), ("json", 50), ("sse100", 1), ("sse100", 32)]


@dataclass
class Case:
    kind: str
    concurrency: int
    direct: Run = field(default_factory=Run)
    proxied: Run = field(default_factory=Run)
    upstream_cpu: float = 0.0  # the direct fake's CPU over the direct rounds


def proxy_config(upstream_port_macro: str = "${PORT}") -> str:
    return f"""
        startPort: {free_port()}
        healthCheckTimeout: 60
        models:
          solo:
            cmd: {fake_command(upstream_port_macro)}
            concurrencyLimit: 1000
            parallel: 64
        """


class Profiler:
    """py-spy record on the proxy during one proxied case (optional)."""

    def __init__(self, directory: Path | None) -> None:
        self.dir = directory
        self.proc: subprocess.Popen | None = None
        self.path: Path | None = None
        self.exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if directory is not None:
            if not Path(self.exe).exists():
                sys.exit("--profile needs py-spy: pip install py-spy")
            directory.mkdir(parents=True, exist_ok=True)

    def start(self, pid: int, name: str) -> None:
        if self.dir is None:
            return
        self.path = self.dir / f"{name}.txt"
        # --gil: only samples of the thread holding the GIL, i.e. Python at work (not a thread
        # waiting in a syscall, or preempted by the client and the upstream on a small box).
        # Blocking mode (py-spy pauses the process for each sample) gives whole stacks; at
        # 200 Hz it costs the proxy a few per cent.
        self.proc = subprocess.Popen([self.exe, "record", "--pid", str(pid), "--rate", "200",
                                      "--gil", "--threads", "--format", "raw",
                                      "-o", str(self.path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # let it attach

    def stop(self) -> list[str]:
        if self.proc is None or self.path is None:
            return []
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        self.proc = None
        return top_functions(self.path)


# Functions whose inclusive share (samples with them anywhere on the stack) the profile
# reports: the request path's layers and the known costs found with this bench.
KEY_FUNCTIONS = [
    ("UpstreamExchange.relay", "relay: the upstream request and the streaming loop"),
    ("AsyncClient.send", "  of which httpx's client layer (send, incl. aiohttp)"),
    ("ClientSession._request", "  of which aiohttp's request"),
    ("Cookies.extract_cookies", "  of which httpx's cookie jar (email header parsing)"),
    ("UsageParser.feed", "  of which the usage parser, fed every chunk"),
    ("AsyncHttpConsumer.send_body", "  of which Channels' send_body to Daphne"),
    ("RunLoop.acquire", "scheduler: acquire (queue + grant)"),
    ("RunLoop.run", "scheduler: the run loop's task"),
    ("ProxyConsumer.submit_record", "activity row + metrics at the end of a request"),
    ("_parseContentType", "Twisted: Content-Type parsed for form data (email package)"),
    ("HTTPFactory.log", "Twisted: the access log line, formatted for nobody"),
    ("HTTPChannel.dataReceived", "Twisted: HTTP request parsing"),
    ("Server.handle_reply", "Daphne: response messages to Twisted"),
    ("ActivityWriter._write_rows", "activity writer thread: bulk_create + commit"),
]


def top_functions(path: Path, n: int = 10) -> list[str]:
    """Own time by thread, by package and by function, and the inclusive share of the
    KEY_FUNCTIONS, from py-spy's collapsed stacks (`thread (tid): name;frame;...;leaf count`,
    frames `function (path:line)`)."""
    if not path.exists():
        return [f"(no profile written to {path})"]
    threads: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        k = int(count)
        total += k
        threads[frames[0].split(": ", 1)[-1]] += k
        names = {f.split(" (", 1)[0] for f in frames[1:]}
        for key, _ in KEY_FUNCTIONS:
            if key in names:
                inclusive[key] += k
        if len(frames) < 2:
            continue
        leaf = frames[-1]
        functions[leaf] += k
        where = leaf.rsplit("(", 1)[-1]
        packages[where.split("/", 1)[0] if "/" in where else where.split(".py", 1)[0]] += k
    if not total:
        return ["no samples"]
    out = [f"{total} samples holding the GIL; by thread: " + ", ".join(
        f"{name} {c / total:.0%}" for name, c in threads.most_common(4))]
    out.append("own time by package: " + ", ".join(
        f"{name} {c / total:.0%}" for name, c in packages.most_common(10)))
    out.append("inclusive time of the request path's parts:")
    out += [f"  {inclusive[key] / total:6.1%}  {label} ({key})"
            for key, label in KEY_FUNCTIONS if inclusive[key]]
    out.append("own time, top functions:")
    out += [f"  {c / total:6.1%}  {func}" for func, c in functions.most_common(n)]
    return out


async def measure(proxy: Proxy, direct_port: int, direct_pid: int, seconds: float,
                  rounds: int, profiler: Profiler) -> list[Case]:
    cases = []
    for kind, conc in CASES:
        body = SSE_BODY if kind == "sse100" else JSON_BODY
        case = Case(kind, conc)
        targets = {"direct": (direct_port, direct_pid), "proxied": (proxy.port, proxy.pid)}
        pools = {name: [await Conn.open(port) for _ in range(conc)]
                 for name, (port, _) in targets.items()}
        data = {name: request_bytes(port, body) for name, (port, _) in targets.items()}
        for name, (port, _) in targets.items():  # warm-up
            await drive(port, data[name], conc, min(0.5, seconds), pools[name])
        profiler.start(proxy.pid, f"{kind}-c{conc}")
        for r in range(rounds):
            order = ("direct", "proxied") if r % 2 == 0 else ("proxied", "direct")
            for name in order:
                port, pid = targets[name]
                cpu0, main0 = cpu_seconds(pid), cpu_main_thread(pid)
                run = await drive(port, data[name], conc, seconds, pools[name])
                run.cpu = cpu_seconds(pid) - cpu0
                run.cpu_main = cpu_main_thread(pid) - main0
                getattr(case, name).merge(run)
        case.profile = profiler.stop()  # type: ignore[attr-defined]
        for pool in pools.values():
            for c in pool:
                c.close()
        cases.append(case)
    return cases


def report(cases: list[Case], seconds: float, rounds: int) -> None:
    print(f"proxy_overhead: fake upstream direct vs through gpuproxy serve (Daphne, SQLite); "
          f"{rounds} alternating rounds of {seconds:g} s per side per case")
    print(f"{'case':8} {'conc':>4} {'side':8} {'reqs':>6} {'req/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'events/s':>9} {'ttfb p50':>9} {'server CPU':>13} {'err':>4}")
    for c in cases:
        for name in ("direct", "proxied"):
            run: Run = getattr(c, name)
            unit = "µs/ev" if c.kind == "sse100" else "µs/req"
            n = sum(r.events for r in run.results) if c.kind == "sse100" else len(run.results)
            cpu = f"{run.cpu / n * 1e6:7.1f} {unit}" if n else "-"
            ev = f"{run.event_rate():9.0f}" if c.kind == "sse100" else f"{'-':>9}"
            ttfb = f"{run.ttfb_ms(0.5):9.2f}" if c.kind == "sse100" else f"{'-':>9}"
            print(f"{c.kind:8} {c.concurrency:>4} {name:8} {len(run.results):>6} "
                  f"{run.rate():>8.0f} {run.latency_ms(0.5):>8.2f} {run.latency_ms(0.99):>8.2f} "
                  f"{ev} {ttfb} {cpu:>13} {run.errors:>4}")
    print("  server CPU: direct = the fake upstream's own; proxied = the gpuproxy serve process "
          "alone (its upstream not counted)")
    print("  ttfb = request sent -> first complete SSE event received")

    by = {(c.kind, c.concurrency): c for c in cases}
    j1, j50, s1, s32 = by["json", 1], by["json", 50], by["sse100", 1], by["sse100", 32]
    add50 = j1.proxied.latency_ms(0.5) - j1.direct.latency_ms(0.5)
    add99 = j1.proxied.latency_ms(0.99) - j1.direct.latency_ms(0.99)
    ev32 = s32.proxied.event_rate() / s32.direct.event_rate()
    ttfb1 = s1.proxied.ttfb_ms(0.5) - s1.direct.ttfb_ms(0.5)
    ttfb32 = s32.proxied.ttfb_ms(0.5) - s32.direct.ttfb_ms(0.5)
    events = sum(r.events for r in s32.proxied.results)
    cpu_ev = s32.proxied.cpu / events * 1e6 if events else float("nan")
    print()
    print("added by the proxy (proxied - direct):")
    for c in cases:
        extra = (f", TTFB p50 {c.proxied.ttfb_ms(0.5) - c.direct.ttfb_ms(0.5):+.2f} ms, "
                 f"events/s ratio {c.proxied.event_rate() / c.direct.event_rate():.2f}"
                 if c.kind == "sse100" else "")
        p50 = c.proxied.latency_ms(0.5) - c.direct.latency_ms(0.5)
        p99 = c.proxied.latency_ms(0.99) - c.direct.latency_ms(0.99)
        print(f"  {c.kind}@c{c.concurrency}: p50 {p50:+.2f} ms, p99 {p99:+.2f} ms, "
              f"req/s ratio {c.proxied.rate() / c.direct.rate():.2f}{extra}")
    per_req = [c.proxied.cpu / max(1, len(c.proxied.results)) * 1e6 for c in (j1, j50)]
    print(f"  proxy CPU per relayed SSE event at c=32: {cpu_ev:.1f} µs; "
          f"per JSON request at c=1: {per_req[0]:.0f} µs, at c=50: {per_req[1]:.0f} µs")
    print("  proxy CPU per request, main thread (Daphne's event loop) + other threads "
          "(activity writer, database): " + ", ".join(
              f"{c.kind}@c{c.concurrency} {c.proxied.cpu_main / n * 1e6:.0f} + "
              f"{(c.proxied.cpu - c.proxied.cpu_main) / n * 1e6:.0f} µs"
              for c in cases if (n := len(c.proxied.results))))
    errors = sum(c.direct.errors + c.proxied.errors for c in cases)
    print()
    print("goals (issue 9):")
    goal(add50 <= 1.0, f"added p50 latency at c=1: {add50:.2f} ms (goal ≤ 1 ms)")
    goal(add99 <= 5.0, f"added p99 latency at c=1: {add99:.2f} ms (goal ≤ 5 ms)")
    goal(ev32 >= 0.5, f"SSE event rate at c=32: {ev32:.0%} of direct (goal ≥ 50 %)")
    goal(ttfb1 <= 2.0, f"added TTFB p50 at c=1: {ttfb1:.2f} ms (goal ≤ 2 ms; at c=32: "
                       f"{ttfb32:+.2f} ms)")
    goal(errors == 0, f"errors: {errors} (goal 0)")
    for c in cases:
        if getattr(c, "profile", None):
            print()
            print(f"py-spy profile of the proxy, {c.kind}@c{c.concurrency} (own time):")
            for line in c.profile:
                print("  " + line)
    print("ratios: " + ", ".join(
        [f"json@c{c.concurrency} req/s={c.proxied.rate() / c.direct.rate():.2f}"
         for c in cases if c.kind == "json"]
        + [f"sse100@c{c.concurrency} events/s={c.proxied.event_rate() / c.direct.event_rate():.2f}"
           for c in cases if c.kind == "sse100"]
        + [f"added p50@c1={add50:+.2f} ms", f"added p99@c1={add99:+.2f} ms",
           f"added ttfb@c1={ttfb1:+.2f} ms"]))


def goal(ok: bool, text: str) -> None:
    print(f"  {'PASS' if ok else 'GAP '}  {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5,
                        help="length of one round on one side (default 1.5)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating rounds per side and case (default 4)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="record the proxy with py-spy into DIR during each proxied case")
    args = parser.parse_args()
    profiler = Profiler(args.profile)
    direct_port = free_port()
    fake = start_fake(direct_port)
    proxy = start_proxy(proxy_config())
    try:
        load_model(proxy, "solo")
        cases = asyncio.run(measure(proxy, direct_port, fake.pid, args.seconds, args.rounds,
                                    profiler))
    except BaseException:
        print(proxy.log_tail(), file=sys.stderr)
        raise
    finally:
        proxy.stop()
        fake.terminate()
        fake.wait()
    report(cases, args.seconds, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
