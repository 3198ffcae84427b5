"""Ragged batching through the real server and a real ONNX model: concurrent requests of
DIFFERENT lengths share batches, each client gets exactly its own answer.

The model (built here with onnx.helper) is the ragged model of Triton's ragged_batching.md: INPUT
is 1-D over the whole batch (allow_ragged_batch), INDEX = BATCH_ACCUMULATED_ELEMENT_COUNT tells
where each request ends. SUM[i] = sum of request i's elements; DOUBLED = INPUT * 2 over the
flat batch, split back by BATCH_SCATTER_WITH_INPUT_SHAPE.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from scripts.build_example_models import _model, write_model
from tests.conftest import start_pier

CONFIG = """name: "ragged_sum"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] },
         { name: "DOUBLED" data_type: TYPE_FP32 dims: [ -1 ] } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" data_type: TYPE_FP32
                source_input: "INPUT" } ]
batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "DOUBLED" source_input: "INPUT" } ]
dynamic_batching { max_queue_delay_microseconds: 100000 }
"""


def ragged_sum_model() -> bytes:
    """INPUT [T], INDEX [N] (running element counts) -> SUM [N, 1], DOUBLED [T].

    SUM = gather(concat(0, cumsum(INPUT)), INDEX) minus the same shifted by one request."""
    f = TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(np.array(0, dtype=np.int64), "axis0"),
        numpy_helper.from_array(np.array([0.0], dtype=np.float32), "zero"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "s0"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "e_last"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
    ]
    nodes = [
        helper.make_node("CumSum", ["INPUT", "axis0"], ["cs"]),
        helper.make_node("Concat", ["zero", "cs"], ["cs0"], axis=0),
        helper.make_node("Cast", ["INDEX"], ["idx"], to=TensorProto.INT64),
        helper.make_node("Gather", ["cs0", "idx"], ["ends"], axis=0),
        helper.make_node("Concat", ["zero", "ends"], ["prev_all"], axis=0),
        helper.make_node("Slice", ["prev_all", "s0", "e_last"], ["prev"]),
        helper.make_node("Sub", ["ends", "prev"], ["sums"]),
        helper.make_node("Unsqueeze", ["sums", "axis1"], ["SUM"]),
        helper.make_node("Mul", ["INPUT", "two"], ["DOUBLED"]),
    ]
    graph = helper.make_graph(
        nodes, "ragged_sum",
        [helper.make_tensor_value_info("INPUT", f, ["T"]), helper.make_tensor_value_info("INDEX", f, ["N"])],
        [helper.make_tensor_value_info("SUM", f, ["N", 1]), helper.make_tensor_value_info("DOUBLED", f, ["T"])],
        inits,
    )
    return _model(graph)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "ragged_sum", CONFIG, ragged_sum_model())
    s = start_pier([repo], log_path=tmp_path_factory.mktemp("log") / "pier.log")
    yield s
    assert s.stop() == 0


def _infer(module, url: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inp = module.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = module.InferenceServerClient(url).infer("ragged_sum", [inp])
    return result.as_numpy("SUM"), result.as_numpy("DOUBLED")


def test_a_single_request_is_answered(server):
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    total, doubled = _infer(grpcclient, server.grpc_url, x)
    np.testing.assert_array_equal(total, [[10]])
    np.testing.assert_array_equal(doubled, x * 2)


def test_concurrent_requests_of_different_lengths_share_batches(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    before = client.get_inference_statistics("ragged_sum", as_json=True)["model_stats"][0]
    count = 24
    start = threading.Barrier(count)
    # Every length different (1..24, shuffled): without ragged batching no two could share a batch.
    lengths = [1 + (i * 7) % count for i in range(count)]
    assert sorted(lengths) == list(range(1, count + 1))

    def one(i: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        x = (np.arange(lengths[i], dtype=np.float32) + 100 * i).reshape(1, -1)
        module, url = (grpcclient, server.grpc_url) if i % 2 else (httpclient, server.http_url)
        start.wait(10)
        total, doubled = _infer(module, url, x)
        return i, x, total, doubled

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(one, range(count)))
    for i, x, total, doubled in answers:  # every client gets exactly its own answer
        assert total.shape == (1, 1), (i, total.shape)
        assert total[0, 0] == x.sum(), (i, total, x)
        assert doubled.shape == x.shape, (i, doubled.shape, x.shape)
        np.testing.assert_array_equal(doubled, x * 2)
    after = client.get_inference_statistics("ragged_sum", as_json=True)["model_stats"][0]
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert inferences == count
    assert executions < count, (executions, count)  # so requests of different lengths shared executions
    assert max(int(b["batch_size"]) for b in after["batch_stats"]) > 1


def test_config_reports_batch_input_and_output(server):
    config = httpclient.InferenceServerClient(server.http_url).get_model_config("ragged_sum")
    assert config["input"][0]["allow_ragged_batch"] is True
    assert config["batch_input"][0]["kind"] == "BATCH_ACCUMULATED_ELEMENT_COUNT"
    assert config["batch_input"][0]["target_name"] == ["INDEX"]
    assert config["batch_output"][0]["target_name"] == ["DOUBLED"]
