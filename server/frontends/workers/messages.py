"""The protocol between the server and a frontend process, over the channel in channel.py (typed
Messages: pier.ipc.messages). The first field of a message about a request is its id (`rid`,
the frontend's), so one that does not decode fails that request alone.

    frontend -> server   Admit rid model key          (the rate limits, before the body is read)
                         Infer rid protocol received_ns request
                         Refund model key             (admitted, then relayed: the server admits it)
                         Cancel rid                   (its client went away)
                         Ready                        (both ports bound)
                         Failed message               (it could not start)
    server -> frontend   Start settings paths         (first: the server's Settings and socket paths)
                         Admitted rid refused         (None: go on; else (seconds to wait, the limit's scope))
                         Reply rid response|error
                         Exiting                      (the server drains: close the listeners, Connection: close)
                         Stop                         (close the ports and exit)
                         LogSettings settings         (the logging extension changed them)
"""

from __future__ import annotations

from typing import Any

from pier.ipc.channel import WireAnswer, WireRequest
from pier.ipc.messages import Codec, Message
from pier.settings import Settings


class Admit(Message):
    rid: int
    model: str
    key: str | None


class Infer(Message):
    rid: int
    protocol: str
    received_ns: int
    request: WireRequest


class Refund(Message):
    model: str
    key: str | None


class Cancel(Message):
    rid: int


class Ready(Message):
    pass


class Failed(Message):
    message: str


class Start(Message):
    settings: Settings
    paths: dict[str, str]


class Admitted(Message):
    rid: int
    refused: tuple[float, str] | None


class Reply(Message):
    rid: int
    response: WireAnswer


class Exiting(Message):
    pass


class Stop(Message):
    pass


class LogSettings(Message):
    settings: dict[str, Any]


FromFrontend = Admit | Infer | Refund | Cancel | Ready | Failed
ToFrontend = Start | Admitted | Reply | Exiting | Stop | LogSettings

FROM_FRONTEND: Codec[FromFrontend] = Codec(FromFrontend, "frontend-to-server")
TO_FRONTEND: Codec[ToFrontend] = Codec(ToFrontend, "server-to-frontend")
