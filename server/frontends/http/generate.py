"""Triton's generate extension (HTTP only): `POST /v2/models/{m}[/versions/{v}]/generate` and
`/generate_stream`. A top-level key (or a key inside `parameters`) that names a model input
becomes that input tensor (a scalar or a 1-D list); the other keys become request parameters.
Answers are one JSON object per response: model_name, model_version, id, and one field per
output (single-element arrays unwrapped, BYTES as text); the stream is server-sent events."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import InferenceRequest, InferenceResponse, Tensor
from pier.tensors.datatypes import fill_variable_dim, numpy_dtype
from pier.tensors.validation import check_parameters


def check_duplicate_inputs(raw: bytes, metadata: dict[str, Any]) -> None:
    """As Triton: an input given twice at the top of the request is an error (JSON parsers keep the
    last one silently). A second, checking parse only when an input's quoted name occurs twice."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        return {"": [k for k, _ in items]}

    if not any(raw.count(json.dumps(i["name"], ensure_ascii=False).encode()) > 1 for i in metadata["inputs"]):
        return
    try:
        keys = json.loads(raw, object_pairs_hook=pairs)[""]
    except (ValueError, RecursionError, TypeError, KeyError):
        return  # the first parse accepted it: nothing more to learn here
    names = {i["name"] for i in metadata["inputs"]}
    seen: set[str] = set()
    for key in keys:
        if key in seen and key in names:
            raise invalid_arg(f"input '{key}' already exists in request")
        seen.add(key)


def _shape(dims: list[int], count: int, batching: bool) -> list[int]:
    """The tensor shape for `count` values: the model's dims (batch dim 1), a variable dim taking what
    the fixed ones leave (Triton shapes generate values to the config); flat when they cannot fit."""
    shape = list(dims)
    if batching and shape:
        shape[0] = 1
    free = [i for i, d in enumerate(shape) if d < 0]
    for i in free[:-1]:  # several variable dims: the last one takes the values
        shape[i] = 1
    filled = fill_variable_dim(shape, count)
    if filled is None:
        return [1, count] if batching else [count]
    return filled


def _tensor(name: str, datatype: str, value: Any, batching: bool, dims: list[int]) -> Tensor:
    values = value if isinstance(value, list) else [value]
    try:
        if datatype == "BYTES":
            if not all(isinstance(v, str) for v in values):  # Triton's words for an object, number or null
                raise ValueError("attempt to access JSON non-string as string")
            data = np.array([s.encode("utf-8") for s in values], dtype=object)
        elif datatype == "BOOL":
            if not all(isinstance(v, bool) for v in values):  # Triton's words, then what is wanted
                raise ValueError("attempt to access JSON non-boolean as boolean (expected true or false)")
            data = np.array(values, dtype=bool)
        else:
            if any(isinstance(v, (bool, str, dict, list)) or v is None for v in values):
                raise ValueError("expected numbers")
            dtype = numpy_dtype(datatype)
            if dtype.kind in "iu" and any(isinstance(v, float) and not v.is_integer() for v in values):
                raise ValueError("expected integers")  # not silently truncated
            data = np.array(values, dtype=dtype)
    except (ValueError, OverflowError) as exc:
        raise invalid_arg(f"generate: input '{name}' ({datatype}): {exc}") from None
    data = data.reshape(_shape(dims, data.size, batching))
    return Tensor(name, datatype, list(data.shape), data)


def decode(model: str, version: str, doc: Any, metadata: dict[str, Any], batching: bool) -> InferenceRequest:
    if not isinstance(doc, dict):
        raise invalid_arg("the generate request must be a JSON object")
    datatypes = {i["name"]: i["datatype"] for i in metadata["inputs"]}
    dims = {i["name"]: list(i["shape"]) for i in metadata["inputs"]}
    extra = doc.get("parameters", {})
    if not isinstance(extra, dict):
        raise invalid_arg("Expected JSON object for keyword: 'parameters'")  # Triton's words
    tensors: dict[str, Tensor] = {}
    params: dict[str, Any] = {}
    for source in ({k: v for k, v in doc.items() if k not in ("id", "parameters")}, extra):
        found: dict[str, Any] = {}
        for key, value in source.items():
            if key in datatypes:
                if key in tensors:  # top level and in `parameters`
                    raise invalid_arg(f"input '{key}' already exists in request")
                tensors[key] = _tensor(key, datatypes[key], value, batching, dims[key])
            else:
                found[key] = value
        if source is extra:
            try:
                check_parameters(found)
            except PierError as exc:  # Triton names where the parameter came from
                raise invalid_arg(f"Converting keyword: 'parameters': {exc.message}") from None
        params.update(found)
    check_parameters(params)
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise invalid_arg("generate: 'id' must be a string")
    return InferenceRequest(model, version, list(tensors.values()), id=request_id, parameters=params)


def encode(response: InferenceResponse) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    for t in response.outputs:
        flat = t.data.reshape(-1)
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in flat.tolist()]
        doc[t.name] = values[0] if len(values) == 1 else values
    return doc
