"""The fault campaign's model repository (bench/chaos.py). Python models every server runs (Pier
and Triton 2.51's python backend alike: numpy 1 and 2), so that the same campaign applies to
both, and Pier's own extras (an ONNX model, a small random-weight LLM behind the OpenAI API):

- `addsub_py`: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (INT32 [16], dynamic batching);
- `count_py`: decoupled, N responses I = 0 .. N-1 from a thread of the model, DELAY_MS apart, then
  the final flag; it stops early when the request is cancelled (Triton's square example's shape);
- `seq_py`: a sequence's running sum, kept by the model per correlation ID (UINT64, filled in by
  the sequence batcher: Oldest strategy), plus the correlation ID on the last request (as Triton's
  dyna_sequence test model);
- `ens_py`: an ensemble of addsub_py twice: OUT_SUM = 2 * INPUT0, OUT_DIFF = 2 * INPUT1;
- Pier only: `simple` (ONNX, model_repository/simple), `tiny_llama` (backend llm)."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.common import ROOT

ADDSUB_CONFIG = """name: "addsub_py"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

ADDSUB = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (a + b).astype(np.int32)),
                                                         pb_utils.Tensor("OUTPUT1", (a - b).astype(np.int32))]))
        return responses
"""

COUNT_CONFIG = """name: "count_py"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

COUNT = """import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            delay = int(pb_utils.get_input_tensor_by_name(request, "DELAY_MS").as_numpy()[0]) / 1000.0
            threading.Thread(target=self.send, args=(request.get_response_sender(), n, delay), daemon=True).start()
        return None

    def send(self, sender, n, delay):
        for i in range(n):
            if sender.is_cancelled():
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
            if delay:
                time.sleep(delay)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SEQUENCE_CONFIG = """name: "seq_py"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 2000 }
}
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

SEQUENCE = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            values, starts, ends, corrids = (pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                                             for name in ("INPUT", "START", "END", "CORRID"))
            out = np.zeros((values.shape[0], 1), np.int64)
            for row in range(values.shape[0]):
                key = int(corrids[row][0])
                total = (0 if starts[row][0] else self.sums.get(key, 0)) + int(values[row][0])
                self.sums[key] = total
                out[row][0] = total + (key if ends[row][0] else 0)
                if ends[row][0]:
                    del self.sums[key]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
"""

ENSEMBLE_CONFIG = """name: "ens_py"
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUT_SUM" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUT_DIFF" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "addsub_py" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "INPUT1" }
    output_map { key: "OUTPUT0" value: "s" } output_map { key: "OUTPUT1" value: "d" } },
  { model_name: "addsub_py" model_version: -1
    input_map { key: "INPUT0" value: "s" } input_map { key: "INPUT1" value: "d" }
    output_map { key: "OUTPUT0" value: "OUT_SUM" } output_map { key: "OUTPUT1" value: "OUT_DIFF" } }
] }
"""

# dropped into the repository by the "corrupt file" fault: a model.py that does not even parse
BROKEN_CONFIG = ADDSUB_CONFIG.replace('name: "addsub_py"', 'name: "broken_py"')
BROKEN = "import numpy as np\nclass TritonPythonModel(:\n    this is not python\n"

LLM_CONFIG = ('backend: "llm"\n'
              'parameters { key: "kv_cache_memory_bytes" value { string_value: "16000000" } }\n')


def _write(repo: Path, name: str, config: str, files: dict[str, str | bytes]) -> None:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(config)
    for rel, content in files.items():
        path = folder / "1" / rel
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def write_repository(repo: Path, pier_extras: bool) -> None:
    """The campaign's models into `repo` (`pier_extras`: the ONNX model and the LLM too)."""
    _write(repo, "addsub_py", ADDSUB_CONFIG, {"model.py": ADDSUB})
    _write(repo, "count_py", COUNT_CONFIG, {"model.py": COUNT})
    _write(repo, "seq_py", SEQUENCE_CONFIG, {"model.py": SEQUENCE})
    (repo / "ens_py" / "1").mkdir(parents=True)
    (repo / "ens_py" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    if pier_extras:
        from tests.backends.llm.tiny_model import build_model

        shutil.copytree(ROOT / "model_repository" / "simple", repo / "simple")
        build_model(repo / "tiny_llama" / "1", "llama", max_position_embeddings=2048)
        (repo / "tiny_llama" / "config.pbtxt").write_text(LLM_CONFIG)


def drop_broken_model(repo: Path) -> Path:
    """The corrupt-file fault: a new model folder whose model.py does not parse."""
    _write(repo, "broken_py", BROKEN_CONFIG, {"model.py": BROKEN})
    return repo / "broken_py"
