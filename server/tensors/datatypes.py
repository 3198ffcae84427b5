"""KServe-v2 datatypes: names, numpy dtypes, config enums, and raw (binary) tensor layout.

Raw layout (HTTP binary extension, gRPC raw contents, shared memory): little-endian, row-major,
no padding; BOOL is one byte; each BYTES element is a uint32 little-endian length then its bytes.
BF16 has no numpy dtype: it travels as its raw 16-bit patterns in a uint16 array.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from pier.contract.errors import PierError, invalid_arg

_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
    "BYTES": np.dtype(np.object_),
}

# Datatypes JSON cannot carry (Triton: "use binary data format").
JSON_UNSUPPORTED = frozenset({"FP16", "BF16"})

_LEN = struct.Struct("<I")


def is_datatype(name: str) -> bool:
    return name in _NUMPY


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype that holds `datatype` elements (object for BYTES, uint16 for BF16)."""
    try:
        return _NUMPY[datatype]
    except KeyError:
        raise invalid_arg(f"invalid datatype '{datatype}'") from None


def element_size(datatype: str) -> int | None:
    """Bytes per element, or None for BYTES (variable length)."""
    if datatype == "BYTES":
        return None
    return numpy_dtype(datatype).itemsize


def config_to_datatype(config_type: str) -> str:
    """Model-config enum name (TYPE_FP32, TYPE_STRING) -> KServe datatype (FP32, BYTES)."""
    name = config_type[5:] if config_type.startswith("TYPE_") else config_type
    return "BYTES" if name == "STRING" else name


def datatype_to_config(datatype: str) -> str:
    """KServe datatype -> model-config enum name."""
    return "TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


MAX_DIMS = 64  # numpy's limit on an array's dimensions
MAX_SPAN = 2**59  # numpy's bound on an array's dims product (x itemsize < 2**63), for 16-byte elements


def fill_variable_dim(shape: Sequence[int], count: int) -> list[int] | None:
    """`shape` with its one variable dim (-1) sized to hold `count` elements (a shape without one
    must hold exactly `count`); None when it has several, or its fixed dims do not divide `count`."""
    free = [i for i, d in enumerate(shape) if d < 0]
    known = math.prod(d for d in shape if d >= 0)
    if len(free) > 1:
        return None
    if not free:
        return list(shape) if known == count else None
    if known == 0 or count % known:
        return None
    out = list(shape)
    out[free[0]] = count // known
    return out


def check_dims(shape: Sequence[int], name: str) -> None:
    """A request tensor's shape, before anything is sized from it: no negative dimension, no more
    dimensions than an array can have, and no dimensions whose product (zeros left out: numpy
    counts them so even for an empty array) no array can have."""
    if len(shape) > MAX_DIMS:
        raise invalid_arg(f"input '{name}' has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    if shape and min(shape) < 0:
        raise invalid_arg(f"input '{name}' has a negative dimension in shape {list(shape)}")
    if math.prod(d for d in shape if d) > MAX_SPAN:
        raise invalid_arg(f"input '{name}' has shape {list(shape)}, larger than any tensor can be")


def to_bytes_element(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.generic):
        return to_bytes_element(value.item())
    return str(value).encode("utf-8")


def serialize_bytes(array: np.ndarray) -> bytes:
    """Length-prefixed layout of a BYTES tensor (row-major)."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        b = to_bytes_element(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int, name: str, model: str = "",
                      request_id: str = "") -> np.ndarray:
    """Parse exactly `count` length-prefixed elements that must fill `buffer` exactly. The
    count errors are tritonserver's (core ValidateBytesInputs), which clients and Triton's qa
    compare: "expected N string elements for inference input ..., got K" and "unexpected number
    of string elements K+1 ..., expecting N"."""
    view = memoryview(buffer)
    offset, size = 0, len(view)
    where = f"for inference input '{name}' for model '{model}'"
    items: list[bytes] = []
    while offset < size:
        if size - offset < 4:
            raise invalid_arg(
                f"{request_prefix(request_id)}incomplete string length indicator {where}, expecting 4 bytes but "
                f"only {size - offset} bytes available. Please make sure the string length indicator is in one buffer."
            )
        if len(items) == count:  # one more element than the shape holds: stop here (the buffer may be huge)
            raise invalid_arg(
                f"{request_prefix(request_id)}unexpected number of string elements {count + 1} {where}, "
                f"expecting {count}"
            )
        (length,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + length > size:
            raise invalid_arg(
                f"{request_prefix(request_id)}incomplete string data {where}, expecting string of length "
                f"{length} but only {size - offset} bytes available (element {len(items)} of {count})"
            )
        items.append(bytes(view[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise invalid_arg(
            f"{request_prefix(request_id)}expected {count} string elements {where}, got {len(items)}"
        )
    out = np.empty(count, dtype=np.object_)
    out[:] = items
    return out


def request_prefix(request_id: str) -> str:
    """Triton's prefix of request errors: "[request id: ID] "."""
    return f"[request id: {request_id or '<id_unknown>'}] "


class RawInputs:
    """Decodes a request's raw input buffers, holding back BYTES element-count errors until
    every input is read, so that one answer names each input whose buffer does not fit its
    shape (tritonserver reports one of them, in the order of its hash map)."""

    def __init__(self, model: str, request_id: str) -> None:
        self.model, self.request_id = model, request_id
        self._errors: list[str] = []

    def decode(self, buffer: bytes | memoryview, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
        try:
            return from_raw(buffer, datatype, shape, name, self.model, self.request_id)
        except PierError as exc:
            if datatype != "BYTES":
                raise
            self._errors.append(exc.message)
            return _NO_DATA

    def check(self) -> None:
        if self._errors:
            raise invalid_arg("; ".join(self._errors))


_NO_DATA = np.empty(0, dtype=np.object_)


def from_raw(buffer: bytes | memoryview, datatype: str, shape: Sequence[int], name: str,
             model: str = "", request_id: str = "") -> np.ndarray:
    """Decode a raw tensor buffer, checking its size against datatype and shape."""
    count = element_count(shape)
    if datatype == "BYTES":
        return deserialize_bytes(buffer, count, name, model, request_id).reshape(shape)
    dtype = numpy_dtype(datatype)
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise invalid_arg(
            f"{request_prefix(request_id)}input byte size mismatch for input '{name}' "
            f"for model '{model}'. Expected {expected}, got {len(buffer)}"
        )
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    """Encode a tensor in the raw layout."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    dtype = numpy_dtype(datatype)
    if array.dtype != dtype:
        array = array.astype(dtype)
    return np.ascontiguousarray(array).tobytes()
