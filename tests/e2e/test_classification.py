"""Triton's classification extension through the real server, real ONNX identity models and the
real clients. Expected answers are what the reference Triton 2.51 answered for the same models
and requests (probed side by side): top K per batch entry as "value:index[:label]", highest
first with ties in index order, "%f" floats, labels from the output's label_filename (a line's
trailing "\\r" kept, empty lines giving no label)."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from scripts.build_example_models import _model, write_model
from tests.conftest import start_pier

pytestmark = pytest.mark.frontends  # a requested output's parameters cross the channel

ONNX_TYPES = {"FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE, "INT32": TensorProto.INT32,
              "UINT8": TensorProto.UINT8, "BOOL": TensorProto.BOOL}
X = [[0.5, 2.0, -1.0, 2.0, 7.25], [3, 1, 4, 1, 5]]


def identity(datatype: str, shape: list) -> bytes:
    t = ONNX_TYPES[datatype]
    return _model(helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
                                    [helper.make_tensor_value_info("INPUT0", t, shape)],
                                    [helper.make_tensor_value_info("OUTPUT0", t, shape)]))


def config(name: str, datatype: str, max_batch: int, dims: str, label: str = "") -> str:
    label_line = f' label_filename: "{label}"' if label else ""
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch}\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_{datatype} dims: {dims} }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_{datatype} dims: {dims}{label_line} }} ]\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("cls") / "repo"
    folder = write_model(repo, "cls_fp32", config("cls_fp32", "FP32", 8, "[ -1 ]", "labels.txt"),
                         identity("FP32", [None, None]))
    (folder / "labels.txt").write_bytes(b"zero\none\n\nthree\r\nfour\n")
    write_model(repo, "cls_nob", config("cls_nob", "INT32", 0, "[ -1, -1 ]"), identity("INT32", [None, None]))
    write_model(repo, "cls_u8", config("cls_u8", "UINT8", 8, "[ -1 ]"), identity("UINT8", [None, None]))
    write_model(repo, "cls_bool", config("cls_bool", "BOOL", 8, "[ -1 ]"), identity("BOOL", [None, None]))
    write_model(repo, "cls_2d", config("cls_2d", "FP64", 8, "[ 2, 3 ]"), identity("FP64", [None, 2, 3]))
    write_model(repo, "cls_missing", config("cls_missing", "FP32", 8, "[ -1 ]", "nope.txt"),
                identity("FP32", [None, None]))
    write_model(repo, "cls_outside", config("cls_outside", "FP32", 8, "[ -1 ]", "../cls_fp32/labels.txt"),
                identity("FP32", [None, None]))
    ens = repo / "cls_ens"
    ens.mkdir()
    (ens / "1").mkdir()
    (ens / "config.pbtxt").write_text(
        'name: "cls_ens"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "cls_fp32" model_version: -1 '
        'input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } } ] }\n')
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false",
                      log_path=repo.parent / "pier.log")
    yield proc
    assert proc.stop() == 0, proc.log()


def infer_json(server, model: str, datatype: str, shape: list, data: list, params: dict) -> requests.Response:
    body = {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}],
            "outputs": [{"name": "OUTPUT0", "parameters": params}]}
    return requests.post(f"{server.base()}/v2/models/{model}/infer", json=body, timeout=30)


def test_top_k_per_batch_entry_with_labels(server) -> None:
    r = infer_json(server, "cls_fp32", "FP32", [2, 5], X, {"classification": 3})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, 3]
    assert out["data"] == ["7.250000:4:four", "2.000000:1:one", "2.000000:3:three\r",
                           "5.000000:4:four", "4.000000:2", "3.000000:0:zero"]
    r = infer_json(server, "cls_fp32", "FP32", [2, 5], X, {"classification": 10})  # K past the elements
    assert r.json()["outputs"][0]["shape"] == [2, 5]
    assert r.json()["outputs"][0]["data"][3:5] == ["0.500000:0:zero", "-1.000000:2"]
    r = infer_json(server, "cls_fp32", "FP32", [1, 5], X[:1], {"classification": 0})  # 0: the plain output
    assert r.json()["outputs"][0] == {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 5],
                                      "data": [0.5, 2.0, -1.0, 2.0, 7.25]}
    r = infer_json(server, "cls_fp32", "FP32", [1, 0], [[]], {"classification": 2})  # crashed Triton 2.51
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 0]


def test_ensemble_output_classifies_with_the_composing_models_labels(server) -> None:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 5], "data": X[:1]}],
            "outputs": [{"name": "Y", "parameters": {"classification": 2}}]}
    r = requests.post(f"{server.base()}/v2/models/cls_ens/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == ["7.250000:4:four", "2.000000:1:one"]  # as Triton 2.51


def test_integer_and_multi_dim_outputs(server) -> None:
    r = infer_json(server, "cls_nob", "INT32", [2, 3], [[1, 9, 3], [-4, 5, 6]], {"classification": 4})
    assert r.json()["outputs"][0]["shape"] == [4]  # no batching: the whole output is one entry
    assert r.json()["outputs"][0]["data"] == ["9:1", "6:5", "5:4", "3:2"]
    r = infer_json(server, "cls_u8", "UINT8", [1, 4], [[1, 200, 3, 200]], {"classification": 3})
    assert r.json()["outputs"][0]["data"] == ["200:1", "200:3", "3:2"]
    r = infer_json(server, "cls_2d", "FP64", [1, 2, 3], [[[1e20, 2.5, 3], [-1e-7, 0.1, 1 / 3]]],
                   {"classification": 4, "binary_data": True})
    header = int(r.headers["Inference-Header-Content-Length"])
    assert r.status_code == 200 and header > 0  # a binary answer: JSON header, then the BYTES blob
    blob = r.content[header:]
    strings, i = [], 0
    while i < len(blob):
        n = int.from_bytes(blob[i:i + 4], "little")
        strings.append(blob[i + 4:i + 4 + n].decode())
        i += 4 + n
    assert strings == ["100000000000000000000.000000:0", "3.000000:2", "2.500000:1", "0.333333:5"]


def test_clients_class_count(server) -> None:
    x = np.array(X, np.float32)
    h = httpclient.InferenceServerClient(server.http_url)
    i = httpclient.InferInput("INPUT0", [2, 5], "FP32")
    i.set_data_from_numpy(x)
    r = h.infer("cls_fp32", [i], outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    expected = [[b"7.250000:4:four", b"2.000000:1:one"], [b"5.000000:4:four", b"4.000000:2"]]
    assert r.as_numpy("OUTPUT0").tolist() == expected
    g = grpcclient.InferenceServerClient(server.grpc_url)
    i = grpcclient.InferInput("INPUT0", [2, 5], "FP32")
    i.set_data_from_numpy(x)
    r = g.infer("cls_fp32", [i], outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    assert r.as_numpy("OUTPUT0").tolist() == expected
    assert "classification" in g.get_server_metadata().extensions


def test_bad_requests_and_configs(server) -> None:
    r = infer_json(server, "cls_bool", "BOOL", [1, 3], [[True, False, True]], {"classification": 2})
    assert r.status_code == 400
    assert r.json()["error"] == "class result not available for output due to unsupported type 'BOOL'"
    for bad in (-1, "2", 2.5, True):  # Triton 2.51 answers these with 500
        r = infer_json(server, "cls_fp32", "FP32", [1, 5], X[:1], {"classification": bad})
        assert r.status_code == 400 and "Unable to set 'classification'" in r.json()["error"], (bad, r.text)
    index = {m["name"]: m for m in requests.post(f"{server.base()}/v2/repository/index", timeout=10).json()}
    assert index["cls_missing"]["state"] == "UNAVAILABLE"
    assert "failed to open text file for read" in index["cls_missing"]["reason"]
    assert "nope.txt" in index["cls_missing"]["reason"]
    assert "must name a file inside the model folder" in index["cls_outside"]["reason"]
    assert infer_json(server, "cls_fp32", "FP32", [1, 5], X[:1], {"classification": 1}).status_code == 200
