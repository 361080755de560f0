"""The Grafana dashboard and the alerting rules name only series a real proxy exports.

`docs/grafana/gpuproxy.json` and `docs/prometheus/gpuproxy-alerts.yml` are written against
`docs/metrics.md`. A renamed or forgotten series would leave a panel empty or an alert silent
without any error, so the names are checked against what a real `gpuproxy serve` process
answers on `/metrics` after serving one request, never against a list kept in this file.
`promtool` (Debian's `prometheus` package) checks the rules and the dashboard's PromQL.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FAKE, free_port
from tests.helpers import tool

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "gpuproxy.json"
RULES = ROOT / "docs" / "prometheus" / "gpuproxy-alerts.yml"
DOC = ROOT / "docs" / "metrics.md"

KEY = "metrics-docs-test-key"

# ---- metric names out of PromQL ---------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
# {label="value", ...}: label names and values are not metric names
_MATCHERS = re.compile(r"\{[^{}]*\}")
# by (...), without (...), on (...), ignoring (...), group_left (...): label names only
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# a whole identifier (possessive: no backtracking into a shorter prefix), not a function call
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(?:gpuproxy|django)_[a-z0-9_]++(?![A-Za-z0-9_:]|\s*\()")


def metric_names(expr: str) -> set[str]:
    """The `gpuproxy_*` and `django_*` series an expression selects."""
    expr = _STRING.sub('""', expr)
    expr = _MATCHERS.sub("", expr)
    expr = _GROUPING.sub("", expr)
    return set(_NAME.findall(expr))


def test_metric_names_skips_labels_strings_and_functions() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, gpuproxy_label) (rate('
            'gpuproxy_queue_wait_seconds_bucket{band="gpuproxy_value", gpuproxy_x=~"$model"}[5m])))'
            ' / on (instance) group_left (gpuproxy_other) max without (core) '
            '(gpuproxy_cpu_util_percent) + django_http_requests_total_by_method_total'
            ' + my_gpuproxy_thing + gpuproxy_Mixed')
    assert metric_names(expr) == {
        "gpuproxy_queue_wait_seconds_bucket", "gpuproxy_cpu_util_percent",
        "django_http_requests_total_by_method_total"}
    assert metric_names("max(gpuproxy_a) by (gpuproxy_b) > 3") == {"gpuproxy_a"}


# ---- the artefacts ----------------------------------------------------------------------------


def dashboard_panels() -> list[dict]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every templating query."""
    dash = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p.get('title')!r}", t["expr"])
             for p in dashboard_panels() for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            found.append((f"variable {var['name']!r}", query))
    return found


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def documented_names() -> set[str]:
    """Backticked series names in the first column of docs/metrics.md's tables."""
    names = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("|"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`(gpuproxy_[a-z0-9_]+)`", first_cell))
    return names


def test_dashboard_is_importable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["model"]["definition"] == "label_values(gpuproxy_model_state, model)"
    panels = dashboard_panels()
    assert len(panels) >= 20
    assert len({p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]}) == len(
        dash["panels"])
    for panel in panels:
        title = panel.get("title")
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", title
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, title
        assert any(t.get("expr", "").strip() for t in panel.get("targets", [])), title
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", title
            assert metric_names(t["expr"]), f"{title}: {t['expr']} names no series"


def test_rules_file_is_the_documented_block() -> None:
    all_rules = rules()
    assert len(all_rules) >= 6
    for rule in all_rules:
        assert rule["alert"] and rule["expr"], rule
        assert metric_names(rule["expr"]), rule
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    documented = [yaml.safe_load(b) for b in blocks if b.startswith("groups:")]
    assert documented == [yaml.safe_load(RULES.read_text())], \
        "docs/metrics.md's rules block and docs/prometheus/gpuproxy-alerts.yml differ"


def _promtool() -> str:
    return tool("promtool", "prometheus")


def test_promtool_accepts_the_rules_and_the_dashboard_queries(tmp_path: Path) -> None:
    promtool = _promtool()
    r = subprocess.run([promtool, "check", "rules", str(RULES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    # The dashboard's queries as recording rules, Grafana's variables replaced by values.
    substitutions = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
                     "$instance": ".*", "$model": ".*"}
    recorded = []
    for n, (where, expr) in enumerate(dashboard_exprs()):
        if expr.startswith("label_values("):
            continue
        for var, value in substitutions.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: unknown variable in {expr}"
        recorded.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- what a real proxy exports ----------------------------------------------------------------


def exported_names(text: str) -> tuple[set[str], dict[str, str]]:
    """(series names a PromQL selector can use, family name -> type) of a /metrics body.

    The parser names a counter family without `_total` (family `gpuproxy_dispatched`, samples
    `gpuproxy_dispatched_total`) and a histogram family without `_bucket/_sum/_count`. A
    labelled family with no child yet renders only its HELP and TYPE lines, so it has no
    sample; it still counts, with the names its samples will have."""
    names: set[str] = set()
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        elif family.type == "summary":
            names.update(family.name + s for s in ("", "_sum", "_count"))
        else:
            names.add(family.name)
    return names, types


def _has_sample(text: str, name: str, **labels: str) -> bool:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return True
    return False


@pytest.mark.django_db(transaction=True)
def test_dashboard_and_rules_use_only_exported_series(serve) -> None:
    proxy = serve(f"""
    startPort: {free_port()}
    healthCheckTimeout: 15
    apiKeys: [{KEY}]
    performance:
      every: 1s
    models:
      chat:
        cmd: {FAKE}
    """)
    auth = {"Authorization": f"Bearer {KEY}"}

    # the scrape_config of docs/metrics.md: a key is needed when keys exist, as a bearer token
    assert proxy.http.get("/metrics").status_code == 401

    # one request through a swap, so the request, token, swap and wait histograms get samples
    r = proxy.http.post("/v1/chat/completions", headers=auth, json={
        "model": "chat", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text

    # The request is counted just after its last byte, and the performance monitor samples
    # in the background: wait for both (or the deadline, and then report what is missing).
    deadline = time.monotonic() + 30
    while True:
        r = proxy.http.get("/metrics", headers=auth)
        assert r.status_code == 200, r.text
        text = r.text
        ready = (_has_sample(text, "gpuproxy_requests_total", model="chat", outcome="ok")
                 and _has_sample(text, "gpuproxy_cpu_util_percent")
                 and _has_sample(text, "gpuproxy_network_bytes_total"))
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    exported, types = exported_names(text)
    assert _has_sample(text, "gpuproxy_requests_total", model="chat", outcome="ok"), text

    # The test machine has no GPU, so the gpuproxy_gpu_* series are not exported here. They
    # are accepted only when docs/metrics.md's tables list them (the contract with the
    # performance monitor), and that list is read from the doc, not written here.
    gpu_documented = {n for n in documented_names() if n.startswith("gpuproxy_gpu_")}
    assert len(gpu_documented) == 8, gpu_documented

    def missing(names: set[str]) -> set[str]:
        return {n for n in names if n not in exported
                and not (n.startswith("gpuproxy_gpu_") and n in gpu_documented)}

    problems = []
    for where, expr in dashboard_exprs():
        if absent := missing(metric_names(expr)):
            problems.append(f"dashboard {where}: {sorted(absent)} not exported ({expr})")
    for rule in rules():
        if absent := missing(metric_names(rule["expr"])):
            problems.append(f"rule {rule['alert']}: {sorted(absent)} not exported")

    # and the other way round: every gpuproxy_* series the proxy exports is documented
    documented = documented_names()
    for name, kind in types.items():
        if not name.startswith("gpuproxy_"):
            continue
        base = name.removesuffix("_created")
        if name != base and types.get(base) in ("counter", "histogram", "summary"):
            continue  # prometheus_client's creation timestamp of a counter or histogram
        series = name + "_total" if kind == "counter" else name
        if series not in documented:
            problems.append(f"exported {series} ({kind}) is not in docs/metrics.md's tables")

    assert not problems, "\n".join(problems)
