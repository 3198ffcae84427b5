"""Engines as asyncio callers see them: `generate()` streams a request's outputs, `abort()` cancels.

`EngineClient` is what the LLM backend talks to; it owns the streams and hands commands (add,
abort) to an `LLMEngine` that runs elsewhere. Two ways to run it:

- `AsyncLLMEngine` (here): the step loop on a thread of this process. Commands go through a
  thread-safe queue; each step's outputs go back with one `call_soon_threadsafe` per event loop.
- `EngineCoreClient` (core_client.py): the engine in its own process (engine_core.py), commands
  and per-step outputs over ZeroMQ, so that the engine's Python work does not share this
  process's interpreter lock with HTTP/gRPC handling.

Closing or cancelling the iterator `generate()` returns aborts the request (its blocks are freed
before the next step), which is how a client disconnect or a timeout cancels work.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pier.contract.backend import LoadProgress

from .core_messages import Abort, Add, EngineFacts, LoRAUpdated, ResetPrefixCache, UpdateLoRA
from .engine import EngineStats, LLMEngine, RequestOutput
from .input_processor import check_text_length, encode_prompt
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine cannot run requests: its process died (the message says how), or it stopped."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    remaining: int  # sequences (n) not yet finished


class EngineClient(abc.ABC):
    """Streams on asyncio event loops in front of an engine that steps elsewhere (thread or
    process). Subclasses deliver commands (`_send`) and feed back outputs (`_dispatch`) and
    failures (`_fail`, `_fail_all`)."""

    def __init__(self, tokenizer: Tokenizer, facts: EngineFacts, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.facts = facts
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and the stats snapshot
        self._stats = stats
        self._stopped = False
        self._ids = itertools.count()
        self._replies: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self.lora_adapters: dict[str, str] = dict(facts.lora_adapters or {})  # name -> folder, as served now

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    def cache_config_info(self) -> dict[str, str]:
        return dict(self.facts.cache_config_info)

    def check_text_length(self, text: str) -> None:
        """See engine.check_text_length (fixed settings only: safe from any thread)."""
        check_text_length(text, self.facts.max_model_len)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.facts.max_model_len, self.facts.vocab_size)

    def unavailable_reason(self) -> str | None:
        """Why no request can run now (None: it can). Raised by generate as EngineDeadError."""
        return "the engine is stopped" if self._stopped else None

    async def generate(
        self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas; with n > 1 interleaved, told apart by `index`).

        Raises ValueError (bad prompt, duplicate id) before the first output, EngineDeadError
        when the engine cannot run it. The iterator ends after the last sequence's finished
        output. Closing it early (or cancelling the consuming task) aborts the request.
        """
        if (why := self.unavailable_reason()) is not None:
            raise EngineDeadError(why)
        sampling = sampling or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.encode_prompt(prompt)  # validates here, on the caller's side
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sampling.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        finished = False
        try:
            if (why := self.unavailable_reason()) is not None:  # it died while this one registered
                raise EngineDeadError(why)
            self._send(Add(request_id, ids, sampling))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has forgotten it: nothing to abort
                    raise item
                if item.finished:
                    stream.remaining -= 1
                    if stream.remaining <= 0:
                        finished = True
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and self.unavailable_reason() is None:
                try:
                    self._send(Abort(request_id))
                except EngineDeadError:  # it died meanwhile: nothing left to abort
                    pass

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its iterator receives finished outputs with finish_reason "abort"."""
        self._send(Abort(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget the engine's cached prefixes (vLLM's /reset_prefix_cache): False while requests
        hold KV blocks (nothing is reset then)."""
        return bool(await self._ask(lambda token: ResetPrefixCache(token)))

    async def update_lora(self, name: str, path: str | None, inplace: bool = False) -> tuple[int, str]:
        """Load (`path` given) or unload a LoRA adapter (vLLM's /v1/load_lora_adapter,
        /v1/unload_lora_adapter): (HTTP status, vLLM's text)."""
        answer: LoRAUpdated = await self._ask(lambda token: UpdateLoRA(token, name, path, inplace))
        self.lora_adapters = dict(answer.adapters)
        return answer.status, answer.message

    async def _ask(self, command: Callable[[str], ResetPrefixCache | UpdateLoRA]) -> Any:
        """Send a command that the engine answers (by its token) and wait for the answer."""
        if (why := self.unavailable_reason()) is not None:
            raise EngineDeadError(why)
        token = f"ask-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._replies[token] = (loop, answer)
        try:
            self._send(command(token))
            return await asyncio.wait_for(answer, 30)
        finally:
            with self._lock:
                self._replies.pop(token, None)

    def _answer(self, token: str, ok: Any) -> None:
        with self._lock:
            waiting = self._replies.get(token)
        if waiting is not None:
            loop, answer = waiting

            def settle() -> None:
                if not answer.done():
                    answer.set_result(ok)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # that loop is closed
                pass

    def stats(self) -> EngineStats:
        """The latest snapshot (taken after each step)."""
        with self._lock:
            return self._stats

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine; requests still running get an EngineDeadError."""

    @abc.abstractmethod
    def _send(self, command: Add | Abort | ResetPrefixCache | UpdateLoRA) -> None:
        """Deliver a command (core_messages: the engine-core protocol's) to the engine."""

    # -- fed by the engine side (any thread) ------------------------------------------------------

    def _set_stats(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats

    def _dispatch(self, outs: Sequence[RequestOutput]) -> None:
        if not outs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed
                pass

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass

    def _fail_all(self, error: BaseException) -> list[str]:
        """Fail every request in flight with `error`; returns their ids."""
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._fail(rid, error)
        return rids


class AsyncLLMEngine(EngineClient):
    """The engine's step loop on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.tokenizer, EngineFacts.of(engine), engine.stats())
        self.engine = engine
        self._commands: queue.SimpleQueue[Add | Abort | ResetPrefixCache | UpdateLoRA] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str],
                        progress: Callable[[LoadProgress], None] | None = None, **overrides: object
                        ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_parameters(model_dir, parameters, progress, **overrides))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- engine thread ----------------------------------------------------------------------------

    def _send(self, command: Add | Abort | ResetPrefixCache | UpdateLoRA) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain_commands(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return outs
            if isinstance(cmd, Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.sampling)
                except ValueError as e:
                    self._fail(cmd.request_id, e)
            elif isinstance(cmd, ResetPrefixCache):
                self._answer(cmd.token, self.engine.reset_prefix_cache())
            elif isinstance(cmd, UpdateLoRA):
                status, text = self.engine.update_lora(cmd.name, cmd.path, cmd.inplace)
                self._answer(cmd.token, LoRAUpdated(cmd.token, status, text, self.engine.lora_adapters()))
            else:
                outs.extend(self.engine.abort(cmd.request_id))

    def _loop(self) -> None:
        while not self._stopped:
            try:
                outs = self._drain_commands()
                if not self.engine.has_unfinished():
                    self._set_stats(self.engine.stats())
                    self._dispatch(outs)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outs.extend(self.engine.step())
                self._set_stats(self.engine.stats())
                self._dispatch(outs)
            except Exception as e:  # a step failed: fail everything in flight, keep serving
                for rid in self._fail_all(RuntimeError(f"LLM engine step failed: {e!r}")):
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001 - keep failing the rest
                        pass
        self._fail_all(EngineDeadError("the engine was shut down"))


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
