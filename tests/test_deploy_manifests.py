"""The shipped Kubernetes manifests (deploy/kubernetes/) and Prometheus examples
(deploy/prometheus/) against the code they describe: every YAML document parses with the
kind and apiVersion it must have; every environment variable set is one gpuproxy documents
(gpuproxy/settings.py's list), every Secret and ConfigMap referenced exists; the container
runs a command line `gpuproxy serve` accepts, with the config file the ConfigMap holds and
the config parsing as llama-swap YAML; the probes' path is our /health; the grace period
covers the drain; the pool, the Service and the route select the pods; the metric names the
endpoint picker is told to read are series we export; and promtool accepts the Prometheus
files (promtool missing fails, never skips: scripts/ensure-test-tools installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.urls import resolve

from gpuproxy.api import views
from gpuproxy.management.commands.serve import Command as Serve
from scheduling.llamaswap import parse_config

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
PROMETHEUS = ROOT / "deploy" / "prometheus"
NAMESPACE = "gpuproxy"

#: kind -> apiVersion, as each API serves it today.
KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Namespace": "v1",
    "Secret": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "DaemonSet": "apps/v1",
    "Cluster": "postgresql.cnpg.io/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}

#: Read from the settings module's docstring: the one documented list of variables.
DOCUMENTED = set(re.findall(r"^(GPUPROXY_[A-Z_]+|DATABASE_URL)\b",
                            (ROOT / "gpuproxy" / "settings.py").read_text(), re.M))


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def one(kind: str) -> dict[str, Any]:
    [doc] = [d for _, d in documents() if d["kind"] == kind]
    return doc


def container() -> dict[str, Any]:
    [c] = one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    return c


def env() -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container()["env"]}


def test_every_document_has_its_kind_api_version_and_namespace():
    docs = documents()
    assert sorted({d["kind"] for _, d in docs}) == sorted(KINDS)
    for name, doc in docs:
        assert doc["apiVersion"] == KINDS[doc["kind"]], (name, doc["kind"])
        if doc["kind"] not in ("Kustomization", "Namespace"):
            assert doc["metadata"]["namespace"] == NAMESPACE, (name, doc["kind"])
    assert one("Namespace")["metadata"]["name"] == NAMESPACE
    listed = one("Kustomization")["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBE.glob("*.yaml")
                                    if p.name != "kustomization.yaml")
    assert listed[0] == "namespace.yaml"


def test_every_variable_set_is_one_gpuproxy_reads():
    """A misspelt variable would be ignored without a word; POD_IP is only expanded into
    GPUPROXY_ADVERTISE by Kubernetes ($(POD_IP)), which the check requires."""
    assert {"GPUPROXY_NODE", "DATABASE_URL", "GPUPROXY_FLEET_SECONDS", "GPUPROXY_ADVERTISE",
            "GPUPROXY_FLEET_KEY", "GPUPROXY_FLEET_MARGIN"} <= DOCUMENTED
    variables = env()
    helpers = {n for n in variables
               if any(f"$({n})" in str(e.get("value", "")) for e in variables.values())}
    assert helpers == {"POD_IP"}
    assert set(variables) - helpers <= DOCUMENTED, set(variables) - helpers - DOCUMENTED
    assert variables["GPUPROXY_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert variables["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert variables["GPUPROXY_ADVERTISE"]["value"] == "http://$(POD_IP):8080"
    secret = one("Secret")
    for name in ("DATABASE_URL", "GPUPROXY_FLEET_KEY", "GPUPROXY_SECRET_KEY"):
        ref = variables[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        assert "value" not in variables[name]  # a secret never sits in the pod spec
    assert len(secret["stringData"]) == 3


#: What the downward API would give one pod.
NODE_NAME, POD_IP = "gpu-node-1", "10.244.1.7"
SETTINGS = """
import json, django
django.setup()
from django.conf import settings as s
print(json.dumps({"node": s.GPUPROXY_NODE, "advertise": s.GPUPROXY_ADVERTISE,
                  "margin": s.GPUPROXY_FLEET_MARGIN, "key": s.GPUPROXY_FLEET_KEY,
                  "secret": s.SECRET_KEY, "grace": s.GPUPROXY_SHUTDOWN_GRACE,
                  "hosts": s.GPUPROXY_ALLOWED_HOSTS, "engine": s.DATABASES["default"]["ENGINE"],
                  "trusted": [str(n) for n in s.GPUPROXY_TRUSTED_PROXIES]}))
"""


#: What a user puts in place of secret.yaml's `REPLACE-WITH-...` values (`openssl rand -hex 32`).
FILLED_IN = "0123456789abcdef" * 4


def pod_environment(edited: bool = True) -> dict[str, str]:
    """The container's environment as Kubernetes would make it: Secret keys read, the
    downward API's fields filled in, `$(VAR)` expanded from the variables before it.
    `edited`: the Secret's placeholders replaced, as the file says to before applying it."""
    secret = {k: FILLED_IN if edited and v.startswith("REPLACE-") else v
              for k, v in one("Secret")["stringData"].items()}
    fields = {"spec.nodeName": NODE_NAME, "status.podIP": POD_IP}
    made: dict[str, str] = {}
    for e in container()["env"]:
        if "value" in e:
            made[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: made[m.group(1)], e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            made[e["name"]] = secret[e["valueFrom"]["secretKeyRef"]["key"]]
        else:
            made[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return made


def read_settings(made: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "DJANGO_SETTINGS_MODULE": "gpuproxy.settings", **made}
    return subprocess.run([sys.executable, "-c", SETTINGS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_gpuproxy_accepts_the_pods_environment(tmp_path: Path):
    """The settings module, in a process of its own, with exactly the pod's variables: a
    value it refuses (a short fleet key, a bad CIDR, a margin it cannot read) stops here."""
    made = pod_environment()
    done = read_settings(made)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["node"] == NODE_NAME
    assert seen["advertise"].rstrip("/") == f"http://{POD_IP}:8080"
    assert seen["margin"] == 4 and seen["grace"] == 30
    assert seen["key"] == made["GPUPROXY_FLEET_KEY"]
    assert seen["secret"] == made["GPUPROXY_SECRET_KEY"]  # shared, never generated per pod
    assert seen["engine"].endswith(".postgresql")
    assert ".gpuproxy.svc.cluster.local" in seen["hosts"]
    # a Gateway passes the client's Host through: its public name must be allowed too
    assert any(not h.startswith("gpuproxy") and ".gpuproxy.svc" not in h
               for h in seen["hosts"]), seen["hosts"]
    assert seen["trusted"] == ["10.244.0.0/16"]


def test_the_secrets_placeholders_are_refused():
    """Applied unedited, secret.yaml would give every fleet the same published keys."""
    done = read_settings(pod_environment(edited=False))
    assert done.returncode != 0
    assert re.search(r"GPUPROXY_(SECRET|FLEET)_KEY is still the placeholder", done.stderr)
    assert "openssl rand -hex 32" in done.stderr
    assert "RANDOM" not in done.stderr  # the value itself is not repeated back


def test_the_command_is_a_serve_with_the_configmaps_file_and_the_pods_port():
    c = container()
    assert c["command"][:2] == ["gpuproxy", "serve"]
    options = Serve().create_parser("gpuproxy", "serve").parse_args(c["command"][2:])
    volumes = {v["name"]: v for v in one("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    config_dir, config_file = options.config.rsplit("/", 1)
    config_map = one("ConfigMap")
    assert volumes[mounts[config_dir]]["configMap"]["name"] == config_map["metadata"]["name"]
    parsed = parse_config(config_map["data"][config_file], {})
    assert {m.model_id for m in parsed.models} == {"qwen2.5-7b", "llama3.1-8b"}
    assert not parsed.warnings, parsed.warnings  # every key is one gpuproxy honours
    assert options.listen == "0.0.0.0:8080" and options.workers == 4
    [port] = c["ports"]
    assert port == {"name": "http", "containerPort": 8080, "protocol": "TCP"}
    assert mounts[env()["GPUPROXY_DATA_DIR"]["value"]] == "data"


def test_the_probes_ask_health_and_the_grace_period_covers_the_drain():
    c = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["port"] == "http"
        assert resolve(get["path"]).func is views.health, probe
    # one slow answer (a busy event loop, a GC pause) must not take a serving pod out
    ready = c["readinessProbe"]
    assert ready.get("timeoutSeconds", 1) >= 3 and ready.get("failureThreshold", 3) >= 2
    pod = one("DaemonSet")["spec"]["template"]["spec"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = int(env()["GPUPROXY_SHUTDOWN_GRACE_SECONDS"]["value"])
    stopped_write = 5  # Runtime.shutdown's bound on the fleet view's `stopped` row
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + grace + stopped_write
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nvidia.com/gpu" in c["resources"]["limits"]


def test_the_pool_the_service_and_the_route_reach_the_pods():
    labels = one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert one("DaemonSet")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one("Service")["spec"]["selector"].items() <= labels.items()
    assert one("Service")["spec"]["ports"][0]["targetPort"] == "http"
    pool = one("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"]["name"]
    [rule] = one("HTTPRoute")["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": pool["metadata"]["name"]}


def exported_series() -> set[str]:
    source = (ROOT / "gpuproxy" / "observe" / "metrics.py").read_text()
    return set(re.findall(r'"(gpuproxy_[a-z_]+)"', source))


def test_the_pickers_metric_names_are_series_we_export():
    text = (KUBE / "inferencepool.yaml").read_text()
    flags = dict(re.findall(r"--([a-z-]+-metric)=(\S*)", text))
    assert set(flags) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric", "lora-info-metric",
                          "cache-info-metric"}
    # in a container's args nothing strips quotes: `""` would be a series named `""`
    assert '""' not in flags.values()
    # the image is pinned to a picker that still has these flags (EPP v1.3 to v1.5)
    assert re.search(r"gateway-api-inference-extension/epp:v1\.[345]\.\d+\b", text)
    named = {re.sub(r"\{.*", "", v) for v in flags.values() if v}
    assert named == {"gpuproxy_queue_depth"}
    assert flags["total-queued-requests-metric"] == "gpuproxy_queue_depth{band=interactive}"
    assert named <= exported_series()
    docs = (ROOT / "docs" / "fleet.md").read_text()
    for series in named:
        assert f"`{series}" in docs, series


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: it comes with Debian's prometheus package, which "
                    "scripts/ensure-test-tools installs (apt-get install -y prometheus)")
    return found


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), "check", "config", str(path)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("name", ["prometheus.yml", "global.yml"])
def test_promtool_accepts_the_prometheus_examples(name):
    done = check_config(PROMETHEUS / name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_every_node_is_scraped_with_its_node_label_and_federated():
    site = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    [job] = site["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    nodes = [group["labels"]["node"] for group in job["static_configs"]]
    assert len(nodes) == len(set(nodes)) == 3
    assert "site" in site["global"]["external_labels"]
    central = yaml.safe_load((PROMETHEUS / "global.yml").read_text())
    [federate] = central["scrape_configs"]
    assert federate["metrics_path"] == "/federate" and federate["honor_labels"] is True
    assert federate["params"]["match[]"] == ['{job=~"gpuproxy.*"}']
    assert re.fullmatch(federate["params"]["match[]"][0].split('"')[1], job["job_name"])


def test_the_kubernetes_scrape_config(tmp_path: Path):
    """promtool checks it where its build has Kubernetes discovery; Debian's has not, so
    there the same file with the discovery block replaced by a static target is checked, and
    the block itself is checked here: pods of our namespace, `node` from the pod's node."""
    path = PROMETHEUS / "prometheus-kubernetes.yml"
    config = yaml.safe_load(path.read_text())
    [job] = config["scrape_configs"]
    [sd] = job["kubernetes_sd_configs"]
    assert sd == {"role": "pod", "namespaces": {"names": [NAMESPACE]}}
    relabel = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    labels = one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    keep = relabel[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]
    assert keep["action"] == "keep" and keep["regex"] == labels["app.kubernetes.io/name"]
    assert relabel[("__meta_kubernetes_pod_container_port_name",)]["regex"] == "http"
    assert relabel[("__meta_kubernetes_pod_node_name",)]["target_label"] == "node"
    done = check_config(path)
    without_kubernetes = "field kubernetes_sd_configs not found" in done.stdout + done.stderr
    if done.returncode != 0 and without_kubernetes:
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["10.244.1.7:8080"]}]
        swapped = tmp_path / "prometheus-kubernetes.yml"
        swapped.write_text(yaml.safe_dump(config))
        done = check_config(swapped)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_may_list_the_pods_it_discovers():
    """Pod discovery lists and watches pods: without a Role granting it in our namespace,
    Prometheus finds no target and says only `forbidden` in its own log."""
    docs = {d["kind"]: d for d in
            yaml.safe_load_all((PROMETHEUS / "prometheus-rbac.yaml").read_text())}
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding"}
    [rule] = docs["Role"]["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert {"list", "watch"} <= set(rule["verbs"])
    binding, account = docs["RoleBinding"], docs["ServiceAccount"]
    assert docs["Role"]["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": docs["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", **account["metadata"]}]
    scrape = yaml.safe_load((PROMETHEUS / "prometheus-kubernetes.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [NAMESPACE]
