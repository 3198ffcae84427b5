"""An ensemble input declared optional may be left out: the step that reads it runs without it,
as Triton does (qa/L0_optional_input's ensemble cases). It failed with 'never received its inputs'.
Likewise a tensor a step's model did not produce: the steps that read it run without it, and an
ensemble output it was is left out of the response."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import start_pier

PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"

ENSEMBLE = """
name: "optional_ensemble"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "B" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ {
  model_name: "optional_sum" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "SUM" }
} ] }
"""


CONNECTING = """
name: "connecting"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 4 ] optional: true },
  { name: "B" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "optional_pass" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "x0" } output_map { key: "OUTPUT1" value: "x1" } },
  { model_name: "optional_pass" input_map { key: "INPUT0" value: "x0" } input_map { key: "INPUT1" value: "x1" }
    output_map { key: "OUTPUT0" value: "OUT0" } output_map { key: "OUTPUT1" value: "OUT1" } }
] }
"""


def test_a_tensor_a_step_did_not_produce_is_absent_downstream(tmp_path: Path) -> None:
    """qa L0_optional_input test_ensemble_optional_connecting_tensor: A alone reaches OUT0; x1 was
    never produced, so step 2 runs without it and OUT1 is not in the answer."""
    repo = tmp_path / "repo"
    shutil.copytree(PYTHON_MODELS / "optional_pass", repo / "optional_pass")
    (repo / "connecting" / "1").mkdir(parents=True)
    (repo / "connecting" / "config.pbtxt").write_text(CONNECTING)
    server = start_pier([repo], log_path=tmp_path / "p.log")
    a = np.arange(4, dtype=np.float32)
    try:
        for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
            client = module.InferenceServerClient(url)
            alone = [module.InferInput("A", [4], "FP32")]
            alone[0].set_data_from_numpy(a)
            for outputs in ([module.InferRequestedOutput("OUT0")], None):
                result = client.infer("connecting", alone, outputs=outputs)
                assert np.array_equal(result.as_numpy("OUT0"), a)
                assert result.as_numpy("OUT1") is None
            client.close()
    finally:
        assert server.stop() == 0


def test_a_step_runs_without_the_optional_input_the_request_left_out(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(PYTHON_MODELS / "optional_sum", repo / "optional_sum")
    (repo / "optional_ensemble" / "1").mkdir(parents=True)
    (repo / "optional_ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    server = start_pier([repo], log_path=tmp_path / "p.log")
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 10, dtype=np.float32)
    try:
        for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
            client = module.InferenceServerClient(url)
            both = [module.InferInput("A", [4], "FP32"), module.InferInput("B", [4], "FP32")]
            both[0].set_data_from_numpy(a)
            both[1].set_data_from_numpy(b)
            assert np.array_equal(client.infer("optional_ensemble", both).as_numpy("SUM"), a + b)
            alone = [module.InferInput("A", [4], "FP32")]
            alone[0].set_data_from_numpy(a)
            assert np.array_equal(client.infer("optional_ensemble", alone).as_numpy("SUM"), a)
            client.close()
    finally:
        server.stop()
