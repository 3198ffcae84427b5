"""What qa/L0_simple_ensemble checks of Triton's ensemble scheduler: a request that asks for some
of an ensemble's outputs runs only the steps those outputs depend on (the composing model's
statistics show it), and every ensemble response carries the sequence id and flags its steps ran
with (a streamed sequence reads START on its first response and END on its last)."""

from __future__ import annotations

import queue
import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, PierProcess, numpy_inputs, start_pier

# simple: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1; versions 1 and 2 both served.
# A_PLUS_2B needs steps 1 (version 1) and 2 (version 2); A_MINUS_B needs step 3 (version 2) only.
CHAIN = """name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "A_PLUS_2B" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "A_MINUS_B" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: 1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } },
  { model_name: "simple" model_version: 2
    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "A_PLUS_2B" } },
  { model_name: "simple" model_version: 2
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT1" value: "A_MINUS_B" } }
] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("ens_outputs")
    simple = repo / "simple"
    shutil.copytree(EXAMPLE_REPO / "simple", simple)
    shutil.copytree(simple / "1", simple / "2")
    config = simple / "config.pbtxt"
    config.write_text(config.read_text() + "\nversion_policy: { all { } }\n")
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(CHAIN)
    proc = start_pier([repo], log_path=Path(tmp_path_factory.mktemp("log")) / "pier.log")
    yield proc
    assert proc.stop() == 0


def _successes(server: PierProcess) -> dict[str, int]:
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("simple")
    return {m["version"]: m["inference_stats"]["success"]["count"] for m in stats["model_stats"]}


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.mark.parametrize("wanted,runs", [
    (("A_PLUS_2B",), {"1": 1, "2": 1}),
    (("A_MINUS_B",), {"1": 0, "2": 1}),
    ((), {"1": 1, "2": 2}),  # no outputs named: all of them, every step
])
def test_only_the_steps_the_requested_outputs_need_run(server, wanted, runs):
    client = httpclient.InferenceServerClient(server.http_url)
    before = _successes(server)
    outputs = [httpclient.InferRequestedOutput(name) for name in wanted] or None
    result = client.infer("chain", numpy_inputs(httpclient, {"A": A, "B": B}), outputs=outputs)
    after = _successes(server)
    assert {v: after[v] - before[v] for v in after} == runs
    names = {o["name"] for o in result.get_response()["outputs"]}
    assert names == (set(wanted) or {"A_PLUS_2B", "A_MINUS_B"})
    if "A_PLUS_2B" in names:
        np.testing.assert_array_equal(result.as_numpy("A_PLUS_2B"), A + 2 * B)
    if "A_MINUS_B" in names:
        np.testing.assert_array_equal(result.as_numpy("A_MINUS_B"), A - B)


def test_responses_carry_the_sequence_id_and_flags(server):
    http = httpclient.InferenceServerClient(server.http_url)
    response = http.infer("chain", numpy_inputs(httpclient, {"A": A, "B": B})).get_response()
    assert response["parameters"] == {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
    answers: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        for i in range(3):
            grpc.async_stream_infer("chain", numpy_inputs(grpcclient, {"A": A, "B": B}), request_id=f"r{i}",
                                    outputs=[grpcclient.InferRequestedOutput("A_PLUS_2B")],
                                    sequence_id=4242, sequence_start=i == 0, sequence_end=i == 2)
        flags = []
        for _ in range(3):
            answer = answers.get(timeout=30)
            assert not isinstance(answer, Exception), answer
            p = answer.get_response().parameters
            flags.append((p["sequence_id"].int64_param, p["sequence_start"].bool_param, p["sequence_end"].bool_param))
    finally:
        grpc.stop_stream()
    assert flags == [(4242, True, False), (4242, False, False), (4242, False, True)]
