"""Typed messages between Pier's processes: each protocol is one tagged union of msgspec Structs,
as vLLM keeps `EngineCoreRequest` / `EngineCoreOutputs`.

A protocol's messages subclass `Message`: a Struct that travels as a msgpack array whose first
item is its tag (the class name) and the rest its fields in order (`array_like`: no field names
on the wire). By convention a message that concerns one request, call or query carries that
id as its first field. The unions live beside the two ends that speak them:
`backends/python/messages.py` (server <-> Python stub), `backends/llm/core_messages.py`
(server <-> LLM engine core), `server/frontends/workers/messages.py` (server <-> frontend
process); the tensors, requests and responses the stub and frontend protocols carry are
`pier.ipc.channel`'s Wire* structs.

`Codec(union)` decodes one protocol's messages. What it cannot read fails loudly and alone: a
tag no member has, or fields that do not match, raise `BadMessage`, which names the protocol,
the kind and the problem, and carries the id the message concerns (`ref`, read from the raw
array), so that a receiver fails that request only and keeps reading; nothing is dropped in
silence. Commands carry no pickles: dataclasses (ModelSpec, Settings, SamplingParams) travel as
msgspec encodes them, numpy arrays and paths through the hooks below.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np


class Message(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """One message of a protocol (subclass it; the class name is the tag). A field too many fails
    as one too few does."""


M = TypeVar("M")


class BadMessage(ValueError):
    """A message that does not decode as its protocol's: an unknown kind, or fields that do not
    match. `kind` is its tag when it has a readable one; `ref` its first field (the request,
    call or query id it concerns) when that is an int or a str."""

    def __init__(self, protocol: str, kind: str | None, ref: int | str | None, problem: str) -> None:
        self.protocol, self.kind, self.ref, self.problem = protocol, kind, ref, problem
        what = f"message {kind!r}" if kind is not None else "message"
        super().__init__(f"unreadable {protocol} {what}: {problem}")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):  # numpy scalars inside BYTES tensors and parameters
        return obj.item()
    if isinstance(obj, bytes):  # subclasses (np.bytes_)
        return bytes(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.ndarray):  # a dataclass field (a sequence state's initial value)
        if obj.dtype == np.object_:
            return ["O", list(obj.shape), obj.reshape(-1).tolist()]
        return [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]
    raise TypeError(f"cannot send a {type(obj).__name__} to another process")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is Path:
        return Path(obj)
    if kind is np.ndarray:
        dtype, shape, data = obj
        if dtype == "O":
            flat = np.empty(len(data), dtype=np.object_)
            flat[:] = data
            return flat.reshape(shape)
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode a {kind}")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Any) -> bytes:
    """A message's msgpack bytes (raises TypeError or msgspec.EncodeError for what it cannot carry)."""
    return ENCODER.encode(message)


def tags(union: Any) -> frozenset[str]:
    members = typing.get_args(union) or (union,)
    return frozenset(str(m.__struct_config__.tag) for m in members)


class Codec(Generic[M]):
    """Decodes one protocol's messages (`union`: its Message subclasses, `A | B | ...`)."""

    def __init__(self, union: Any, protocol: str) -> None:
        self.protocol = protocol
        self.tags = tags(union)
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(union, dec_hook=_dec_hook)

    def decode(self, data: bytes | memoryview) -> M:
        """The message; raises BadMessage for one that is not this protocol's."""
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise self.bad(data, exc) from None

    def bad(self, data: bytes | memoryview, exc: Exception) -> BadMessage:
        """What `data` (which failed to decode with `exc`) is, as far as a plain msgpack read tells."""
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            return BadMessage(self.protocol, None, None, f"not msgpack ({exc})")
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            return BadMessage(self.protocol, None, None, f"not a tagged message ({exc})")
        kind = raw[0]
        ref = raw[1] if len(raw) > 1 and isinstance(raw[1], (int, str)) and not isinstance(raw[1], bool) else None
        if kind not in self.tags:
            return BadMessage(self.protocol, kind, ref, f"unknown kind (known: {', '.join(sorted(self.tags))})")
        return BadMessage(self.protocol, kind, ref, str(exc))
