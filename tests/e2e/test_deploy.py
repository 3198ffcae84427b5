"""The Kubernetes side (deploy/): the Helm chart lints strictly and renders, with each set of values,
manifests that pass strict schema validation (core kinds: kubernetes-validate; KServe, KEDA,
Prometheus Operator and InferencePool CRs: crd-validate against the real CRDs), and a misspelt field
fails. Then the rendered Deployment and the KServe runtime are held against a live `pier serve`
started with their arguments: every probe answers as the probe expects on a port Pier listens on,
and every metric name in every PromQL expression shipped is one Pier exports.

Needs helm, kubernetes-validate and crd-validate (the reference tools' k8s/install.sh makes them:
PIER_REFERENCE_TOOLS); skips with that reason without them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from tests.conftest import EXAMPLE_REPO, ROOT, free_port, start_pier

CHART = ROOT / "deploy" / "helm" / "pier"
KSERVE = ROOT / "deploy" / "kserve"
VALUES = {
    "default": [],
    "gpu": ["--set", "gpus=1", "--set", "image.repository=pier-gpu"],
    "llm": ["--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"],
    "keda": ["--set", "autoscaling.keda.enabled=true"],
    "hpa": ["--set", "autoscaling.hpa.enabled=true", "--set", "guards.apiKeysSecret=pier-keys",
            "--set", "guards.rateLimitModel={20:40}"],
}


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    found = {name: shutil.which(name) or str(Path.home() / "opt/k8s-tools/bin" / name)
             for name in ("helm", "kubernetes-validate", "crd-validate")}
    if all(Path(p).is_file() for p in found.values()):
        return found
    install = Path(os.environ.get("PIER_REFERENCE_TOOLS", "/nonexistent")) / "k8s" / "install.sh"
    if not install.is_file():
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
        crs = _run([tools["crd-validate"], str(path)])
        assert crs.returncode == 0, (name, crs.stdout, crs.stderr)
    crs = _run([tools["crd-validate"], *map(str, sorted(KSERVE.glob("*.yaml")))])
    assert crs.returncode == 0 and crs.stdout.count("ok ") == len(list(KSERVE.glob("*.yaml"))), crs.stdout
    # a misspelt field fails: in a values override, and in a custom resource
    assert _run([tools["helm"], "template", "t", str(CHART), "--set", "image.tagg=x"]).returncode != 0
    bad = tmp_path / "bad.yaml"
    bad.write_text((KSERVE / "inferenceservice-v2.yaml").read_text().replace("storageUri", "storageURI"))
    assert _run([tools["crd-validate"], str(bad)]).returncode != 0
    deploy = tmp_path / "bad-deploy.yaml"
    deploy.write_text(_render(tools).replace("readinessProbe", "readynessProbe"))
    assert _run([tools["kubernetes-validate"], "--strict", "-k", "1.35.0", str(deploy)]).returncode != 0


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


_FUNCTIONS = {"sum", "rate", "max", "min", "clamp_min", "by", "avg", "count", "irate", "increase"}


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
                                              "--set", f"ports.metrics={metrics}")) if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in container["args"] if not a.startswith(("--model-repository", "--http-port", "--grpc-port",
                                                              "--metrics-port"))]
    server = start_pier([repo], *args, log_path=tmp / "pier.log", timeout=120, ports=(http, grpc, metrics))
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                       for n in ("INPUT0", "INPUT1")]}
    for _ in range(3):
        assert requests.post(f"{server.base()}/v2/models/simple/infer", json=body, timeout=30).status_code == 200
    r = requests.post(f"{server.base()}/v1/completions", json={"model": "tiny_llm", "prompt": "x", "max_tokens": 2},
                      timeout=60)
    assert r.status_code == 200, r.text
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
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    exported |= {n.rsplit("_", 1)[0] for n in exported if n.endswith(("_total", "_bucket", "_count", "_sum"))}
    for expr in _promql(tools):
        bare = re.sub(r"\b(by|without)\s*\([^)]*\)", "", re.sub(r"<<[^>]*>>", "", expr))
        bare = re.sub(r"\{[^}]*\}", "{}", bare)  # label matchers: not metric names
        names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{|\[|\))", bare)) - _FUNCTIONS
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


def test_queries_on_a_real_prometheus(tools, live, tmp_path: Path) -> None:
    """promtool checks and unit-tests the rules; a real Prometheus scrapes the live server (labelled
    as the ServiceMonitor would label it) and every shipped query returns data, each KEDA query
    exactly one series."""
    import time

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
    finally:
        proc.terminate()
        proc.wait(timeout=30)
