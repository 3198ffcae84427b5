#!/usr/bin/env python3
"""Roll a model version out across Pier replicas one pod at a time, with the server's own
per-version rollout; on any failure, roll every pod touched back.

    python scripts/rollout.py MODEL --version 3 --pods http://10.0.0.1:8000,http://10.0.0.2:8000
    python scripts/rollout.py MODEL --version newest --repository /models \\
        --kubectl-selector app.kubernetes.io/name=pier --namespace serving
    python scripts/rollout.py MODEL --version 3 --pods ... --dry-run        # the plan; changes nothing

For each pod in turn (the pods run `pier serve --model-control-mode=explicit` over the same
repository, e.g. a shared PVC, where the new version folder is already in place):

1. pin the pod's unversioned traffic where it is (`POST .../rollout` with the current split), so
   the new version takes no request before it has been checked;
2. load the new version beside the old one (`POST .../versions/N/load`; the old keeps serving);
3. wait until the new version is READY (`GET /v2/models/M/versions/N/ready`);
4. send a smoke inference to that version (inputs from its metadata: zeros or random data of the
   right datatype and shape, or `--smoke-request file.json`, a KServe v2 JSON request body);
5. shift the traffic in `--steps` (percent to the new version, e.g. 25,50,100), waiting
   `--step-wait` seconds after each and checking that `nv_inference_request_failure` for the
   model did not grow on the pod's metrics port;
then the next pod. Once every pod serves the new version, the old versions are unloaded
(`--unload-old end`, the default: until then a rollback is a weight change) and each pod goes back
to "newest READY version" routing if that is what it used before.

On a failure (or Ctrl-C) every pod touched, the failing one included, is put back the way it was:
old versions loaded again if needed, the old traffic split, the new version unloaded. Nothing here
takes a version's last READY copy away before another one serves, so no request is dropped.

Exit codes: 0 rolled out (or nothing to do); 1 failed and rolled back; 2 refused before changing
anything (bad arguments, a pod not ready, the model missing, a dry run whose checks failed);
3 failed and the rollback failed too (the messages say which pod needs a hand); 4 rolled out, but
an old version could not be unloaded.

Only the standard library: it runs from a laptop, a CI job or a Kubernetes Job with the repository
mounted, with or without Pier installed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ROLLED_BACK, EXIT_REFUSED, EXIT_ROLLBACK_FAILED, EXIT_UNLOAD_FAILED = 0, 1, 2, 3, 4

FAILURE_METRIC = "nv_inference_request_failure"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class RolloutError(Exception):
    """A step that failed; the message says which pod and why."""


def say(message: str) -> None:
    print(message, flush=True)


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- talking to one pod ------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    name: str  # for messages: the URL, or the Kubernetes pod name
    url: str  # http://host:8000
    metrics_url: str  # http://host:8002/metrics, "" when not checked


@dataclass
class Http:
    headers: dict[str, str]
    timeout: float

    def call(self, method: str, url: str, body: Any = None, timeout: float | None = None) -> tuple[int, Any]:
        """(status, JSON body or text); raises RolloutError when the pod cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise TimeoutError(f"{method} {url}: no answer within {timeout or self.timeout:g} s") from exc
            raise RolloutError(f"{method} {url}: cannot reach the pod: {reason}") from exc
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text) if text.strip() else None
        except ValueError:
            return status, text


def _error_text(body: Any) -> str:
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)[:500] if body else "(empty answer)"


@dataclass
class PierPod:
    """The calls this script makes to one Pier server."""

    pod: Pod
    http: Http

    def _ok(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        status, doc = self.http.call(method, self.pod.url + path, body, timeout)
        if status != 200:
            raise RolloutError(f"{self.pod.name}: {method} {path} answered {status}: {_error_text(doc)}")
        return doc

    def ready(self) -> bool:
        return self.http.call("GET", self.pod.url + "/v2/health/ready")[0] == 200

    def version_ready(self, model: str, version: int) -> bool:
        return self.http.call("GET", f"{self.pod.url}/v2/models/{model}/versions/{version}/ready")[0] == 200

    def rows(self, model: str) -> dict[int, tuple[str, str]]:
        """The repository index rows of `model`: version -> (state, reason)."""
        doc = self._ok("POST", "/v2/repository/index", {})
        return {int(r["version"]): (r.get("state", ""), r.get("reason", ""))
                for r in doc if r.get("name") == model and r.get("version")}

    def traffic(self, model: str) -> dict[int, float]:
        doc = self._ok("GET", f"/v2/repository/models/{model}/traffic")
        return {int(v): float(p) for v, p in doc["traffic"].items()}

    def set_traffic(self, model: str, weights: dict[int, float]) -> dict[int, float]:
        """{} = back to the newest READY version."""
        doc = self._ok("POST", f"/v2/repository/models/{model}/rollout",
                       {"weights": {str(v): w for v, w in weights.items()}})
        return {int(v): float(p) for v, p in doc["traffic"].items()}

    def load_version(self, model: str, version: int, timeout: float) -> None:
        self._ok("POST", f"/v2/repository/models/{model}/versions/{version}/load", timeout=timeout)

    def unload_version(self, model: str, version: int) -> None:
        status, doc = self.http.call("POST", f"{self.pod.url}/v2/repository/models/{model}/versions/{version}/unload")
        if status == 404 and "not loaded" in _error_text(doc):
            return  # nothing to unload
        if status != 200:
            raise RolloutError(f"{self.pod.name}: unloading version {version} answered {status}: {_error_text(doc)}")

    def metadata(self, model: str, version: int) -> dict[str, Any]:
        doc = self._ok("GET", f"/v2/models/{model}/versions/{version}")
        return doc if isinstance(doc, dict) else {}

    def infer(self, model: str, version: int, body: dict[str, Any]) -> dict[str, Any]:
        doc = self._ok("POST", f"/v2/models/{model}/versions/{version}/infer", body)
        return doc if isinstance(doc, dict) else {}

    def failures(self, model: str) -> dict[tuple[tuple[str, str], ...], float] | None:
        """`nv_inference_request_failure` series of `model` (labels -> count); None: not checked."""
        if not self.pod.metrics_url:
            return None
        status, text = self.http.call("GET", self.pod.metrics_url)
        if status != 200 or not isinstance(text, str):
            raise RolloutError(f"{self.pod.name}: GET {self.pod.metrics_url} answered {status}")
        return parse_failures(text, model)


def parse_failures(text: str, model: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(FAILURE_METRIC + "{"):
            continue
        labels_text, _, value = line[len(FAILURE_METRIC) + 1:].rpartition("}")
        labels = dict(_LABEL.findall(labels_text))
        if labels.get("model") == model:
            out[tuple(sorted(labels.items()))] = float(value.split()[0])
    return out


def grown(before: dict[tuple[tuple[str, str], ...], float] | None,
          after: dict[tuple[tuple[str, str], ...], float] | None) -> list[str]:
    """The failure series that grew (a series that appeared counts from 0; one that went away,
    an unloaded version's, does not count)."""
    if before is None or after is None:
        return []
    out = []
    for key, value in sorted(after.items()):
        delta = value - before.get(key, 0.0)
        if delta > 0:
            labels = ",".join(f"{k}={v}" for k, v in key if k != "model")
            out.append(f"{labels}: +{delta:g}")
    return out


# ---- smoke request -----------------------------------------------------------------------

_INTS = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
_FLOATS = {"FP16", "FP32", "FP64", "BF16"}


def smoke_body(metadata: dict[str, Any], data: str, rng: random.Random) -> dict[str, Any]:
    """A KServe v2 JSON request for every input of `metadata`: dynamic dimensions are 1, values
    zeros or small random ones of the input's datatype."""
    inputs = []
    for tensor in metadata.get("inputs", []):
        shape = [1 if int(d) < 0 else int(d) for d in tensor.get("shape", [])]
        count = 1
        for d in shape:
            count *= d
        datatype = str(tensor.get("datatype", ""))
        values: list[Any]
        if datatype == "BOOL":
            values = [False] * count if data == "zeros" else [rng.random() < 0.5 for _ in range(count)]
        elif datatype in _INTS:
            values = [0] * count if data == "zeros" else [rng.randint(0, 9) for _ in range(count)]
        elif datatype in _FLOATS:
            values = [0.0] * count if data == "zeros" else [round(rng.random(), 4) for _ in range(count)]
        elif datatype == "BYTES":
            values = [""] * count if data == "zeros" else ["".join(rng.choices("abcdefgh", k=8)) for _ in range(count)]
        else:
            raise RolloutError(f"input '{tensor.get('name')}' has datatype {datatype!r}, which this script cannot "
                               "fill: pass --smoke-request")
        inputs.append({"name": tensor["name"], "shape": shape, "datatype": datatype, "data": values})
    return {"inputs": inputs}


# ---- what a pod serves, and the plan -----------------------------------------------------


@dataclass
class Before:
    """What a pod served before the rollout touched it: enough to put it back."""

    ready: list[int]  # READY versions of the model
    traffic: dict[int, float]  # the unversioned split
    weighted: bool  # weights were set (else: newest READY version)


def snapshot(api: PierPod, model: str) -> Before:
    rows = api.rows(model)
    ready = sorted(v for v, (state, _) in rows.items() if state == "READY")
    if not ready:
        states = ", ".join(f"v{v} {s} {r}".strip() for v, (s, r) in sorted(rows.items())) or "not loaded"
        raise RolloutError(f"{api.pod.name}: model '{model}' has no READY version ({states})")
    weighted = any(reason.startswith("traffic ") for v, (state, reason) in rows.items() if state == "READY")
    return Before(ready, api.traffic(model), weighted)


def newest_on_disk(repository: Path, model: str) -> int:
    folder = repository / model
    versions = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0] \
        if folder.is_dir() else []
    if not versions:
        raise RolloutError(f"no version folder under {folder}")
    return max(versions)


def split(old: dict[int, float], new: int, percent: float) -> dict[int, float]:
    """`percent` to `new`, the rest over the old split in its proportions."""
    rest = {v: w for v, w in old.items() if v != new and w > 0}
    total = sum(rest.values())
    weights = {v: round((100.0 - percent) * w / total, 6) for v, w in rest.items()} if total else {}
    weights = {v: w for v, w in weights.items() if w > 0}
    if percent > 0:
        weights[new] = float(percent)
    return weights


@dataclass
class Options:
    model: str
    version: int
    steps: list[float]
    step_wait: float
    load_timeout: float
    ready_timeout: float
    smoke_request: dict[str, Any] | None
    smoke_data: str
    unload_old: str  # end | each | never
    seed: int | None = None
    rng: random.Random = field(default_factory=random.Random)


def plan_lines(pods: list[Pod], opts: Options) -> list[str]:
    m, n = opts.model, opts.version
    lines = [f"roll out '{m}' version {n} to {len(pods)} pod(s), one at a time:"]
    for i, pod in enumerate(pods, 1):
        where = pod.name if pod.name == pod.url else f"{pod.name} ({pod.url})"
        lines.append(f"  pod {i}/{len(pods)} {where}:")
        lines.append(f"    pin unversioned traffic on the versions serving now (POST .../models/{m}/rollout)")
        lines.append(f"    load version {n} beside them (POST .../models/{m}/versions/{n}/load)")
        lines.append(f"    wait until version {n} is READY (up to {opts.ready_timeout:g} s)")
        source = "--smoke-request" if opts.smoke_request is not None else f"{opts.smoke_data} inputs from its metadata"
        lines.append(f"    smoke inference on version {n} ({source})")
        for p in opts.steps:
            lines.append(f"    traffic {p:g}% to version {n}, wait {opts.step_wait:g} s"
                         + (", check nv_inference_request_failure" if pod.metrics_url else ""))
        if opts.unload_old == "each":
            lines.append("    unload the old versions")
    if opts.unload_old == "end":
        lines.append("  then on every pod: unload the old versions, back to newest-READY routing where it was so")
    lines.append("  on any failure: every pod touched back to its old versions and split, version "
                 f"{n} unloaded; exit 1")
    return lines


# ---- the rollout -------------------------------------------------------------------------


class Rollout:
    def __init__(self, pods: list[PierPod], opts: Options) -> None:
        self.pods = pods
        self.opts = opts
        self.before: dict[str, Before] = {}  # pod name -> what it served, for every pod
        self.touched: list[PierPod] = []  # pods this run changed, in order

    def preflight(self) -> list[PierPod]:
        """Check every pod before changing any; the pods that still need the new version."""
        todo = []
        m, n = self.opts.model, self.opts.version
        for api in self.pods:
            if not api.ready():
                raise RolloutError(f"{api.pod.name}: /v2/health/ready is not 200: fix the pod first")
            before = snapshot(api, m)
            self.before[api.pod.name] = before
            if before.ready == [n] or (n in before.ready and before.traffic == {n: 100.0}
                                       and self.opts.unload_old == "never"):
                say(f"{api.pod.name}: already serves '{m}' version {n} only")
                continue
            todo.append(api)
        return todo

    def run(self) -> int:
        try:
            todo = self.preflight()
        except (RolloutError, TimeoutError) as exc:
            warn(f"refused, nothing changed: {exc}")
            return EXIT_REFUSED
        m, n = self.opts.model, self.opts.version
        try:
            for i, api in enumerate(todo, 1):
                say(f"[{i}/{len(todo)}] {api.pod.name}: rolling '{m}' out to version {n}")
                self.touched.append(api)  # before the first change: a failure half-way rolls it back too
                self.roll_pod(api)
                say(f"[{i}/{len(todo)}] {api.pod.name}: serves version {n}")
        except (RolloutError, TimeoutError, KeyboardInterrupt) as exc:
            what = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
            warn(f"FAILED: {what}")
            warn(f"rolling back {len(self.touched)} pod(s): " + ", ".join(a.pod.name for a in self.touched))
            if not self.roll_back():
                return EXIT_ROLLBACK_FAILED
            warn(f"rolled back: every pod serves what it served before. Version {n} stays on disk: fix or remove "
                 f"it before a pod restarts (a restarted pod loads what the version policy picks).")
            return EXIT_ROLLED_BACK
        if self.opts.unload_old != "never" and not self.finish(todo):
            return EXIT_UNLOAD_FAILED
        say(f"done: '{m}' version {n} serves on all {len(self.pods)} pod(s)")
        return EXIT_OK

    def roll_pod(self, api: PierPod) -> None:
        m, n, opts = self.opts.model, self.opts.version, self.opts
        before = self.before[api.pod.name]
        failures = api.failures(m)
        # 1. the new version must take nothing before it is checked: pin the split serving now
        old = {v: w for v, w in before.traffic.items() if v != n} or {v: 100.0 for v in before.ready if v != n}
        if not old:
            raise RolloutError(f"{api.pod.name}: no old version takes traffic; nothing to roll out from")
        api.set_traffic(m, old)
        # 2. load beside the old versions (they keep serving)
        say(f"  {api.pod.name}: loading version {n}")
        try:
            api.load_version(m, n, opts.load_timeout)
        except TimeoutError:
            say(f"  {api.pod.name}: the load call did not answer within {opts.load_timeout:g} s; the server "
                "finishes it anyway, waiting for READY")
        # 3. READY
        self.wait_ready(api)
        # 4. smoke inference on the new version only
        self.smoke(api)
        check = self.check_failures(api, failures)
        # 5. shift the traffic in steps, watching the failure counters
        for p in opts.steps:
            traffic = api.set_traffic(m, split(old, n, p))
            say(f"  {api.pod.name}: traffic " + ", ".join(f"v{v} {w:g}%" for v, w in sorted(traffic.items())))
            time.sleep(opts.step_wait)
            check()
        if opts.unload_old == "each":
            for v in sorted(old):
                api.unload_version(m, v)

    def wait_ready(self, api: PierPod) -> None:
        m, n = self.opts.model, self.opts.version
        deadline = time.monotonic() + self.opts.ready_timeout
        while not api.version_ready(m, n):
            state, reason = api.rows(m).get(n, ("", ""))
            if state == "UNAVAILABLE":
                raise RolloutError(f"{api.pod.name}: version {n} failed to load: {reason or 'no reason given'}")
            if time.monotonic() > deadline:
                raise RolloutError(f"{api.pod.name}: version {n} not READY after {self.opts.ready_timeout:g} s "
                                   f"(state {state or 'unknown'})")
            time.sleep(0.2)
        say(f"  {api.pod.name}: version {n} READY")

    def smoke(self, api: PierPod) -> None:
        m, n = self.opts.model, self.opts.version
        body = self.opts.smoke_request
        if body is None:
            body = smoke_body(api.metadata(m, n), self.opts.smoke_data, self.opts.rng)
        try:
            answer = api.infer(m, n, body)
        except RolloutError as exc:
            raise RolloutError(f"smoke inference failed: {exc}") from exc
        if str(answer.get("model_version")) != str(n):
            raise RolloutError(f"{api.pod.name}: smoke inference answered by version {answer.get('model_version')}, "
                               f"not {n}")
        outputs = answer.get("outputs") or []
        say(f"  {api.pod.name}: smoke inference on version {n} ok ({len(outputs)} output(s))")

    def check_failures(self, api: PierPod, before: dict[tuple[tuple[str, str], ...], float] | None
                       ) -> Callable[[], None]:
        def check() -> None:
            growth = grown(before, api.failures(self.opts.model))
            if growth:
                raise RolloutError(f"{api.pod.name}: {FAILURE_METRIC} of '{self.opts.model}' grew during the "
                                   f"rollout ({'; '.join(growth)})")
        check()
        return check

    def finish(self, pods: Iterable[PierPod]) -> bool:
        """Unload the old versions everywhere, and restore newest-READY routing where it was so."""
        m, n = self.opts.model, self.opts.version
        ok = True
        for api in pods:
            before = self.before[api.pod.name]
            try:
                for v in before.ready:
                    if v != n:
                        api.unload_version(m, v)
                if not before.weighted:
                    api.set_traffic(m, {})  # only version n is left: the same route, the default way
                say(f"  {api.pod.name}: old version(s) unloaded")
            except (RolloutError, TimeoutError) as exc:
                warn(f"WARNING: version {n} serves, but cleaning up failed: {exc}")
                ok = False
        return ok

    def roll_back(self) -> bool:
        ok = True
        for api in reversed(self.touched):
            try:
                self.restore(api)
                warn(f"  {api.pod.name}: back to version(s) {', '.join(map(str, self.before[api.pod.name].ready))}")
            except (RolloutError, TimeoutError) as exc:
                warn(f"  ROLLBACK FAILED on {api.pod.name}: {exc}")
                ok = False
        return ok

    def restore(self, api: PierPod) -> None:
        m, n = self.opts.model, self.opts.version
        before = self.before[api.pod.name]
        for v in before.ready:  # the old versions first (they may have been unloaded: --unload-old each)
            if not api.version_ready(m, v):
                api.load_version(m, v, self.opts.load_timeout)
        api.set_traffic(m, before.traffic)  # all traffic back where it was, at once
        if n not in before.ready:
            api.unload_version(m, n)  # it finishes its in-flight requests first
        if not before.weighted:
            api.set_traffic(m, {})  # newest READY again, which is the old newest now


# ---- the pods ----------------------------------------------------------------------------


def _metrics_url(url: str, metrics_port: int) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{metrics_port}/metrics"


def pods_from_list(pods: str, metrics: str, metrics_port: int, no_metrics: bool) -> list[Pod]:
    urls = [u.strip().rstrip("/") for u in pods.split(",") if u.strip()]
    metric_urls = [u.strip() for u in metrics.split(",") if u.strip()] if metrics else []
    if metric_urls and len(metric_urls) != len(urls):
        raise RolloutError(f"--metrics names {len(metric_urls)} URL(s) for {len(urls)} pod(s)")
    out = []
    for i, url in enumerate(urls):
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        if no_metrics:
            murl = ""
        elif metric_urls:
            murl = metric_urls[i] if metric_urls[i].endswith("/metrics") else metric_urls[i].rstrip("/") + "/metrics"
        else:
            murl = _metrics_url(url, metrics_port)
        out.append(Pod(url, url, murl))
    return out


def pods_from_kubectl(selector: str, namespace: str, port: int, metrics_port: int, no_metrics: bool,
                      kubectl: str) -> list[Pod]:
    """Running pods matching the label selector; a pod that is not Ready stops the rollout
    (it would be rolled out blind)."""
    cmd = [kubectl, "get", "pods", "-o", "json", "-l", selector] + (["-n", namespace] if namespace else [])
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise RolloutError(f"{' '.join(cmd)}: {detail}") from exc
    out = []
    for item in sorted(json.loads(done.stdout).get("items", []), key=lambda i: i["metadata"]["name"]):
        name, status = item["metadata"]["name"], item.get("status", {})
        if item["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        if not ready or not status.get("podIP"):
            raise RolloutError(f"pod {name} is Running but not Ready: fix it (or wait) before a rollout")
        url = f"http://{status['podIP']}:{port}"
        out.append(Pod(name, url, "" if no_metrics else _metrics_url(url, metrics_port)))
    if not out:
        raise RolloutError(f"no running pod matches -l {selector}" + (f" -n {namespace}" if namespace else ""))
    return out


# ---- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None)
    parser.add_argument("model")
    parser.add_argument("--version", required=True,
                        help="the version to roll out, or 'newest' (the highest version folder in --repository)")
    parser.add_argument("--repository", type=Path,
                        help="the model repository as this machine sees it (for --version newest)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pods", help="comma-separated HTTP endpoints, e.g. http://10.0.0.1:8000,http://10.0.0.2:8000")
    where.add_argument("--kubectl-selector", help="a label selector; the pods' IPs come from kubectl get pods")
    parser.add_argument("--namespace", default="", help="with --kubectl-selector")
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the pods (--kubectl-selector)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="metrics port, on each pod's host")
    parser.add_argument("--metrics", default="", help="comma-separated metrics URLs, one per --pods entry "
                                                      "(instead of --metrics-port)")
    parser.add_argument("--no-metrics", action="store_true", help="do not check the failure counters")
    parser.add_argument("--steps", default="25,50,100",
                        help="percent of the pod's unversioned traffic to the new version, step by step (last: 100)")
    parser.add_argument("--step-wait", type=float, default=5.0, help="seconds to watch each step")
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds a version load call may take")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for READY")
    parser.add_argument("--smoke-request", type=Path, help="a KServe v2 JSON request body for the smoke inference")
    parser.add_argument("--smoke-data", choices=("zeros", "random"), default="zeros",
                        help="the smoke inference's inputs when there is no --smoke-request")
    parser.add_argument("--unload-old", choices=("end", "each", "never"), default="end",
                        help="unload the old versions once every pod serves the new one (end), after each pod "
                             "(each: less memory, a rollback reloads them), or never")
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                        help="an HTTP header for every call, e.g. 'Authorization: Bearer KEY' (repeatable)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for every other HTTP call")
    parser.add_argument("--seed", type=int, help="seed of --smoke-data random")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check the pods; change nothing")
    return parser.parse_args(argv)


def options(args: argparse.Namespace) -> Options:
    if args.version == "newest":
        if args.repository is None:
            raise RolloutError("--version newest needs --repository (the server lists only versions it has loaded, "
                               "not the folders on disk)")
        version = newest_on_disk(args.repository, args.model)
    elif args.version.isdigit() and int(args.version) > 0:
        version = int(args.version)
    else:
        raise RolloutError(f"--version must be a positive integer or 'newest', got {args.version!r}")
    try:
        steps = [float(s) for s in args.steps.split(",") if s.strip()]
    except ValueError as exc:
        raise RolloutError(f"--steps: {exc}") from exc
    if not steps or steps[-1] != 100 or any(not 0 < s <= 100 for s in steps) or steps != sorted(steps):
        raise RolloutError(f"--steps must rise within (0, 100] and end at 100, got {args.steps!r}")
    smoke = None
    if args.smoke_request is not None:
        try:
            smoke = json.loads(args.smoke_request.read_text())
        except (OSError, ValueError) as exc:
            raise RolloutError(f"--smoke-request {args.smoke_request}: {exc}") from exc
        if not isinstance(smoke, dict) or "inputs" not in smoke:
            raise RolloutError(f"--smoke-request {args.smoke_request}: not a KServe v2 request (no 'inputs')")
    return Options(args.model, version, steps, args.step_wait, args.load_timeout, args.ready_timeout, smoke,
                   args.smoke_data, args.unload_old, args.seed, random.Random(args.seed))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        opts = options(args)
        headers = {}
        for h in args.header:
            name, sep, value = h.partition(":")
            if not sep or not name.strip():
                raise RolloutError(f"--header {h!r}: expected NAME:VALUE")
            headers[name.strip()] = value.strip()
        if args.pods:
            pods = pods_from_list(args.pods, args.metrics, args.metrics_port, args.no_metrics)
        else:
            pods = pods_from_kubectl(args.kubectl_selector, args.namespace, args.port, args.metrics_port,
                                     args.no_metrics, args.kubectl)
        if not pods:
            raise RolloutError("no pods given")
    except RolloutError as exc:
        warn(f"refused, nothing changed: {exc}")
        return EXIT_REFUSED
    http = Http(headers, args.timeout)
    rollout = Rollout([PierPod(p, http) for p in pods], opts)
    if args.dry_run:
        say("\n".join(plan_lines(pods, opts)))
        try:
            todo = rollout.preflight()
        except (RolloutError, TimeoutError) as exc:
            warn(f"dry run: the rollout would be refused: {exc}")
            return EXIT_REFUSED
        for api in rollout.pods:
            b = rollout.before[api.pod.name]
            say(f"now {api.pod.name}: READY version(s) {', '.join(map(str, b.ready))}, traffic "
                + ", ".join(f"v{v} {w:g}%" for v, w in sorted(b.traffic.items())))
        say(f"dry run: {len(todo)} pod(s) to roll out; nothing changed")
        return EXIT_OK
    return rollout.run()


if __name__ == "__main__":
    sys.exit(main())
