"""The Kubernetes side (deploy/): the Helm chart lints strictly and renders, with each set of values,
manifests that pass strict schema validation (core kinds: kubernetes-validate; KServe, KEDA,
Prometheus Operator and InferencePool CRs: crd-validate against the real CRDs), and a misspelt field
fails. The Grafana dashboards (deploy/grafana = the chart's dashboards/) are well-formed dashboard JSON
and ship, byte for byte, in the chart's ConfigMap. Then the rendered Deployment and the KServe runtime
are held against a live `pier serve` started with their arguments: every probe answers as the probe
expects on a port Pier listens on, and every metric name in every PromQL expression shipped (rules,
triggers, adapter, dashboard panels and variables) is one Pier exports; a real Prometheus scraping it
returns data for each of those queries.

Needs helm, kubernetes-validate and crd-validate (the reference tools' k8s/install.sh makes them:
PIER_REFERENCE_TOOLS); skips with that reason without them."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.conftest import EXAMPLE_REPO, ROOT, free_port, start_pier

CHART = ROOT / "deploy" / "helm" / "pier"
KSERVE = ROOT / "deploy" / "kserve"
DASHBOARDS = CHART / "dashboards"  # Helm reads only files inside the chart: deploy/grafana links here
GRAFANA = ROOT / "deploy" / "grafana"
VALUES = {
    "default": [],
    "gpu": ["--set", "gpus=1", "--set", "image.repository=pier-gpu"],
    "llm": ["--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"],
    "keda": ["--set", "autoscaling.keda.enabled=true"],
    "hpa": ["--set", "autoscaling.hpa.enabled=true", "--set", "guards.apiKeysSecret=pier-keys",
            "--set", "guards.rateLimitModel={20:40}"],
    "grafana": ["--set", "grafana.dashboards.enabled=true",
                "--set", "grafana.dashboards.annotations.grafana_folder=Pier"],
    "gateway": ["--set-json", 'podLabels={"llm-d.ai/engine-type": "vllm", "pier.dev/pool": "chat"}'],
}
# The live server: `simple` rate-limited (so that pier_rate_limited_requests_total exists) and Triton's
# latency summaries on (the serving dashboard's p50 / p99 panel), both through the chart's values.
LIVE_VALUES = ["--set-json", 'guards.rateLimitModel=["simple=1:4"]',
               "--set-json", 'args=["--metrics-config=summary_latencies=true"]']


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    found = {name: shutil.which(name) or str(Path.home() / "opt/k8s-tools/bin" / name)
             for name in ("helm", "kubernetes-validate", "crd-validate")}
    if all(Path(p).is_file() for p in found.values()):
        return found
    install = Path(os.environ.get("PIER_REFERENCE_TOOLS", "/nonexistent")) / "k8s" / "install.sh"
    if not install.is_file():
        if Path(found["helm"]).is_file() and Path(found["kubernetes-validate"]).is_file():
            # scripts/install_deploy_tools.sh (CI) without the reference CRDs: all but crd-validate
            return {**found, "crd-validate": ""}
        pytest.skip("helm / kubernetes-validate / crd-validate are not installed and PIER_REFERENCE_TOOLS has no "
                    "k8s/install.sh to make them")
    target = tmp_path_factory.mktemp("k8s-tools")
    out = subprocess.run(["bash", str(install), str(target)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip(f"the k8s tools did not install: {out.stderr[-500:]}")
    return {name: str(target / "bin" / name) for name in found}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def _render(tools, *values: str) -> str:
    out = _run([tools["helm"], "template", "t", str(CHART), *values])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chart_lints_and_every_rendering_validates(tools, tmp_path: Path) -> None:
    lint = _run([tools["helm"], "lint", "--strict", str(CHART)])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for name, values in VALUES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(_render(tools, *values))
        core = _run([tools["kubernetes-validate"], "--strict", "-k", "1.35.0", str(path)])
        assert core.returncode == 0 and "ERROR" not in core.stdout + core.stderr, (name, core.stdout, core.stderr)
        if tools["crd-validate"]:
            crs = _run([tools["crd-validate"], str(path)])
            assert crs.returncode == 0, (name, crs.stdout, crs.stderr)
    # the LLMs degrade at 90 % of their KV cache by default (the chart's llm values); 0 turns it off
    flag = "--backend-config=llm,kv_cache_degrade_threshold=0.9"
    assert flag in _render(tools) and flag not in _render(tools, "--set", "llm.kvCacheDegradeThreshold=0")
    assert _run([tools["helm"], "template", "t", str(CHART), "--set", "llm.kvCacheDegradeThreshold=1.5"]).returncode
    # a misspelt field fails: in a values override, and in a core kind
    assert _run([tools["helm"], "template", "t", str(CHART), "--set", "image.tagg=x"]).returncode != 0
    deploy = tmp_path / "bad-deploy.yaml"
    deploy.write_text(_render(tools).replace("readinessProbe", "readynessProbe"))
    assert _run([tools["kubernetes-validate"], "--strict", "-k", "1.35.0", str(deploy)]).returncode != 0
    if not tools["crd-validate"]:
        pytest.skip("crd-validate needs the reference CRDs (PIER_REFERENCE_TOOLS names them): the chart "
                    "linted and its core kinds validated; custom resources not validated")
    crs = _run([tools["crd-validate"], *map(str, sorted(KSERVE.glob("*.yaml")))])
    assert crs.returncode == 0 and crs.stdout.count("ok ") == len(list(KSERVE.glob("*.yaml"))), crs.stdout
    bad = tmp_path / "bad.yaml"  # and in a custom resource
    bad.write_text((KSERVE / "inferenceservice-v2.yaml").read_text().replace("storageUri", "storageURI"))
    assert _run([tools["crd-validate"], str(bad)]).returncode != 0


def test_the_multi_machine_manifests_validate(tools, tmp_path: Path) -> None:
    """deploy/multinode (docs/llm.md "Several machines"): the StatefulSet variant strictly, and the
    LeaderWorkerSet's leader and worker pod templates as Pods (no LWS CRD offline), each running
    the `pier` commands that exist: `serve` on rank 0, `tp-worker` on the others."""
    folder = ROOT / "deploy" / "multinode"
    docs = [tmp_path / "statefulset.yaml"]
    docs[0].write_text((folder / "statefulset.yaml").read_text())
    lws = yaml.safe_load((folder / "leaderworkerset.yaml").read_text())
    template = lws["spec"]["leaderWorkerTemplate"]
    assert lws["kind"] == "LeaderWorkerSet" and template["size"] == 2
    for role in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()}, "spec": template[role]["spec"]}
        docs.append(tmp_path / f"{role}.yaml")
        docs[-1].write_text(yaml.safe_dump(pod))
    assert [c["command"] for r in ("leaderTemplate", "workerTemplate") for c in template[r]["spec"]["containers"]] \
        == [["pier", "serve"], ["pier", "tp-worker"]]  # the image's entrypoint is `pier serve`: said in full
    out = _run([tools["kubernetes-validate"], "--strict", "-k", "1.35.0", *map(str, docs)])
    assert out.returncode == 0 and "ERROR" not in out.stdout + out.stderr, (out.stdout, out.stderr)
    from pier.cli import build_parser  # the commands the manifests run parse

    build_parser().parse_args(["tp-worker", "--master-port=29501"])
    build_parser().parse_args(["tp-worker", "--master-addr=pier-llm-0.pier-llm", "--master-port=29501", "--rank=1"])


def test_rolling_updates_keep_capacity(tools) -> None:
    """A new pod is ready before an old one goes (maxUnavailable 0), unless the values say otherwise."""
    deploy = next(d for d in _docs(_render(tools)) if d["kind"] == "Deployment")
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    gpu = next(d for d in _docs(_render(tools, "--set", "rollingUpdate.maxSurge=0", "--set",
                                        "rollingUpdate.maxUnavailable=1")) if d["kind"] == "Deployment")
    assert gpu["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert _run([tools["helm"], "template", "t", str(CHART), "--set", "rollingUpdate.maxSurg=1"]).returncode != 0


def test_pod_labels_for_inference_gateways(tools) -> None:
    """podLabels reach the pods (an InferencePool selects them, llm-d reads llm-d.ai/engine-type),
    not the Deployment's selector, which must not change under a running release."""
    deploy = next(d for d in _docs(_render(tools, *VALUES["gateway"])) if d["kind"] == "Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert labels["llm-d.ai/engine-type"] == "vllm" and labels["pier.dev/pool"] == "chat"
    assert "llm-d.ai/engine-type" not in deploy["spec"]["selector"]["matchLabels"]
    assert _run([tools["helm"], "template", "t", str(CHART), "--set-string", "podLabels.a=1"]).returncode == 0
    assert _run([tools["helm"], "template", "t", str(CHART), "--set-json", 'podLabels={"a": 1}']).returncode != 0


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _promql(tools) -> list[str]:
    """Every PromQL expression shipped: the PrometheusRule, the KEDA triggers, the adapter rules,
    the KServe KEDA example."""
    exprs: list[str] = []
    for doc in _docs(_render(tools, *VALUES["llm"], *VALUES["keda"])):
        if doc["kind"] == "PrometheusRule":
            exprs += [r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]]
        if doc["kind"] == "ScaledObject":
            exprs += [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
    adapter = yaml.safe_load((ROOT / "deploy" / "prometheus-adapter" / "rules.yaml").read_text())
    exprs += [r["metricsQuery"] for r in adapter["rules"]["custom"]]
    keda = yaml.safe_load((KSERVE / "inferenceservice-keda.yaml").read_text())
    exprs += [m["external"]["metric"]["query"] for m in keda["spec"]["predictor"]["autoScaling"]["metrics"]]
    return exprs


_KEYWORDS = {"and", "or", "unless", "bool", "on", "ignoring", "group_left", "group_right", "by", "without", "offset",
             "inf", "nan"}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (followed by
    `(`), keywords, label names (inside `{}` or `by (...)`), strings, durations or numbers."""
    bare = re.sub(r"<<[^>]*>>", "", expr)  # prometheus-adapter's templates
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', bare)  # strings (label values, Grafana variables in them)
    bare = re.sub(r"\{[^}]*\}", "{}", bare)  # label matchers
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range / subquery durations
    names = re.findall(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", bare)
    return set(names) - _KEYWORDS


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _panels(board: dict) -> list[dict]:
    return [q for p in board["panels"] for q in (p, *p.get("panels", []))]


def _variable_query(var: dict) -> str:
    q = var["query"]
    return q["query"] if isinstance(q, dict) else q


def _label_values(query: str) -> tuple[str, str]:
    """label_values(SELECTOR, LABEL) -> (SELECTOR, LABEL): a Grafana query variable."""
    m = re.fullmatch(r"\s*label_values\((.+),\s*([a-zA-Z_]\w*)\s*\)\s*", query)
    assert m, query
    return m[1], m[2]


def _substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variables as Grafana would expand them: $__rate_interval and $__interval a minute,
    template variables ($x, ${x}, [[x]]) their values (a regex alternation for multi-value ones)."""
    expr = re.sub(r"\$__(rate_)?interval\b", "1m", expr)
    for name, value in values.items():
        expr = re.sub(rf"\$\{{{name}\}}|\${name}\b|\[\[{name}\]\]", value.replace("\\", r"\\"), expr)
    assert "$" not in expr, expr
    return expr


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expr) for every panel target and (dashboard, "$var", series selector) for
    every query variable."""
    out = []
    for name, board in _dashboards().items():
        out += [(name, f"${v['name']}", _label_values(_variable_query(v))[0]) for v in board["templating"]["list"]
                if v["type"] == "query"]
        out += [(name, p["title"], t["expr"]) for p in _panels(board) for t in p.get("targets", [])]
    return out


def test_dashboards_are_grafana_json_and_ship_in_the_chart(tools, tmp_path: Path) -> None:
    """Each dashboard: a uid, a title, schemaVersion ~39, a Prometheus datasource variable that every
    panel and target uses, query variables from label_values, timeseries / stat / gauge panels with
    unique ids on a grid without overlaps, every selector scoped to $job; deploy/grafana holds the
    same files; the chart's ConfigMap (off by default) carries them unchanged for Grafana's sidecar."""
    boards = _dashboards()
    assert set(boards) == {"pier-serving.json", "pier-llm.json"}
    assert sorted(p.name for p in GRAFANA.glob("*.json")) == sorted(boards)
    for p in GRAFANA.glob("*.json"):
        assert p.read_bytes() == (DASHBOARDS / p.name).read_bytes(), p
    assert len({b["uid"] for b in boards.values()}) == len({b["title"] for b in boards.values()}) == len(boards)
    ds = {"type": "prometheus", "uid": "${datasource}"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    kv_alert = values["metrics"]["prometheusRule"]["kvCacheUsageAlert"]
    kv_degrade = values["llm"]["kvCacheDegradeThreshold"]  # the LLMs degrade above the alert: it warns first
    assert 0 < kv_alert < kv_degrade <= 1
    for name, board in boards.items():
        assert re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"]) and board["title"], name
        assert 36 <= board["schemaVersion"] <= 41 and board["id"] is None, name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert variables["model"]["type"] == "query"
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"] == ds and v["definition"] == _variable_query(v), (name, v["name"])
                _label_values(_variable_query(v))
        ids: set[int] = set()
        cells: set[tuple[int, int]] = set()
        for panel in _panels(board):
            assert panel["id"] not in ids, (name, panel["id"])
            ids.add(panel["id"])
            g = panel["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, (name, panel["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, (name, panel["title"], "overlaps")
            cells |= mine
            if panel["type"] == "row":
                continue
            assert panel["type"] in {"timeseries", "stat", "gauge"}, (name, panel["title"])
            assert panel["datasource"] == ds and panel["targets"] and panel["title"], (name, panel["title"])
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), (name, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"] == ds and t["expr"], (name, panel["title"])
                for metric in _metric_names(t["expr"]):  # every selector scoped to Pier's scrape jobs
                    for m in re.finditer(rf"(?<![\w:]){re.escape(metric)}(?![\w:])(\{{[^}}]*\}})?", t["expr"]):
                        assert m[1] and 'job=~"$job"' in m[1], (name, panel["title"], t["expr"])
            if any("vllm:kv_cache_usage_perc" in t["expr"] for t in panel["targets"]):  # the alert and degrading
                steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
                assert {kv_alert, kv_degrade} <= {s["value"] for s in steps}, (name, panel["title"], steps)
    # the chart: no ConfigMap by default; with grafana.dashboards.enabled, one that holds the files as they are
    assert not [d for d in _docs(_render(tools)) if d["kind"] == "ConfigMap"]
    (cm,) = [d for d in _docs(_render(tools, *VALUES["grafana"])) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Pier"}
    assert cm["data"] == {p.name: p.read_text() for p in sorted(DASHBOARDS.glob("*.json"))}
    package = _run([tools["helm"], "package", str(CHART), "-d", str(tmp_path)])
    assert package.returncode == 0, package.stdout + package.stderr
    (tgz,) = tmp_path.glob("pier-*.tgz")
    with tarfile.open(tgz) as tar:
        assert {f"pier/dashboards/{n}" for n in boards} <= set(tar.getnames())


_BODY = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                    for n in ("INPUT0", "INPUT1")]}


def _traffic(server) -> None:
    """A few requests to both models: three to `simple` (waiting out its rate limit), one to the LLM."""
    for _ in range(3):
        for _attempt in range(10):
            r = requests.post(f"{server.base()}/v2/models/simple/infer", json=_BODY, timeout=30)
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("Retry-After", "1")))
        assert r.status_code == 200, r.text
    r = requests.post(f"{server.base()}/v1/completions", json={"model": "tiny_llm", "prompt": "x", "max_tokens": 2},
                      timeout=60)
    assert r.status_code == 200, r.text


def _exported(server) -> set[str]:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    return exported | {n.rsplit("_", 1)[0] for n in exported if n.endswith(("_total", "_bucket", "_count", "_sum"))}


@pytest.fixture(scope="module")
def live(tools, tmp_path_factory: pytest.TempPathFactory):
    """A `pier serve` started with the rendered Deployment's arguments (its ports free ones), serving
    `simple` and a tiny LLM, after some traffic to both."""
    from tests.backends.llm.tiny_model import build_model

    tmp = tmp_path_factory.mktemp("live")
    repo = tmp / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    build_model(repo / "tiny_llm" / "1", "llama")
    (repo / "tiny_llm" / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "4000000" } }\n')
    http, grpc, metrics = free_port(), free_port(), free_port()
    (deployment,) = [d for d in _docs(_render(tools, "--set", f"ports.http={http}", "--set", f"ports.grpc={grpc}",
                                              "--set", f"ports.metrics={metrics}", *LIVE_VALUES))
                     if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in container["args"] if not a.startswith(("--model-repository", "--http-port", "--grpc-port",
                                                              "--metrics-port"))]
    server = start_pier([repo], *args, log_path=tmp / "pier.log", timeout=120, ports=(http, grpc, metrics))
    _traffic(server)
    # past the rate limit (4 at once, then 1/s): refused requests
    codes = [requests.post(f"{server.base()}/v2/models/simple/infer", json=_BODY, timeout=30).status_code
             for _ in range(6)]
    assert 429 in codes and set(codes) <= {200, 429}, codes
    yield server, container, {"http": http, "grpc": grpc, "metrics": metrics}
    assert server.stop() == 0


def test_manifests_hold_against_a_live_server(tools, live) -> None:
    server, container, wanted = live
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == wanted == {"http": server.http_port, "grpc": server.grpc_port, "metrics": server.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "http"
        r = requests.get(f"http://127.0.0.1:{server.http_port}{get['path']}", timeout=10)
        assert r.status_code == 200, (probe, get, r.status_code)
    # every metric name in every shipped query is exported
    exported = _exported(server)
    for expr in _promql(tools):
        names = _metric_names(expr)
        assert names and names <= exported, (expr, names - exported)
    # the KServe runtime's arguments are ones Pier takes (--model-store, its ports)
    runtime = yaml.safe_load((KSERVE / "clusterservingruntime.yaml").read_text())
    kargs = runtime["spec"]["containers"][0]["args"]
    assert "--model-store=/mnt/models" in kargs
    assert runtime["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    help_text = _run([sys.executable, "-m", "pier", "serve", "--help"]).stdout
    for a in kargs:
        assert a.split("=")[0] in help_text, a


RULES_TEST = """rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'nv_inference_queue_duration_us{pod="p"}'
        values: '0+1200x10'
      - series: 'nv_inference_compute_infer_duration_us{pod="p"}'
        values: '0+600x10'
      - series: 'vllm:kv_cache_usage_perc{pod="p"}'
        values: '0.9x10'
    promql_expr_test:
      - expr: pier:queue_to_compute_ratio
        eval_time: 5m
        exp_samples: [{labels: 'pier:queue_to_compute_ratio{pod="p"}', value: 2}]
    alert_rule_test:
      - alertname: PierKVCacheNearlyFull
        eval_time: 8m
        exp_alerts: [{exp_labels: {pod: p, severity: warning},
                      exp_annotations: {summary: "Pier pod p: the LLM's KV cache is 90% full"}}]
"""


def test_dashboards_query_only_exported_names(live) -> None:
    """Every metric name in every dashboard panel's query and variable query, the KServe and the LLM
    dashboard alike, is one the live Pier exports after a few requests."""
    server, _, _ = live
    exported = _exported(server)
    queries = _dashboard_queries()
    assert {d for d, _, _ in queries} == {"pier-serving.json", "pier-llm.json"}
    for board, panel, expr in queries:
        names = _metric_names(_substitute(expr, {"datasource": "prometheus", "job": ".*", "model": ".*"}))
        assert names and names <= exported, (board, panel, expr, names - exported)


def test_queries_on_a_real_prometheus(tools, live, tmp_path: Path) -> None:
    """promtool checks and unit-tests the rules; a real Prometheus scrapes the live server (labelled
    as the ServiceMonitor would label it) and every shipped query returns data, each KEDA query
    exactly one series; after fresh traffic, every dashboard variable has values and every dashboard
    panel query returns a series with a number (not NaN: the rates it divides are not zero)."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        pytest.skip("prometheus / promtool not installed (apt-get install prometheus)")
    server, _, _ = live
    (rule,) = [d for d in _docs(_render(tools, *VALUES["llm"])) if d["kind"] == "PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = _run([promtool, "check", "rules", str(tmp_path / "rules.yaml")])
    assert check.returncode == 0, check.stdout + check.stderr
    (tmp_path / "rules_test.yaml").write_text(RULES_TEST)
    unit = _run([promtool, "test", "rules", "rules_test.yaml"], cwd=tmp_path)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    port = free_port()
    labels = {"service": "t-pier", "pod": "t-pier-0", "namespace": "default"}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "pier", "static_configs": [
            {"targets": [f"127.0.0.1:{server.metrics_port}"], "labels": labels}]}]}))
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'data'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def query(expr: str) -> list:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=10)
            except requests.ConnectionError:  # not up yet
                return []
            return r.json()["data"]["result"] if r.ok else []

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not query('rate(nv_inference_count{model="simple"}[1m])'):
            time.sleep(1)
        keda = {q for d in _docs(_render(tools, *VALUES["keda"])) if d["kind"] == "ScaledObject"
                for q in (t["metadata"]["query"] for t in d["spec"]["triggers"])}
        keda.add(yaml.safe_load((KSERVE / "inferenceservice-keda.yaml").read_text())["spec"]["predictor"][
            "autoScaling"]["metrics"][0]["external"]["metric"]["query"].replace("simple-predictor", "t-pier"))
        for expr in _promql(tools):
            expr = expr.replace("<<.LabelMatchers>>", 'namespace="default",pod="t-pier-0"').replace(
                "<<.GroupBy>>", "pod").replace("simple-predictor", "t-pier")
            expr = re.sub(r"\s*[<>]=?\s*[0-9.]+$", "", expr)  # an alert's condition: the series it watches
            result = query(expr)
            assert result, expr
            if expr in keda:
                assert len(result) == 1, (expr, result)
        # the dashboards: traffic that Prometheus sees (it has scraped before and after it)
        def traffic_seen() -> None:
            _traffic(server)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                    query('increase(nv_inference_count{model="simple"}[1m]) > 0')
                    and query("increase(vllm:generation_tokens_total[1m]) > 0")):
                time.sleep(1)

        def numbers(expr: str) -> list:
            """The query's result once it holds a number: a panel's rates look back 1 minute, and on a
            loaded machine the panels before it can take longer than that since the traffic; then
            fresh traffic is sent once more (a query that never yields a number still fails)."""
            result = query(expr)
            for _ in range(2):
                if any(math.isfinite(float(s["value"][1])) for s in result):
                    break
                traffic_seen()
                result = query(expr)
            return result

        traffic_seen()
        for name, board in _dashboards().items():
            values = {"datasource": "prometheus"}
            for var in board["templating"]["list"]:  # in order: a variable's query may use the ones before
                if var["type"] != "query":
                    continue
                selector, label = _label_values(_substitute(_variable_query(var), values))
                r = requests.get(f"http://127.0.0.1:{port}/api/v1/label/{label}/values",
                                 params={"match[]": selector}, timeout=10)
                assert r.ok and r.json()["data"], (name, var["name"], selector, r.text)
                values[var["name"]] = "|".join(r.json()["data"])
            for panel in _panels(board):
                for target in panel.get("targets", []):
                    expr = _substitute(target["expr"], values)
                    result = numbers(expr)
                    assert any(math.isfinite(float(s["value"][1])) for s in result), (
                        name, panel["title"], expr, result)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
