"""ModelInferRequest/Response <-> InferenceRequest/InferenceResponse. Inputs may come as
`raw_input_contents` (one blob per input) or typed `contents`; outputs always go back as
`raw_output_contents`, as Triton does."""

from __future__ import annotations

from typing import Any

import numpy as np

from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from pier.dataplane.shared_memory import (
    SystemSharedMemory,
    check_output,
    read_input,
    regions_named,
    without_placement,
    write_output,
)
from pier.protocol import grpc_service_pb2 as pb
from pier.tensors.datatypes import RawInputs, check_dims, element_count, from_raw, is_datatype, numpy_dtype, to_raw
from pier.tensors.validation import check_parameters

# datatype -> InferTensorContents field
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# The numpy dtype each typed contents field holds (before narrowing to the datatype).
_FIELD_DTYPE = {
    "bool_contents": np.bool_, "int_contents": np.int32, "int64_contents": np.int64,
    "uint_contents": np.uint32, "uint64_contents": np.uint64, "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}

_FIELD_TYPE = {
    "bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64", "uint_contents": "UINT32",
    "uint64_contents": "UINT64", "fp32_contents": "FP32", "fp64_contents": "FP64", "bytes_contents": "BYTES",
}


def param_value(p: Any) -> Any:
    """InferParameter / ModelRepositoryParameter -> Python value."""
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def set_param(target: Any, value: Any) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def params_dict(params: Any) -> dict[str, Any]:
    return {k: param_value(v) for k, v in params.items()}


def _in_shm(t: Any) -> bool:
    return bool(t.parameters) and "shared_memory_region" in t.parameters


def names_shared_memory(req: pb.ModelInferRequest) -> bool:
    """Whether a request puts an input or an output in shared memory (read before decoding it)."""
    return any(_in_shm(t) for t in req.inputs) or any(_in_shm(o) for o in req.outputs)


def _check_raw_count(raw: Any, sent: list[Any], model: str) -> None:
    if len(raw) < len(sent):
        raise invalid_arg(f"unable to find data for input tensor '{sent[len(raw)].name}' for model '{model}'")
    if len(raw) > len(sent):
        raise invalid_arg(f"raw_input_contents has {len(raw)} entries but the request has {len(sent)} inputs "
                          "that are not in shared memory")


def _contents_conflict(name: str, model: str) -> PierError:
    return invalid_arg(f"contents field must not be specified when using raw_input_contents for '{name}' "
                       f"for model '{model}'")


def decode_request(req: pb.ModelInferRequest, shm: SystemSharedMemory | None = None) -> InferenceRequest:
    """`shm`: the registered shared-memory regions inputs and outputs may name (None: none may).
    raw_input_contents holds one entry per input that is not in shared memory, in order."""
    raw = req.raw_input_contents
    model = req.model_name
    req_inputs = req.inputs
    if raw and len(raw) != len(req_inputs):  # equal counts with an input in shared memory: see the loop
        for t in req_inputs:  # as Triton, an input that has contents fails first
            if t.HasField("contents") and not _in_shm(t):
                raise _contents_conflict(t.name, model)
        _check_raw_count(raw, [t for t in req_inputs if not _in_shm(t)], model)
    inputs = []
    i = 0
    buffers = RawInputs(model, req.id)
    for t in req_inputs:
        name, datatype = t.name, t.datatype
        if not is_datatype(datatype):
            raise invalid_arg(f"invalid datatype for input {name}")
        shape = t.shape[:]
        check_dims(shape, name)
        params: dict[str, Any] = {}
        if t.parameters:  # rare: skip building and checking an empty dict
            params = params_dict(t.parameters)
            check_parameters(params)
            if "shared_memory_region" in params:
                if raw and len(raw) == len(req_inputs):
                    _check_raw_count(raw, [t for t in req_inputs if not _in_shm(t)], model)
                if t.HasField("contents"):
                    raise invalid_arg(f"input '{name}' is in shared memory and must not also have contents")
                data = read_input(shm, params, datatype, shape, name, model, req.id)
                inputs.append(Tensor(name, datatype, shape, data, without_placement(params)))
                continue
        if raw:
            if t.HasField("contents"):
                raise _contents_conflict(name, model)
            data = buffers.decode(raw[i], datatype, shape, name) if datatype == "BYTES" else \
                from_raw(raw[i], datatype, shape, name, model, req.id)
        else:
            data = _from_contents(t, datatype, shape, model)
        inputs.append(Tensor(name, datatype, shape, data, params))
        i += 1
    buffers.check()
    outputs = []
    if req.outputs:
        for o in req.outputs:
            params = params_dict(o.parameters)
            check_parameters(params)
            check_output(params, shm)
            outputs.append(RequestedOutput(o.name, params))
    params = {}
    if req.parameters:
        params = params_dict(req.parameters)
        check_parameters(params)
    request = InferenceRequest(model, req.model_version, inputs, outputs, req.id, params)
    if shm is not None and (len(raw) != len(req_inputs) or outputs):
        request.shm_regions = regions_named(list(req_inputs), outputs)
    return request


def _from_contents(t: Any, datatype: str, shape: list[int], model: str) -> np.ndarray:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise invalid_arg(f"input '{t.name}' is {datatype}, which must be sent in raw_input_contents")
    for fd, _ in t.contents.ListFields():
        if fd.name != field:
            raise invalid_arg(
                f"unexpected explicit tensor data for input tensor '{t.name}' for model '{model}' of type "
                f"'{_FIELD_TYPE[fd.name]}', expected datatype '{datatype}'"
            )
    values = getattr(t.contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise invalid_arg(
            f"unexpected number of elements in contents of input '{t.name}': shape {shape} needs {count}, "
            f"got {len(values)}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=np.object_)
        arr[:] = list(values)
        return arr.reshape(shape)
    dtype = numpy_dtype(datatype)
    arr = np.asarray(values, dtype=_FIELD_DTYPE[field])
    if arr.size and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise invalid_arg(f"a value of input '{t.name}' is out of range for {datatype}")
    return arr.astype(dtype, copy=False).reshape(shape)


def encode_response(resp: InferenceResponse, request: InferenceRequest | None = None,
                    shm: SystemSharedMemory | None = None) -> pb.ModelInferResponse:
    """Outputs that `request` asked for in shared memory are written there; their
    raw_output_contents entry is empty (as Triton's), keeping the entries aligned with outputs."""
    out = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id)
    wanted = {o.name: o.parameters for o in request.outputs} if request is not None else {}
    for t in resp.outputs:
        o = out.outputs.add()
        o.name = t.name
        o.datatype = t.datatype
        o.shape.extend(t.shape)
        if shm is not None and wanted and write_output(shm, t, wanted.get(t.name, {})):
            out.raw_output_contents.append(b"")
            continue
        for k, v in t.parameters.items():
            set_param(o.parameters[k], v)
        out.raw_output_contents.append(to_raw(t.data, t.datatype))
    for k, v in resp.parameters.items():
        set_param(out.parameters[k], v)
    return out
