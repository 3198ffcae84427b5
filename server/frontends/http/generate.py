"""Triton's generate extension (HTTP only): `POST /v2/models/{m}[/versions/{v}]/generate` and
`/generate_stream`. A top-level key (or a key inside `parameters`) that names a model input
becomes that input tensor (a scalar or a 1-D list); the other keys become request parameters.
Answers are one JSON object per response: model_name, model_version, id, and one field per
output (single-element arrays unwrapped, BYTES as text); the stream is server-sent events."""

from __future__ import annotations

from typing import Any

import numpy as np

from server.datatypes import numpy_dtype
from server.errors import invalid_arg
from server.types import InferenceRequest, InferenceResponse, Tensor
from server.validation import check_parameters


def _tensor(name: str, datatype: str, value: Any, batching: bool) -> Tensor:
    values = value if isinstance(value, list) else [value]
    try:
        if datatype == "BYTES":
            if not all(isinstance(v, str) for v in values):  # Triton's words for an object, number or null
                raise ValueError("attempt to access JSON non-string as string")
            data = np.array([s.encode("utf-8") for s in values], dtype=object)
        elif datatype == "BOOL":
            if not all(isinstance(v, bool) for v in values):
                raise ValueError("expected true or false")
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
    if batching:
        data = data.reshape(1, -1)
    return Tensor(name, datatype, list(data.shape), data)


def decode(model: str, version: str, doc: Any, metadata: dict[str, Any], batching: bool) -> InferenceRequest:
    if not isinstance(doc, dict):
        raise invalid_arg("the generate request must be a JSON object")
    datatypes = {i["name"]: i["datatype"] for i in metadata["inputs"]}
    extra = doc.get("parameters", {})
    if not isinstance(extra, dict):
        raise invalid_arg("generate: 'parameters' must be a JSON object")
    tensors: dict[str, Tensor] = {}
    params: dict[str, Any] = {}
    for source in ({k: v for k, v in doc.items() if k not in ("id", "parameters")}, extra):
        for key, value in source.items():
            if key in datatypes:
                tensors[key] = _tensor(key, datatypes[key], value, batching)
            else:
                params[key] = value
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
