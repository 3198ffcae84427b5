"""--model-namespacing (Triton's qa/L0_model_namespacing, here with Pier's own models): every
repository is a namespace, so the same model name may live in two; an ensemble calls the composing
model of its own repository (or, when that one is gone, the only other one, re-linked at run time);
a name held by two answers with Triton's "ambiguity" error; explicit loads of such a name load each
namespace's model; metrics carry a `namespace` label."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import PierProcess, start_pier

# OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 ("addsub"), or the other way round ("subadd")
MODEL_PY = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            first, second = (a + b, a - b) if {addsub} else (a - b, a + b)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", first),
                                                   pb_utils.Tensor("OUTPUT1", second)]))
        return out
"""
IO = """max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
ENSEMBLE = """platform: "ensemble"
{io}ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }} input_map {{ key: "INPUT1" value: "INPUT1" }}
  output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} output_map {{ key: "OUTPUT1" value: "OUTPUT1" }} }} ] }}
"""


def _python(repo: Path, name: str, addsub: bool) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f'backend: "python"\n{IO}')
    (repo / name / "1" / "model.py").write_text(MODEL_PY.format(addsub=addsub))


def _ensemble(repo: Path, name: str, step: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ENSEMBLE.format(io=IO, step=step))


def _repos(root: Path, composing: str, ensemble: str) -> list[Path]:
    """qa's layouts: each repository has an ensemble and its composing model, named per layout."""
    repos = []
    for kind, addsub in (("addsub", True), ("subadd", False)):
        repo = root / f"{kind}_repo"
        _python(repo, composing.format(kind=kind), addsub)
        _ensemble(repo, ensemble.format(kind=kind), composing.format(kind=kind))
        repos.append(repo)
    return repos


A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)


def _kind(server: PierProcess, model: str) -> str:
    """'addsub' or 'subadd', by what `model` answers."""
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    out = client.infer(model, inputs).as_numpy("OUTPUT0")
    return "addsub" if np.array_equal(out, A + B) else "subadd" if np.array_equal(out, A - B) else f"? {out}"


def _ambiguous(server: PierProcess, model: str) -> None:
    with pytest.raises(InferenceServerException) as err:
        _kind(server, model)
    assert err.value.message().endswith(
        f"There are 2 identifiers of model '{model}' in global map, model namespace must be provided to resolve "
        "ambiguity."), err.value.message()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="ambiguity"):
        grpc.get_model_metadata(model)


def _wait(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except InferenceServerException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def _serve(root: Path, repos: list[Path], *flags: str) -> PierProcess:
    return start_pier(repos, "--model-namespacing=true", *flags, log_path=root / "pier.log")


def test_no_duplication_serves_every_model(root: Path) -> None:
    server = _serve(root, _repos(root, "composing_{kind}", "simple_{kind}"))
    try:
        assert [_kind(server, m) for m in ("simple_addsub", "composing_addsub", "simple_subadd",
                                           "composing_subadd")] == ["addsub", "addsub", "subadd", "subadd"]
    finally:
        assert server.stop() == 0


def test_a_composing_model_in_both_namespaces_serves_each_ensemble_its_own(root: Path) -> None:
    server = _serve(root, _repos(root, "composing_model", "simple_{kind}"))
    try:
        assert (_kind(server, "simple_addsub"), _kind(server, "simple_subadd")) == ("addsub", "subadd")
        _ambiguous(server, "composing_model")
        index = httpclient.InferenceServerClient(server.http_url).get_model_repository_index()
        assert sorted(r["name"] for r in index) == ["composing_model", "composing_model", "simple_addsub",
                                                    "simple_subadd"]
        metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
        for repo in ("addsub_repo", "subadd_repo"):
            label = f'nv_inference_request_success{{model="composing_model",namespace="{root / repo}",version="1"}} 1'
            assert label in metrics, metrics
    finally:
        assert server.stop() == 0


def test_explicit_load_of_a_name_in_both_namespaces_loads_each(root: Path) -> None:
    server = _serve(root, _repos(root, "composing_{kind}", "simple_ensemble"), "--model-control-mode=explicit")
    try:
        httpclient.InferenceServerClient(server.http_url).load_model("simple_ensemble")
        assert (_kind(server, "composing_addsub"), _kind(server, "composing_subadd")) == ("addsub", "subadd")
        _ambiguous(server, "simple_ensemble")
    finally:
        assert server.stop() == 0


def test_poll_relinks_an_ensemble_when_its_namespace_loses_the_model(root: Path) -> None:
    repos = _repos(root, "composing_model", "simple_{kind}")
    server = _serve(root, repos, "--model-control-mode=poll", "--repository-poll-secs=1")
    own, away = repos[0] / "composing_model", root / "composing_model"
    try:
        assert _kind(server, "simple_addsub") == "addsub"
        shutil.move(own, away)  # addsub's own composing model goes: its ensemble calls subadd's
        _wait(lambda: _kind(server, "composing_model") == "subadd", "composing_model to be unique")
        _wait(lambda: _kind(server, "simple_addsub") == "subadd", "simple_addsub to re-link")
        assert _kind(server, "simple_subadd") == "subadd"
        shutil.move(away, own)  # back: each ensemble its own again
        _wait(lambda: _kind(server, "simple_addsub") == "addsub", "simple_addsub to use its own again")
        assert _kind(server, "simple_subadd") == "subadd"
        _ambiguous(server, "composing_model")
    finally:
        assert server.stop() == 0


def test_explicit_load_relinks_as_triton(root: Path) -> None:
    repos = _repos(root, "composing_model", "simple_{kind}")
    server = _serve(root, repos, "--model-control-mode=explicit")
    own, away = repos[0] / "composing_model", root / "composing_model"
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        shutil.move(own, away)
        for model in ("simple_addsub", "simple_subadd"):
            client.load_model(model)
        assert [_kind(server, m) for m in ("simple_subadd", "simple_addsub", "composing_model")] == ["subadd"] * 3
        shutil.move(away, own)
        client.load_model("simple_addsub")  # loads its own composing model again
        assert (_kind(server, "simple_addsub"), _kind(server, "simple_subadd")) == ("addsub", "subadd")
        _ambiguous(server, "composing_model")
    finally:
        assert server.stop() == 0


def test_without_namespacing_a_name_in_two_repositories_is_refused(root: Path) -> None:
    repos = _repos(root, "composing_model", "simple_{kind}")
    server = start_pier(repos, "--exit-on-error=false", "--strict-readiness=false", log_path=root / "pier.log")
    try:
        index = httpclient.InferenceServerClient(server.http_url).get_model_repository_index()
        (row,) = [r for r in index if r["name"] == "composing_model"]
        assert row["state"] == "UNAVAILABLE" and "exists in two repositories" in row["reason"], row
    finally:
        assert server.stop() == 0
