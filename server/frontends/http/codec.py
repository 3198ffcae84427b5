"""KServe-v2 HTTP infer bodies <-> InferenceRequest/InferenceResponse, with Triton's binary
tensor data extension (JSON header + raw blobs, `Inference-Header-Content-Length`).
Error wording follows Triton's where clients and test suites match on it."""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from pier.contract.errors import ErrorCode, PierError, internal, invalid_arg
from pier.contract.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from pier.dataplane.shared_memory import (
    SystemSharedMemory,
    check_output,
    read_input,
    regions_named,
    without_placement,
    write_output,
)
from pier.frontends.json_data import array_from_json, array_to_json
from pier.tensors.datatypes import RawInputs, check_dims, element_size, fill_variable_dim, from_raw, is_datatype, to_raw
from pier.tensors.validation import check_parameters

HEADER_LENGTH = "Inference-Header-Content-Length"
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY
_ONE_OF = ("Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
           "'shared_memory_region' in 'parameters'.")


def parse_json(body: bytes | memoryview, what: str = "request JSON") -> Any:
    """orjson first (fast); the stdlib parser only for what orjson refuses but Triton accepts:
    the NaN / Infinity / -Infinity literals that tritonclient writes for non-finite floats."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        error = exc
    try:
        doc = json.loads(bytes(body))
        # orjson refuses a \ud800-style escape of an unpaired surrogate (no character of UTF-8 can
        # hold it); the stdlib keeps it in a str that every later encode would fail on.
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        raise invalid_arg(f"failed to parse the {what}: {error}") from None
    return doc


def decode_base64(value: Any, what: str) -> bytes:
    """A base64 string from a JSON body (the load API's file parameters)."""
    if not isinstance(value, str):
        raise invalid_arg(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid_arg(f"{what} is not valid base64: {exc}") from None


async def read_body(request: web.Request, limit: int, json_only: bool) -> bytes:
    """The request body. A compressed body is inflated only up to `limit` (--http-max-input-size):
    a 2 MB gzip body can expand to gigabytes. A body that is all JSON (`json_only`) is held to the
    limit too, refused before it is read when its declared length is already past it."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        if json_only and request.content_length is not None:
            check_json_size(request.content_length, limit)
        body = await request.read()
        if json_only:  # a chunked body declares no length
            check_json_size(len(body), limit)
        return body
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise PierError(ErrorCode.TOO_LARGE, f"the {encoding}-decoded request body exceeds {limit} bytes. "
                            "Use --http-max-input-size to increase the limit.")
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_size(json_length: int, limit: int) -> None:
    """--http-max-input-size bounds the JSON part of a request, as in Triton (binary tensor data
    after it is not counted)."""
    if json_length > limit:
        raise PierError(
            ErrorCode.TOO_LARGE,
            f"Request JSON size of {json_length} exceeds the maximum allowed value of {limit}. "
            "Use --http-max-input-size to increase the limit.",
        )


def header_length(value: str | None, body_length: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise invalid_arg(f"{HEADER_LENGTH} header must be an integer, got '{value}'") from None
    if n < 0 or n > body_length:
        raise invalid_arg(f"inference header size should be in range (0, {body_length}), got: {n}")
    return n


def _dict(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_arg(f"'{what}' must be a JSON object")
    return value


def is_raw_binary(headers: Any) -> bool:
    """Whether the request headers announce Triton's raw binary body (Inference-Header-Content-Length
    0: no JSON header, the body is the one input's bytes, decoded against the model's signature)."""
    value = headers.get(HEADER_LENGTH)
    try:
        return value is not None and int(value) == 0
    except ValueError:  # decoding says what is wrong with it
        return False


def parse_infer_body(body: bytes, json_length: int | None) -> tuple[Any, memoryview]:
    """An infer body's JSON header, parsed, and the binary blobs after it. `json_length` is the
    Inference-Header-Content-Length (None: all JSON)."""
    view = memoryview(body)
    if json_length is None:
        header, blobs = view, view[len(view):]
    else:
        header, blobs = view[:json_length], view[json_length:]
    return parse_json(header), blobs


def names_shared_memory(doc: Any) -> bool:
    """Whether a parsed JSON header puts an input or an output in shared memory (its parameters
    name a `shared_memory_region`, well formed or not). Tolerant: what is malformed otherwise is
    for decoding to refuse."""
    if not isinstance(doc, dict):
        return False
    for key in ("inputs", "outputs"):
        items = doc.get(key)
        if isinstance(items, list):
            for item in items:
                params = item.get("parameters") if isinstance(item, dict) else None
                if isinstance(params, dict) and "shared_memory_region" in params:
                    return True
    return False


def decode_request(model: str, version: str, body: bytes, json_length: int | None,
                   shm: SystemSharedMemory | None = None) -> InferenceRequest:
    """Parse an infer body. `json_length` is the Inference-Header-Content-Length (None: all JSON;
    0 is a raw binary request, see `decode_raw_request`). `shm`: the registered shared-memory
    regions inputs and outputs may name (None: none may)."""
    return decode_parsed(model, version, *parse_infer_body(body, json_length), shm)


def decode_parsed(model: str, version: str, doc: Any, blobs: memoryview,
                  shm: SystemSharedMemory | None = None) -> InferenceRequest:
    """`decode_request` for a body `parse_infer_body` split already."""
    if not isinstance(doc, dict):
        raise invalid_arg("the request JSON must be an object")
    rid = doc.get("id", "")
    if not isinstance(rid, str):
        raise invalid_arg("'id' must be a string")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise invalid_arg("the request JSON must have an 'inputs' array")
    offset = 0
    inputs: list[Tensor] = []
    buffers = RawInputs(model, rid)
    for i, item in enumerate(raw_inputs):
        tensor, offset = _decode_input(item, i, blobs, offset, buffers, shm)
        inputs.append(tensor)
    buffers.check()
    if offset != len(blobs):
        raise invalid_arg(f"unexpected additional input data for model '{model}'")
    outputs = []
    raw_outputs = doc.get("outputs", [])
    if not isinstance(raw_outputs, list):
        raise invalid_arg("'outputs' must be an array")
    for item in raw_outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise invalid_arg("each requested output must be an object with a 'name'")
        params = _dict(item.get("parameters"), "outputs.parameters")
        check_parameters(params)
        check_output(params, shm)
        outputs.append(RequestedOutput(item["name"], params))
    params = _dict(doc.get("parameters"), "parameters")
    check_parameters(params)
    request = InferenceRequest(model, version, inputs, outputs, rid, params)
    if shm is not None:
        request.shm_regions = regions_named(raw_inputs, outputs)
    return request


def decode_raw_request(model: str, version: str, metadata: dict[str, Any], batching: bool,
                       body: bytes) -> InferenceRequest:
    """Triton's raw binary request (Inference-Header-Content-Length: 0): the body is the one
    input's bytes, batch 1, and every output comes back binary."""
    inputs = metadata["inputs"]
    if len(inputs) != 1:
        raise invalid_arg(
            f"[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(inputs)} inputs in '{model}' model configuration"
        )
    spec = inputs[0]
    name, datatype = spec["name"], spec["datatype"]
    shape = list(spec["shape"])
    if batching:
        shape[0] = 1
    prefix = "[request id: <id_unknown>] "
    if datatype == "BYTES":  # as Triton: the body is the one element, with no length prefix
        if shape[1 if batching else 0:] != [1]:
            raise invalid_arg(f"{prefix}For BYTE datatype raw input '{name}', the model must have input shape [1]")
        data = np.empty(1, dtype=np.object_)
        data[0] = body
        data = data.reshape(shape)
        return InferenceRequest(model, version, [Tensor(name, datatype, shape, data)], [], "",
                                {"binary_data_output": True})
    variable = [i for i, d in enumerate(shape) if d == -1]
    if len(variable) > 1:
        raise invalid_arg(f"{prefix}The shape of the raw input '{name}' can not be deduced because there are more "
                          "than one variable-sized dimension")
    if variable:
        size = element_size(datatype)
        filled = None if size is None or len(body) % size else fill_variable_dim(shape, len(body) // size)
        if filled is None:
            raise invalid_arg(
                f"{prefix}cannot infer the shape {shape} of input '{name}' from a raw binary body of {len(body)} bytes"
            )
        shape = filled
    data = from_raw(memoryview(body), datatype, shape, name, model)
    return InferenceRequest(model, version, [Tensor(name, datatype, shape, data)], [], "",
                            {"binary_data_output": True})


def _decode_input(item: Any, index: int, blobs: memoryview, offset: int, buffers: RawInputs,
                  shm: SystemSharedMemory | None) -> tuple[Tensor, int]:
    model = buffers.model
    if not isinstance(item, dict):
        raise invalid_arg(f"input {index} must be a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_arg(f"input {index} must have a 'name'")
    datatype = item.get("datatype")
    if not isinstance(datatype, str) or not is_datatype(datatype):
        raise invalid_arg(f"invalid datatype for input {name}")
    shape = item.get("shape")
    if not isinstance(shape, list):
        raise invalid_arg(f"input '{name}' must have a 'shape' array of integers")
    for d in shape:  # parsed JSON: exact types, so `type(d) is int` excludes bools and floats
        if type(d) is not int:
            raise invalid_arg(f"input '{name}' must have a 'shape' array of integers")
    check_dims(shape, name)
    params = _dict(item.get("parameters"), f"parameters of input '{name}'")
    size = params.get("binary_data_size")
    has_data = "data" in item
    in_shm = "shared_memory_region" in params
    if has_data + (size is not None) + in_shm != 1:
        present = [k for k, on in (("data", has_data), ("binary_data_size", size is not None),
                                    ("shared_memory_region", in_shm)) if on]
        got = "no field is set" if not present else "set " + " ".join(f"'{k}'" for k in present)
        raise invalid_arg(f"{_ONE_OF} But {got}")  # Triton's words (it does not name the input either)
    if in_shm:
        data = read_input(shm, params, datatype, shape, name, model, buffers.request_id)
        return Tensor(name, datatype, shape, data, without_placement(params)), offset
    if size is not None:
        if type(size) is not int or size < 0:
            raise invalid_arg(f"binary_data_size of input '{name}' must be a non-negative integer")
        if offset + size > len(blobs):
            raise invalid_arg(
                f"unexpected size for input '{name}', expecting {offset + size - len(blobs)} additional bytes "
                f"for model '{model}'"
            )
        data = buffers.decode(blobs[offset:offset + size], datatype, shape, name)
        offset += size
    else:
        data = array_from_json(item["data"], datatype, shape, name)
    if len(params) == (size is not None):  # nothing but binary_data_size (or nothing at all)
        rest: dict[str, Any] = {}
    else:
        rest = {k: v for k, v in params.items() if k != "binary_data_size"}
    return Tensor(name, datatype, shape, data, rest), offset


def _has_non_finite(data: Any) -> bool:
    """Whether an output's JSON data (array_to_json's) holds NaN or an infinity."""
    if not isinstance(data, np.ndarray) or data.dtype.kind != "f" or not data.size:
        return False
    if data.size <= 256:  # numpy's per-call overhead dominates small tensors
        return not all(map(math.isfinite, data.ravel().tolist()))
    return not bool(np.isfinite(data).all())


def encode_response(response: InferenceResponse, request: InferenceRequest,
                    shm: SystemSharedMemory | None = None) -> tuple[bytes, int | None]:
    """The response body, and the JSON header length when binary blobs follow (else None).
    Outputs requested in shared memory are written there and carry no data."""
    # As Triton: `binary_data_output` is the format of the outputs a request gets without naming
    # them; an output the request names is JSON unless its own `binary_data` says otherwise.
    default_binary = not request.outputs and request.parameters.get("binary_data_output", False) is True
    wanted = {o.name: o.parameters for o in request.outputs}
    outs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    non_finite = any_binary = False
    for t in response.outputs:
        p = wanted.get(t.name, {})
        binary = p.get("binary_data", default_binary) is True
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if shm is not None and write_output(shm, t, p):
            outs.append(entry)
            continue
        if binary:
            any_binary = True
            blob = to_raw(t.data, t.datatype)
            entry["parameters"] = {**t.parameters, "binary_data_size": len(blob)}
            if blob:
                blobs.append(blob)
        else:
            if t.parameters:
                entry["parameters"] = t.parameters
            entry["data"] = data = array_to_json(t.data, t.datatype)
            non_finite = non_finite or _has_non_finite(data)
        outs.append(entry)
    doc: dict[str, Any] = {}
    if response.id:
        doc["id"] = response.id
    doc["model_name"] = response.model_name
    doc["model_version"] = response.model_version
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outs
    header = _dumps_with_non_finite(doc) if non_finite else _dumps(doc)
    if not any_binary:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _dumps(doc: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(doc, option=_JSON_OPTS)
    except TypeError as exc:
        raise internal(f"cannot encode an output as JSON: {exc}") from None


def _dumps_with_non_finite(doc: dict[str, Any]) -> bytes:
    """orjson writes NaN/Inf as null; Triton writes NaN, Infinity, -Infinity (which tritonclient
    and Python's json read back). Rare, so the slower stdlib encoder is fine here."""
    for out in doc["outputs"]:
        if isinstance(out.get("data"), np.ndarray):
            out["data"] = out["data"].tolist()
    return json.dumps(doc, separators=(",", ":")).encode()
