"""pier.ipc.messages: a protocol's typed messages round-trip (dataclasses with numpy arrays and
paths included, no pickle), and what does not decode as the protocol's fails loudly, naming the
kind, the problem and the id of what it concerns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from pier.ipc.messages import BadMessage, Codec, Message, encode


@dataclass(frozen=True)
class _Spec:
    name: str
    folder: Path
    initial: np.ndarray
    labels: tuple[str, ...] = ()


class Ask(Message):
    rid: int
    text: str


class Load(Message):
    spec: _Spec
    options: dict[str, Any]


class Bye(Message):
    pass


Proto = Ask | Load | Bye
CODEC: Codec[Proto] = Codec(Proto, "test")


def test_messages_round_trip_with_their_kind_first() -> None:
    assert msgspec.msgpack.decode(encode(Ask(7, "hi"))) == ["Ask", 7, "hi"]
    assert CODEC.decode(encode(Ask(7, "hi"))) == Ask(7, "hi") and CODEC.decode(encode(Bye())) == Bye()
    words = np.array([b"a", "b"], dtype=object)
    for initial in (np.arange(6, dtype=np.float16).reshape(2, 3), words):
        got = CODEC.decode(encode(Load(_Spec("m", Path("/models/m"), initial, ("x",)), {"k": [1, "2"]})))
        assert isinstance(got, Load) and got.spec.folder == Path("/models/m") and got.spec.labels == ("x",)
        assert got.spec.initial.dtype == initial.dtype and got.spec.initial.tolist() == initial.tolist()
        assert got.options == {"k": [1, "2"]}


def test_an_unknown_kind_fails_loudly_with_what_it_concerns() -> None:
    with pytest.raises(BadMessage) as info:
        CODEC.decode(msgspec.msgpack.encode(["Aks", 12, "typo"]))
    exc = info.value
    assert (exc.kind, exc.ref, exc.protocol) == ("Aks", 12, "test")
    assert str(exc) == "unreadable test message 'Aks': unknown kind (known: Ask, Bye, Load)"


def test_a_malformed_message_names_the_field_and_its_request() -> None:
    with pytest.raises(BadMessage) as info:
        CODEC.decode(msgspec.msgpack.encode(["Ask", 5, 6]))
    assert (info.value.kind, info.value.ref) == ("Ask", 5)
    assert "Expected `str`, got `int` - at `$[2]`" in str(info.value)
    for short_or_long in (["Ask", 5], ["Ask", 5, "x", "y"]):
        with pytest.raises(BadMessage, match=r"message 'Ask': Expected `array` of at (least|most) length"):
            CODEC.decode(msgspec.msgpack.encode(short_or_long))
    for raw, text in ((b"\xc1", "not msgpack"), (msgspec.msgpack.encode({"Ask": 1}), "not a tagged message"),
                      (msgspec.msgpack.encode([True, 1]), "not a tagged message")):
        with pytest.raises(BadMessage, match=text) as info:
            CODEC.decode(raw)
        assert info.value.kind is None and info.value.ref is None


def test_a_message_that_cannot_travel_fails_its_sender() -> None:
    with pytest.raises(TypeError, match="cannot send a object to another process"):
        encode(Ask(1, object()))  # type: ignore[arg-type]
