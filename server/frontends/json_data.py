"""JSON `data` <-> numpy for KServe tensors, shared by the HTTP codecs (infer, later generate)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pier.contract.errors import invalid_arg
from pier.tensors.datatypes import JSON_UNSUPPORTED, element_count, numpy_dtype, to_bytes_element

# numpy kinds a JSON array may hold for each target kind (b=bool, i/u=int, f=float): as Triton,
# true/false are not numbers and numbers are not booleans.
_ACCEPT = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def _flatten_strings(data: Any, out: list[bytes], name: str, depth: int = 0) -> None:
    if isinstance(data, list):
        if depth > 64:
            raise invalid_arg(f"'data' of input '{name}' is nested too deeply")
        for item in data:
            _flatten_strings(item, out, name, depth + 1)
    elif isinstance(data, str):
        out.append(data.encode("utf-8"))
    else:  # as Triton: a number or boolean is not a string
        raise invalid_arg(f"unable to parse 'data' of BYTES input '{name}': elements must be strings, "
                          f"got {json_type(data)}")


def array_from_json(data: Any, datatype: str, shape: list[int], name: str) -> np.ndarray:
    """Build the tensor for `data` (nested or flat, row-major) and check its element count."""
    if datatype in JSON_UNSUPPORTED:
        raise invalid_arg(
            f"receiving {datatype} data via JSON is not supported. Please use the binary data format for input {name}"
        )
    count = element_count(shape)
    if not isinstance(data, list):
        data = [data]
    if datatype == "BYTES":
        items: list[bytes] = []
        _flatten_strings(data, items, name)
        if len(items) != count:
            raise _count_error(name, count, len(items), shape)
        arr = np.empty(count, dtype=np.object_)
        arr[:] = items
        return arr.reshape(shape)
    dtype = numpy_dtype(datatype)
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError, RecursionError):
        depth, first = 0, data
        while isinstance(first, list) and first and depth <= 64:
            first, depth = first[0], depth + 1
        if depth > 64:
            raise invalid_arg(f"unable to parse 'data' of input '{name}': nested more than 64 deep") from None
        raise invalid_arg(f"{_TRITON_SHAPE_ERROR} (input '{name}': arrays must be regular, not ragged)") from None
    if raw.size != count:  # Triton's words alone: qa L0_http's test.sh compares the whole JSON body
        raise invalid_arg(_TRITON_SHAPE_ERROR)
    if dtype.kind in "iu" and raw.dtype.kind in "fO":
        # numpy turns a mix of ints beyond int64 into float64 (lossy): rebuild from the ints.
        return _big_ints(raw, data, dtype, datatype, shape, name)
    if raw.size and raw.dtype.kind not in _ACCEPT[dtype.kind]:
        raise invalid_arg(
            f"unable to parse 'data' of input '{name}': expected {datatype} values, got "
            f"{_KIND_NAMES.get(raw.dtype.kind, 'values of another type')}"
        )
    if raw.size and dtype.kind in "iu" and raw.dtype.kind in "iu":
        info = np.iinfo(dtype)
        if raw.min() < info.min or raw.max() > info.max:
            raise invalid_arg(f"a value of input '{name}' is out of range for {datatype}")
    return raw.astype(dtype, copy=False).reshape(shape)


_KIND_NAMES = {"U": "strings", "S": "strings", "b": "booleans", "f": "non-integer numbers", "i": "integers",
               "u": "integers"}


def json_type(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (for error messages)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", dict: "an object", list: "an array"}.get(
        type(value), type(value).__name__)


def _big_ints(raw: np.ndarray, data: Any, dtype: np.dtype, datatype: str, shape: list[int],
              name: str) -> np.ndarray:
    flat = np.array(data, dtype=np.object_).reshape(-1).tolist()
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
        raise invalid_arg(f"unable to parse 'data' of input '{name}': expected {datatype} values (integers)")
    try:
        return np.array(flat, dtype=dtype).reshape(shape)
    except OverflowError:
        raise invalid_arg(f"a value of input '{name}' is out of range for {datatype}") from None


# Triton 2.51's words for JSON data that does not fill its shape (probed); ragged data adds Pier's detail.
_TRITON_SHAPE_ERROR = "Unable to parse 'data': Shape does not match true shape of 'data' field"


def _count_error(name: str, expected: int, got: int, shape: list[int]):
    return invalid_arg(
        f"unexpected number of elements in 'data' of input '{name}': shape {shape} needs {expected}, got {got}"
    )


def array_to_json(array: np.ndarray, datatype: str) -> Any:
    """Flat JSON list for an output (BYTES as UTF-8 text)."""
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [to_bytes_element(x).decode("utf-8", "replace") for x in flat]
    if flat.dtype == np.float32 or flat.dtype == np.float16:
        # As Triton: the float widened to a double, written in full (0.1f -> 0.10000000149011612), so
        # the JSON equals the float32 array's .tolist(); orjson would write float32's short form (0.1).
        # FP16 the same way (Triton refuses FP16 as JSON: the client asked for JSON, so it gets JSON).
        return flat.astype(np.float64)
    if datatype == "BF16":  # uint16 bit patterns: the upper half of a float32
        return (flat.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return flat  # orjson serializes numpy arrays natively (OPT_SERIALIZE_NUMPY)
