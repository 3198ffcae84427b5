"""The protocol between the server and a Python model's stub process (backends/python/stub.py),
over the two channels of pier.ipc.channel (typed Messages: pier.ipc.messages).

exec (one exchange at a time; the server's worker thread waits for each answer):

    server -> stub   Init (once), Exec (a batch), Finalize
    stub -> server   Ready | InitError (to Init), Result (to Exec), Finalized

aux (whatever crosses while the model runs; the server's supervisor thread and the stub's
reader thread read it):

    stub -> server   Send (a response sender's response), IsCancelled, Log, Bls, Manage,
                     MetricsText (the answer to MetricsQuery)
    server -> stub   Cancelled, BlsReply | BlsItem... BlsEnd, Managed, MetricsQuery

The first field of every message about a request or a call is its id (`rid`: the request's
within its execute; `qid`: a call the stub waits for), so a message that does not decode fails
that request or call alone (pier.ipc.messages.BadMessage.ref).
"""

from __future__ import annotations

from typing import Any

from pier.contract.types import ModelSpec
from pier.ipc.channel import WireAnswer, WireError, WireRequest, WireResult
from pier.ipc.messages import Codec, Message

# ---- exec ---------------------------------------------------------------------------------------


class Init(Message):
    """What the stub needs to load the model: the ModelContext and InstanceContext, by value."""

    spec: ModelSpec
    version: int
    model_dir: str
    version_dir: str
    config_json: str
    instance: str
    kind: str
    device_id: int | None
    log_level: int


class Exec(Message):
    seq: int
    batch: list[WireRequest]


class Finalize(Message):
    pass


class Ready(Message):
    has_metrics: bool  # the model made custom metric families: scrapes ask it for them


class InitError(Message):
    error: WireError


class Result(Message):
    """An execute's results. `sends`: how many Send messages the stub had written on aux when it
    answered; the server hands the results on only once it has handled that many, so a response a
    model sent before its execute ended (raised, failed, released the request) reaches the client
    before the execute's outcome does, though the two cross on different channels."""

    seq: int
    results: list[WireResult | None]  # one per request of the batch
    has_metrics: bool
    sends: int


class Finalized(Message):
    pass


# ---- aux ----------------------------------------------------------------------------------------


class Send(Message):
    """A response through request `rid`'s response sender (None: none, only the final flag)."""

    rid: int
    result: WireResult | None
    final: bool


class IsCancelled(Message):
    qid: int
    rid: int


class Log(Message):
    logger: str
    level: int
    text: str


class Bls(Message):
    qid: int
    decoupled: bool
    request: WireRequest


class Manage(Message):
    """Model control from a model: op is load (arg: parameters), unload (parameters) or ready (version)."""

    qid: int
    op: str
    name: str
    arg: Any


class MetricsText(Message):
    qid: int
    text: str


class Cancelled(Message):
    qid: int
    cancelled: bool


class MetricsQuery(Message):
    qid: int


class BlsReply(Message):
    qid: int
    response: WireAnswer


class BlsItem(Message):
    qid: int
    response: WireAnswer


class BlsEnd(Message):
    qid: int


class Managed(Message):
    qid: int
    error: WireError | None
    value: Any


ToStub = Init | Exec | Finalize | Cancelled | MetricsQuery | BlsReply | BlsItem | BlsEnd | Managed
FromStub = Ready | InitError | Result | Finalized | Send | IsCancelled | Log | Bls | Manage | MetricsText
Answer = BlsReply | BlsItem | BlsEnd | Cancelled | Managed  # what a call of the stub's hears back

TO_STUB: Codec[ToStub] = Codec(ToStub, "server-to-stub")
FROM_STUB: Codec[FromStub] = Codec(FromStub, "stub-to-server")
