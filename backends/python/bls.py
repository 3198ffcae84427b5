"""Conversions between pb_utils objects and Pier's internal request/response types (BLS calls
and the requests a Python model executes)."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator, Sequence
from typing import Any

import numpy as np

from pier.backends.python import triton_python_backend_utils as pb_utils
from pier.contract.backend import ServerServices
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor

_CODES = {
    pb_utils.TritonError.UNKNOWN: ErrorCode.UNKNOWN, pb_utils.TritonError.INTERNAL: ErrorCode.INTERNAL,
    pb_utils.TritonError.NOT_FOUND: ErrorCode.NOT_FOUND, pb_utils.TritonError.INVALID_ARG: ErrorCode.INVALID_ARG,
    pb_utils.TritonError.UNAVAILABLE: ErrorCode.UNAVAILABLE, pb_utils.TritonError.UNSUPPORTED: ErrorCode.UNSUPPORTED,
    pb_utils.TritonError.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    pb_utils.TritonError.CANCELLED: ErrorCode.CANCELLED,
}
_PB_CODES = {v: k for k, v in _CODES.items()}


def datatype_of(array: np.ndarray) -> str:
    """KServe datatype for a numpy array a model produced (object/str/bytes arrays are BYTES)."""
    kind = array.dtype.kind
    if kind in ("O", "S", "U"):
        return "BYTES"
    name = pb_utils.numpy_to_triton_type(array.dtype)
    return name[len("TYPE_"):]


def to_pier_tensor(t: pb_utils.Tensor, datatype: str | None = None) -> Tensor:
    data = t.as_numpy()
    dt = datatype or datatype_of(data)
    if dt == "BYTES" and data.dtype != np.object_:
        data = data.astype(object)
    return Tensor(t.name(), dt, list(data.shape), data)


def to_server_request(r: pb_utils.InferenceRequest) -> InferenceRequest:
    """A BLS request, as the data plane takes it."""
    if not r.model_name():
        raise pb_utils.TritonModelException("a BLS InferenceRequest needs a model_name")
    version = "" if r.model_version() < 0 else str(r.model_version())
    params: dict[str, Any] = dict(r._parameters)
    if r.timeout():
        params["timeout"] = int(r.timeout())
    return InferenceRequest(r.model_name(), version, [to_pier_tensor(t) for t in r.inputs()],
                            [RequestedOutput(n) for n in r.requested_output_names()], id=r.request_id(),
                            parameters=params, trace_context=r._traceparent)


# Request parameters the frontends and schedulers consume: Triton does not hand them to the model.
_PROTOCOL_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "timeout", "priority",
                                  "binary_data_output", "triton_enable_empty_final_response"})


def to_pb_request(request: InferenceRequest, all_outputs: Sequence[str] = ()) -> pb_utils.InferenceRequest:
    """A request a Python model executes. As Triton: a request that names no outputs requests them
    all (`all_outputs`, the config's), and protocol parameters are not the model's."""
    params = request.parameters
    out = pb_utils.InferenceRequest(
        request.model_name, [pb_utils.Tensor(t.name, t.data) for t in request.inputs],
        request.output_names() or list(all_outputs), correlation_id=params.get("sequence_id", 0),
        request_id=request.id,
        flags=(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0)
        | (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0),
        timeout=int(params.get("timeout", 0) or 0),
        model_version=int(request.model_version) if request.model_version.isdigit() else -1,
        parameters={k: v for k, v in params.items() if k not in _PROTOCOL_PARAMETERS} if params else None,
        trace=pb_utils.InferenceTrace(request.trace_context))
    out._server_request = request
    return out


def to_pb_response(item: InferenceResponse | BaseException) -> pb_utils.InferenceResponse:
    if isinstance(item, PierError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(item.message, _PB_CODES.get(item.code, 1)))
    if isinstance(item, BaseException):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(item)))
    tensors = [pb_utils.Tensor(t.name, t.data) for t in item.outputs]
    return pb_utils.InferenceResponse(tensors, parameters={k: v for k, v in item.parameters.items()})


def error_of(err: pb_utils.TritonError) -> PierError:
    return PierError(_CODES.get(err.code(), ErrorCode.INTERNAL), err.message())


class BlsClient:
    """What `pb_utils.InferenceRequest.exec` / `async_exec` and the model-control helpers call:
    the server's services, with pb_utils objects converted at this edge (pb_utils itself imports
    nothing of Pier's)."""

    def __init__(self, services: ServerServices) -> None:
        self.services = services

    def exec(self, pb_request: pb_utils.InferenceRequest,
             decoupled: bool) -> pb_utils.InferenceResponse | Iterator[pb_utils.InferenceResponse]:
        request = to_server_request(pb_request)
        if decoupled:
            return (to_pb_response(item) for item in self.services.infer_stream(request))
        try:
            return to_pb_response(self.services.infer(request))
        except Exception as exc:  # errors come back in the response, as in Triton
            return to_pb_response(exc)

    def async_exec(self, pb_request: pb_utils.InferenceRequest, decoupled: bool) -> Awaitable[Any]:
        request = to_server_request(pb_request)
        services = self.services
        if decoupled:  # awaited, it gives every response (the last one may be empty: the final flag)
            async def collect() -> list[pb_utils.InferenceResponse]:
                return [to_pb_response(item) async for item in services.infer_stream_async(request)]
            return collect()

        async def one() -> pb_utils.InferenceResponse:
            try:
                return to_pb_response(await services.infer_async(request))
            except Exception as exc:
                return to_pb_response(exc)
        return one()
