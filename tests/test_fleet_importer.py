"""Issue 24, item 2: with a shared database one source writes the definitions. The importer
node imports its `--config` as a single box does; any other node starts with the file the
database last imported and refuses a different one, naming the importer; a node takes over
when no serve of the importer runs (its instance lock is free), whatever its fleet row says;
SIGHUP on a non-importer imports nothing."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from activity.models import Node
from gpuproxy.management import importer_role
from gpuproxy.shell.instance import LOCK_KEY, node_key
from scheduling.models import ConfigImport, ModelDefinition, ProxySettings
from tests.conftest import FAKE, database_url, free_port
from tests.helpers import stop, until


def config(start: int, *models: str) -> str:
    return f"""
    startPort: {start}
    healthCheckTimeout: 15
    models:
    """ + "".join(f"""  {m}:
        cmd: {FAKE}
    """ for m in models)


def beat(node: str, age: float = 0.0, state: str = "running") -> None:
    at = timezone.now() - dt.timedelta(seconds=age)
    Node.objects.update_or_create(node=node, defaults={
        "heartbeat_at": at, "started_at": at, "pid": 1, "state": state})


def importer() -> str:
    value = ProxySettings.objects.values_list("importer_node", flat=True).first() or ""
    connection.close()  # the serves under test must not wait on this test's session
    return value


def hold_node_lock(node: str) -> psycopg.Connection:
    """A session holding `node`'s instance lock, as that node's running serve does (the key
    spelled out here, not taken from the code under test's query)."""
    conn = psycopg.connect(database_url(), autocommit=True)
    conn.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_KEY, node_key(node)])
    return conn


def model_ids() -> set[str]:
    found = set(ModelDefinition.objects.values_list("model_id", flat=True))
    connection.close()
    return found


# ---- the rule ----------------------------------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.django_db
def test_the_first_node_claims_the_role_and_keeps_it():
    role = importer_role.claim("gpu-a")
    assert (role.imports, role.importer, role.took_over) == (True, "gpu-a", False)
    assert "gpu-a is now the importer" in role.note
    assert ProxySettings.load().importer_node == "gpu-a"
    assert importer_role.claim("gpu-a") == importer_role.Role(True, "gpu-a")


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("row", [{}, {"state": "stopped"}, {"age": 60.0}, None])
def test_another_node_does_not_import_while_a_serve_of_the_importer_runs(row):
    """The importer's serve holds its node's lock from before its setup: its fleet row may
    still say stopped (its last run), down, or be absent (it never ran), and it runs."""
    ProxySettings.objects.update_or_create(pk=1, defaults={"importer_node": "gpu-a"})
    if row is not None:
        beat("gpu-a", **row)
    held = hold_node_lock("gpu-a")
    try:
        assert importer_role.claim("gpu-b") == importer_role.Role(False, "gpu-a")
    finally:
        held.close()
    assert ProxySettings.load().importer_node == "gpu-a"
    message = importer_role.refusal("gpu-b", "gpu-a", "/etc/c.yaml")
    assert "node gpu-a is the importer and a serve of it is running" in message


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize(("row", "said"), [
    ({}, "its fleet row says up"),
    ({"age": 60.0}, "its fleet row says down"),
    ({"state": "stopped"}, "its fleet row says stopped"),
    (None, "never seen in the fleet view"),
])
def test_a_node_takes_over_when_no_serve_of_the_importer_runs(row, said):
    """Its lock is free: no serve of it runs, whatever its last heartbeat said (a process
    killed a moment ago leaves an up row behind)."""
    ProxySettings.objects.update_or_create(pk=1, defaults={"importer_node": "gpu-a"})
    if row is not None:
        beat("gpu-a", **row)
    held = hold_node_lock("gpu-c")  # another node's lock says nothing of gpu-a
    try:
        role = importer_role.claim("gpu-b")
    finally:
        held.close()
    assert (role.imports, role.importer, role.took_over) == (True, "gpu-b", True)
    assert ("node gpu-b takes over importing the config from node gpu-a: no serve of gpu-a "
            "holds its node lock on this database" in role.note)
    assert said in role.note
    assert ProxySettings.load().importer_node == "gpu-b"


@pytest.mark.django_db
def test_admin_only_means_no_node_imports():
    ProxySettings.objects.update_or_create(pk=1, defaults={"importer_node": "-"})
    assert importer_role.claim("gpu-a") == importer_role.Role(False, "-")
    message = importer_role.refusal("gpu-a", "-", "/etc/c.yaml")
    assert "the admin alone writes the definitions" in message


@pytest.mark.django_db
def test_a_containers_new_host_name_takes_over_from_its_old_one():
    ProxySettings.objects.update_or_create(pk=1, defaults={"importer_node": "old-host"})
    role = importer_role.claim("new-host")  # a container's new host name, its old one gone
    assert role.imports and role.importer == "new-host" and role.took_over


# ---- real serves on one PostgreSQL database ----------------------------------------------------

def node_env(tmp_path: Path, node: str, extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": database_url(), "GPUPROXY_NODE": node,
            "GPUPROXY_DATA_DIR": str(tmp_path / f"data-{node}"), **(extra or {})}


def start_refused(tmp_path: Path, cfg: Path, node: str, workers: int,
                  extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A serve that must refuse to start: its exit and output."""
    env = node_env(tmp_path, node, extra_env)
    return subprocess.run(
        [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config", str(cfg),
         "--listen", f"127.0.0.1:{free_port()}", "--workers", str(workers)],
        capture_output=True, text=True, env=env, timeout=90, cwd=tmp_path)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_second_node_with_another_file_is_refused_and_with_the_same_one_starts(
        serve, tmp_path: Path, serve_workers: int):
    start = free_port()
    first = serve(config(start, "alpha"), {"GPUPROXY_NODE": "node-a"})
    until("node-a claims the role", lambda: importer() == "node-a", within=10)
    until("node-a is up", lambda: "node-a" in {n.node for n in Node.objects.all()}, within=10)
    connection.close()

    other = tmp_path / "other" / "config.yaml"
    other.parent.mkdir()
    other.write_text(textwrap.dedent(config(start, "alpha", "beta")))
    refused = start_refused(tmp_path, other, "node-b", serve_workers)
    assert refused.returncode != 0
    said = refused.stderr + refused.stdout
    assert "differs from the definitions in the database" in said
    assert "node node-a is the importer and a serve of it is running" in said
    assert "without --config" in said and "make node-b the importer in the admin" in said
    assert model_ids() == {"alpha"}  # nothing written
    assert importer() == "node-a"

    second = serve(config(start, "alpha"), {"GPUPROXY_NODE": "node-b",
                                            "GPUPROXY_DATA_DIR": str(tmp_path / "data-b")})
    assert "nothing written (this node, node-b, does not import: node node-a" in second.output()
    assert first.proc.poll() is None and importer() == "node-a"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_sighup_on_a_node_that_does_not_import_imports_nothing(serve, tmp_path: Path):
    start = free_port()
    text = config(start, "alpha")
    serve(text, {"GPUPROXY_NODE": "node-a"})
    until("node-a is up", lambda: "node-a" in {n.node for n in Node.objects.all()}, within=10)
    second = serve(text, {"GPUPROXY_NODE": "node-b",
                          "GPUPROXY_DATA_DIR": str(tmp_path / "data-b")})
    hash_before = ConfigImport.last().content_hash
    connection.close()

    (tmp_path / "config.yaml").write_text(textwrap.dedent(config(start, "alpha", "gamma")))
    second.proc.send_signal(signal.SIGHUP)
    until("node-b refuses the changed file",
          lambda: "SIGHUP: not imported" in second.output(), within=15)
    second.proc.send_signal(signal.SIGHUP)  # the same change again: the refusal said once
    until("node-b answers the second SIGHUP",
          lambda: "still differs from the definitions' last import" in second.output(),
          within=15)
    assert second.output().count("SIGHUP: not imported") == 1
    assert "node node-a is the importer and a serve of it is running" in second.output()
    assert model_ids() == {"alpha"}
    assert ConfigImport.last().content_hash == hash_before
    assert importer() == "node-a"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_node_takes_over_when_the_importer_is_down(serve, tmp_path: Path):
    start = free_port()
    first = serve(config(start, "alpha"), {"GPUPROXY_NODE": "node-a"})
    until("node-a claims the role", lambda: importer() == "node-a", within=10)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(30) == 0

    second = serve(config(start, "alpha", "beta"),
                   {"GPUPROXY_NODE": "node-b", "GPUPROXY_DATA_DIR": str(tmp_path / "data-b")})
    assert ("node node-b takes over importing the config from node node-a: no serve of node-a "
            "holds its node lock on this database (its fleet row says stopped)"
            in second.output())
    assert importer() == "node-b"
    assert model_ids() == {"alpha", "beta"}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_watch_config_on_a_node_that_does_not_import_refuses_each_change_once(
        serve, tmp_path: Path):
    start = free_port()
    text = config(start, "alpha")
    serve(text, {"GPUPROXY_NODE": "node-a"})
    until("node-a is up", lambda: "node-a" in {n.node for n in Node.objects.all()}, within=10)
    connection.close()
    second = serve(text, {"GPUPROXY_NODE": "node-b",
                          "GPUPROXY_DATA_DIR": str(tmp_path / "data-b")},
                   args=("-watch-config",))
    until("node-b watches its file", lambda: "-watch-config)" in second.output(), within=15)

    (tmp_path / "config.yaml").write_text(textwrap.dedent(config(start, "alpha", "gamma")))
    until("node-b refuses the change", lambda: "-watch-config: the file changed: not imported"
          in second.output(), within=15)
    assert model_ids() == {"alpha"}
    (tmp_path / "config.yaml").write_text(textwrap.dedent(config(start, "alpha", "delta")))
    until("node-b refuses the next change too", lambda: second.output().count(
        "-watch-config: the file changed: not imported") == 2, within=15)
    assert model_ids() == {"alpha"} and importer() == "node-a"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_with_the_fleet_view_off_another_file_is_still_refused(
        serve, tmp_path: Path, serve_workers: int):
    """GPUPROXY_FLEET_SECONDS=0: no node ever writes a heartbeat, and the importer runs."""
    start = free_port()
    off = {"GPUPROXY_FLEET_SECONDS": "0"}
    first = serve(config(start, "alpha"), {"GPUPROXY_NODE": "node-a", **off})
    assert importer() == "node-a"
    assert not Node.objects.exists()
    other = tmp_path / "other" / "config.yaml"
    other.parent.mkdir()
    other.write_text(textwrap.dedent(config(start, "alpha", "beta")))
    refused = start_refused(tmp_path, other, "node-b", serve_workers, off)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "node node-a is the importer" in refused.stderr + refused.stdout
    assert model_ids() == {"alpha"} and importer() == "node-a"
    assert first.proc.poll() is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_nodes_started_together_with_different_files_one_refuses(
        tmp_path: Path, serve_workers: int):
    """A fresh database, two serves started back to back (a rollout, a restart after a power
    cut): whichever imports first is the importer, and the other, which reaches its setup
    before the first has written any heartbeat, refuses its different file."""
    start = free_port()
    files = {"node-a": {"alpha"}, "node-b": {"alpha", "beta"}}
    procs: dict[str, tuple[subprocess.Popen, Path, str]] = {}
    try:
        for node, models in files.items():
            cfg = tmp_path / node / "config.yaml"
            cfg.parent.mkdir()
            cfg.write_text(textwrap.dedent(config(start, *sorted(models))))
            log = tmp_path / f"{node}.log"
            base = f"http://127.0.0.1:{free_port()}"
            procs[node] = (subprocess.Popen(
                [str(Path(sys.executable).with_name("gpuproxy")), "serve", "--config",
                 str(cfg), "--listen", base.removeprefix("http://"),
                 "--workers", str(serve_workers)],
                stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path,
                env=node_env(tmp_path, node, None)), log, base)

        def settled(node: str) -> bool:
            proc, log, base = procs[node]
            return proc.poll() is not None or f"listening on {base}" in log.read_text()

        until("both serves have started or refused", lambda: all(map(settled, files)),
              within=90)
        refused = [node for node, (proc, _, _) in procs.items() if proc.poll() is not None]
        said = {node: log.read_text() for node, (_, log, _) in procs.items()}
        assert len(refused) == 1, said
        loser, = refused
        winner, = set(files) - {loser}
        assert procs[loser][0].returncode != 0
        assert "differs from the definitions in the database" in said[loser]
        assert f"node {winner} is the importer" in said[loser]
        assert importer() == winner
        assert model_ids() == files[winner]
    finally:
        for proc, _, _ in procs.values():
            stop(proc)
