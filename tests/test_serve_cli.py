"""`gpuproxy serve`'s command line as llama-swap's users call it: its single-dash flags, no
subcommand, `-version`; the config imported only when it changed; SIGHUP and `-watch-config`
re-importing it live; TLS. Real processes, real PostgreSQL, the fake upstream."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKE, database_url, free_port
from tests.helpers import one_model, running, until

pytestmark = pytest.mark.django_db(transaction=True)

GPUPROXY = str(Path(sys.executable).with_name("gpuproxy"))


def env_for(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url(),
            "GPUPROXY_DATA_DIR": str(tmp_path / "data")}


def listed(proxy, model: str | None = None) -> list[str] | dict:
    """The ids /v1/models lists, or one model's entry."""
    data = proxy.http.get("/v1/models").json()["data"]
    if model is None:
        return sorted(m["id"] for m in data)
    return next(m for m in data if m["id"] == model)


def stop(proxy) -> None:
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(60) == 0, proxy.output()


# ---- the command line --------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["-version"], ["--version"], ["serve", "-version"],
                                  ["serve", "--version"]])
def test_version_is_this_builds_in_llama_swaps_words(argv: list[str]):
    """Django's own `--version` says Django's version; llama-swap's users expect the
    product's, as `llama-swap -version` prints it."""
    out = subprocess.run([GPUPROXY, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"gpuproxy version: {metadata.version('gpuproxy')} ("), out
    assert ", built at " in out.stdout
    assert len(out.stdout.splitlines()) == 1


@pytest.mark.parametrize(("flags", "named"), [
    (["-config", "a.yaml", "-config-dir", "."], ["-config a.yaml", "-config-dir ."]),
    (["-tls-cert-file", "cert.pem"], ["-tls-cert-file", "-tls-key-file"]),
    (["-tls-key-file", "key.pem"], ["-tls-cert-file", "-tls-key-file"]),
    (["-watch-config"], ["-watch-config watches", "-config (or -config-dir)"]),
    (["-config-dir", "no-such-dir"], ["-config-dir no-such-dir"]),
])
def test_a_bad_combination_of_flags_names_them(tmp_path: Path, flags: list[str],
                                               named: list[str]):
    (tmp_path / "a.yaml").write_text("models: {}\n")
    out = subprocess.run([GPUPROXY, *flags], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env_for(tmp_path))
    assert out.returncode == 1
    for flag in named:
        assert flag in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_certificate_that_is_not_one_stops_the_start_naming_the_file(tmp_path: Path):
    cert, key = self_signed(tmp_path)
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    for flags, named in ((["-tls-cert-file", "bad.pem", "-tls-key-file", str(key)],
                          "-tls-cert-file bad.pem"),
                         (["-tls-cert-file", str(cert), "-tls-key-file", "bad.pem"],
                          "-tls-key-file bad.pem")):
        out = subprocess.run([GPUPROXY, "serve", "--workers", "1", *flags],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env=env_for(tmp_path))
        assert out.returncode == 1
        assert named in out.stderr, out.stderr


def launch(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"launch-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([GPUPROXY, *argv], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env_for(tmp_path), cwd=tmp_path)
    return proc, log


def healthy(proc: subprocess.Popen, log: Path, base: str, within: float = 60) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"it exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    until("it answers /health", up, within)


def ended(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def test_llama_swaps_own_command_line_runs_serve(tmp_path: Path, serve_workers: int):
    """What a llama-swap unit file runs: no subcommand, single-dash flags, `-flag=value`
    too, and `-listen :PORT` (every interface, as Go listens)."""
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(one_model(free_port())))
    proc, log = launch(tmp_path, [f"-config={config}", "-listen", f":{port}",
                                  "--workers", str(serve_workers)])
    try:
        healthy(proc, log, f"http://127.0.0.1:{port}")
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False)
        assert [m["id"] for m in r.json()["data"]] == ["solo"]
        # The supervisor of --workers N says so once every request process is ready, which
        # may be after one of them answered.
        until("it says it listens on every interface",
              lambda: f"listening on http://0.0.0.0:{port}" in log.read_text())
    finally:
        assert ended(proc) == 0, log.read_text()


def ignores(pid: int, signum: int) -> bool:
    """The kernel's word that `pid` ignores `signum` (SigIgn in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_sighup_during_the_start_does_not_end_it(tmp_path: Path, serve_workers: int):
    """A reload asked for while serve starts (ExecReload racing ExecStart, a watcher script)
    must not kill it: SIGHUP's default action ends a process, and the handler is only in
    place once the server runs. From gpuproxy's first line on it is ignored (the kernel says
    so); the supervisor of `--workers N` holds one for the scheduler process until that
    process can take it."""
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(one_model(free_port())))
    proc, log = launch(tmp_path, ["serve", "--config", str(config), "--listen",
                                  f"127.0.0.1:{port}", "--workers", str(serve_workers)])
    try:
        until("gpuproxy ignores SIGHUP while it starts",
              lambda: proc.poll() is not None or ignores(proc.pid, signal.SIGHUP))

        def up_despite_hangups() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"it exited with {proc.returncode}:\n{log.read_text()}")
            proc.send_signal(signal.SIGHUP)
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1,
                                 trust_env=False).status_code == 200
            except httpx.TransportError:
                return False

        until("it answers /health", up_despite_hangups, 60)
        proc.send_signal(signal.SIGHUP)
        until("a SIGHUP once it runs re-imports the config",
              lambda: "SIGHUP: re-importing" in log.read_text())
        assert proc.poll() is None
    finally:
        assert ended(proc) == 0, log.read_text()


# ---- the config: imported when it changed, and again on SIGHUP or -watch-config ------------

def two_models(start: int, cmd_flag: str = "") -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
      solo:
        cmd: {FAKE} {cmd_flag}
        description: from the file
      second:
        cmd: {FAKE}
    """


def test_sighup_applies_the_edited_config_live(serve, tmp_path: Path):
    """A model added is listed; a model whose command changed restarts (once idle, and it
    is idle); the process stays up and the log names each change."""
    start = free_port()
    proxy = serve(one_model(start), {"GPUPROXY_RELOAD_SECONDS": "3600"})
    assert proxy.http.post("/api/models/load/solo").status_code == 200
    first_pid = running(proxy)["solo"]["pid"]

    (tmp_path / "config.yaml").write_text(textwrap.dedent(two_models(start, "--load-seconds 0")))
    proxy.proc.send_signal(signal.SIGHUP)
    until("/v1/models lists the model added", lambda: listed(proxy) == ["second", "solo"])
    until("solo restarts with its new command",
          lambda: running(proxy).get("solo", {}).get("pid") not in (None, first_pid)
          and running(proxy)["solo"]["state"] == "ready")
    log = proxy.output()
    assert "SIGHUP: re-importing" in log
    assert "model 'second' added" in log, log
    assert "model 'solo': cmd" in log, log
    assert proxy.proc.poll() is None

    proxy.proc.send_signal(signal.SIGHUP)  # the same file again
    until("the log says nothing changed", lambda: "unchanged since the last import; "
          "nothing to apply" in proxy.output())
    assert proxy.proc.poll() is None


def test_sighup_with_a_broken_file_keeps_the_running_config(serve, tmp_path: Path):
    start = free_port()
    proxy = serve(one_model(start))
    (tmp_path / "config.yaml").write_text("models:\n  solo: [not, a, model\n")
    proxy.proc.send_signal(signal.SIGHUP)
    until("the log names the error", lambda: "was not applied" in proxy.output())
    assert "the running config is kept" in proxy.output()
    assert proxy.proc.poll() is None
    assert listed(proxy) == ["solo"]
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text

    # Fixed, and signalled again: applied.
    (tmp_path / "config.yaml").write_text(textwrap.dedent(two_models(start)))
    proxy.proc.send_signal(signal.SIGHUP)
    until("/v1/models lists the model added", lambda: listed(proxy) == ["second", "solo"])


def test_sighup_without_a_config_rereads_the_database(serve, serve_workers: int,
                                                      tmp_path: Path):
    """Serve started without -config has no file to re-import: SIGHUP re-reads the
    definitions, for an edit made behind Django's back (no save signal, no NOTIFY)."""
    from django.db import connection

    stop(serve(one_model(free_port())))  # the definitions, imported once
    port = free_port()
    proc, log = launch(tmp_path, ["serve", "--listen", f"127.0.0.1:{port}", "--workers",
                                  str(serve_workers)])
    try:
        healthy(proc, log, f"http://127.0.0.1:{port}")
        with connection.cursor() as cursor:
            cursor.execute("UPDATE scheduling_modeldefinition SET description = 'behind its "
                           "back' WHERE model_id = 'solo'")
        proc.send_signal(signal.SIGHUP)

        def described() -> set[str]:
            return {httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False)
                    .json()["data"][0].get("description") for _ in range(4)}

        until("every process lists the new description",
              lambda: described() == {"behind its back"})
        assert "SIGHUP: re-reading the model definitions" in log.read_text()
        assert "re-importing" not in log.read_text()
    finally:
        assert ended(proc) == 0, log.read_text()


def test_watch_config_applies_an_edit_without_a_signal(serve, tmp_path: Path):
    start = free_port()
    proxy = serve(one_model(start), {"GPUPROXY_RELOAD_SECONDS": "3600"},
                  args=("-watch-config",))
    until("it says it watches the file",  # once the runtime is up, maybe after /health
          lambda: "for changes (every 2 s, -watch-config)" in proxy.output())
    (tmp_path / "config.yaml").write_text(textwrap.dedent(two_models(start)))
    until("/v1/models lists the model added", lambda: listed(proxy) == ["second", "solo"],
          within=30)
    until("the log says why and what changed", lambda: "-watch-config: the file changed"
          in proxy.output() and "model 'second' added" in proxy.output())


def test_an_admin_edit_survives_a_restart_until_the_file_changes_or_is_forced(
        serve, tmp_path: Path):
    """Importing at every start would wipe what was edited in the admin since: only a
    changed file, or --force-import, replaces it."""
    from scheduling.models import ModelDefinition

    start = free_port()
    config = two_models(start)

    def edit_in_the_admin() -> None:
        model = ModelDefinition.objects.get(model_id="solo")
        model.description = "edited in the admin"
        model.save()

    stop(serve(config))
    edit_in_the_admin()
    proxy = serve(config)  # the same file
    assert listed(proxy, "solo")["description"] == "edited in the admin"
    assert "unchanged since the last import" in proxy.output()
    stop(proxy)

    proxy = serve(config, args=("--force-import",))
    assert listed(proxy, "solo")["description"] == "from the file"
    stop(proxy)

    edit_in_the_admin()
    proxy = serve(config.replace("from the file", "from the file, edited"))
    assert listed(proxy, "solo")["description"] == "from the file, edited"


# ---- TLS ---------------------------------------------------------------------------------

def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA, and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuproxy test")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = where / "cert.pem", where / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_tls_serves_https_and_refuses_plain_http(serve, tmp_path: Path):
    cert, key = self_signed(tmp_path)
    proxy = serve(one_model(free_port()), args=("-tls-cert-file", str(cert),
                                                "-tls-key-file", str(key)), https_ca=cert)
    assert proxy.base.startswith("https://")
    r = proxy.http.post("/v1/chat/completions", json={
        "model": "solo", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    plain = proxy.base.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(plain + "/health", trust_env=False, timeout=10)
    assert proxy.http.get("/health").status_code == 200  # the refusal hurt nothing
