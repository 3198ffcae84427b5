"""The protocol between the server (core_client.EngineCoreClient) and the engine-core process
(engine_core.py), as vLLM keeps EngineCoreRequest / EngineCoreOutputs: typed Messages
(pier.ipc.messages), each one ZeroMQ frame.

    server -> core   Init (once), then Add, Abort, ResetPrefixCache, UpdateLoRA and Stop  (Command)
    core -> server   Progress while it loads, Ready | LoadFailed (to Init), then per step Outputs (the
                     step's RequestOutputs and the engine's stats), Refused for a request the
                     engine would not take, the answers PrefixCacheReset and LoRAUpdated, Fatal
                     before it exits when it cannot step any more, Log for its log records  (Event)

The first field of a message about one request is its id, so one that does not decode fails that
request alone (pier.ipc.messages.BadMessage.ref). SamplingParams, RequestOutput, EngineStats and
EngineFacts are dataclasses that msgspec encodes as they are: no pickle. The same Add and Abort
are what EngineClient hands the engine in a thread (async_engine.AsyncLLMEngine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pier.contract.backend import LoadProgress
from pier.ipc.messages import Codec, Message

from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine import LLMEngine


@dataclass(frozen=True)
class EngineFacts:
    """What callers read of an engine without asking it: fixed once it has loaded."""

    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any]
    max_tokens_cap: int | None
    cache_config_info: dict[str, str]
    max_loras: int = 0  # 0: LoRA off
    lora_adapters: dict[str, str] | None = None  # the adapters served at the start: name -> folder

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        lora = engine.config.lora
        return cls(engine.max_model_len, engine.model_config.vocab_size, dict(engine.generation_defaults),
                   engine.config.model.max_tokens_cap, engine.cache_config_info(),
                   lora.max_loras if lora.enable_lora else 0, engine.lora_adapters())


class Init(Message):
    """Load the engine (LLMEngine.from_parameters(model_dir, parameters, **overrides))."""

    model_dir: str
    parameters: dict[str, str]
    overrides: dict[str, Any]
    log_level: int = 20  # the server's (logging.INFO): the core's records at or above it come back as Log


class Add(Message):
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


class Abort(Message):
    request_id: str


class Stop(Message):
    pass


class Progress(Message):
    """How far the load has come (weights shard by shard): the model's reason while it loads."""

    progress: LoadProgress


class ResetPrefixCache(Message):
    """Forget the cached prefixes; answered with PrefixCacheReset (same token)."""

    token: str


class UpdateLoRA(Message):
    """Load (`path` given) or unload (`path` None) a LoRA adapter; answered with LoRAUpdated (same token)."""

    token: str
    name: str
    path: str | None
    inplace: bool = False


class LoRAUpdated(Message):
    """vLLM's answer to /v1/load_lora_adapter or /v1/unload_lora_adapter: the HTTP status and its
    text, and the adapters served after it."""

    token: str
    status: int
    message: str
    adapters: dict[str, str]


class Ready(Message):
    facts: EngineFacts
    stats: EngineStats


class LoadFailed(Message):
    kind: str  # the exception's type name: ValueError and KeyError are the model's fault, the rest the engine's
    message: str


class Outputs(Message):
    outputs: list[RequestOutput]
    stats: EngineStats


class Refused(Message):
    request_id: str
    message: str


class Log(Message):
    """A log record of the core (what it compiled, loaded, derived), said again on the server's log
    under the same logger name and level."""

    level: int
    logger: str
    message: str


class Fatal(Message):
    """The engine cannot step any more and the core exits (a tensor-parallel rank died): why."""

    message: str


class PrefixCacheReset(Message):
    token: str
    ok: bool  # False: requests held blocks, nothing was reset


Command = Init | Add | Abort | Stop | ResetPrefixCache | UpdateLoRA
Event = Progress | Ready | LoadFailed | Outputs | Refused | PrefixCacheReset | LoRAUpdated | Fatal | Log

COMMANDS: Codec[Command] = Codec(Command, "server-to-engine-core")
EVENTS: Codec[Event] = Codec(Event, "engine-core-to-server")
