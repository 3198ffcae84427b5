"""The stub protocol's typed messages (backends/python/messages.py) through a real stub process: a
message that does not decode, or of a kind no one knows, fails loudly (the server's log says
what and why) and fails only the request it concerns; the other requests of the same batch,
and later ones, are answered."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from pier.backends.python.process import ProcessInstance, default_launch
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.errors import PierError
from pier.contract.types import InferenceRequest, InstanceGroupSpec, ModelSpec, Outputs, Tensor, TensorSpec

# A decoupled model that, for a request whose X is negative, writes a broken message about that
# request straight onto its aux channel (as a stub of another version might) instead of answering.
MODEL = '''
import threading
import msgspec
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        aux = pb_utils._bls.services._stub.aux
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            rid = r._server_request._rid
            if x[0] == -1:  # a Send with a result that is not one
                aux.send(msgspec.msgpack.encode(["Send", rid, "not a result", True]))
                continue
            if x[0] == -2:  # a kind nobody knows (it concerns no request the server can tell)
                aux.send(msgspec.msgpack.encode(["Sned", rid, None, True]))
            sender = r.get_response_sender()
            def send(sender=sender, x=x):
                for _ in range(3):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=send).start()
        return None
'''


def _instance(tmp_path: Path) -> ProcessInstance:
    version_dir = tmp_path / "m" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.py").write_text(MODEL)
    spec = ModelSpec(name="m", platform="", backend="python", max_batch_size=0,
                     inputs=(TensorSpec("X", "FP32", (-1,)),), outputs=(TensorSpec("Y", "FP32", (-1,)),),
                     instance_groups=(InstanceGroupSpec("g", "KIND_CPU", 1),), default_model_filename="model.py",
                     parameters={}, decoupled=True)
    ctx = ModelContext(spec=spec, version=1, model_dir=version_dir.parent, version_dir=version_dir)
    return ProcessInstance(ctx, InstanceContext("m_0", "KIND_CPU"), default_launch())


class _Stream:
    def __init__(self, x: float) -> None:
        data = np.array([x], np.float32)
        self.request = InferenceRequest("m", "", [Tensor("X", "FP32", [1], data)])
        self.got: list[tuple[object, bool]] = []
        self.done = threading.Event()
        self.request.response_sink = self._sink

    def _sink(self, result: object, final: bool) -> None:
        self.got.append((result, final))
        if final:
            self.done.set()


def test_a_broken_message_fails_only_its_request(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    instance = _instance(tmp_path)
    try:
        with caplog.at_level(logging.ERROR, logger="pier.backends.python"):
            streams = [_Stream(1.0), _Stream(-1.0), _Stream(-2.0), _Stream(3.0)]
            assert instance.execute([s.request for s in streams]) == [Outputs([])] * 4
            assert all(s.done.wait(10) for s in streams)
        ok, broken, unknown, after = streams
        for good, x in ((ok, 1.0), (unknown, -2.0), (after, 3.0)):
            assert [float(r.tensors[0].data[0]) for r, _ in good.got[:3]] == [x] * 3  # type: ignore[attr-defined]
            assert good.got[3] == (None, True)
        ((error, final),) = broken.got
        assert final and isinstance(error, PierError)
        assert "unreadable stub-to-server message 'Send'" in error.message and "Expected" in error.message
        logged = caplog.text
        assert "unreadable stub-to-server message 'Send'" in logged
        assert "unreadable stub-to-server message 'Sned': unknown kind" in logged
        later = _Stream(5.0)  # the channel and the stub serve on
        instance.execute([later.request])
        assert later.done.wait(10) and len(later.got) == 4
    finally:
        instance.close()
