"""AsyncLLMEngine: the step loop on its own thread, results streamed to asyncio callers.

The engine thread owns the LLMEngine. Callers on the event loop send commands (add, abort) through
a thread-safe queue; each step's outputs go back with one `call_soon_threadsafe` per event loop.
Closing or cancelling the iterator `generate()` returns aborts the request (its blocks are freed
before the next step), which is how a client disconnect or a timeout cancels work.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .engine import EngineStats, LLMEngine, RequestOutput
from .sampling_params import SamplingParams


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    remaining: int  # sequences (n) not yet finished


class AsyncLLMEngine:
    """Thread-driven wrapper around LLMEngine with an async streaming API."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and stats snapshots
        self._stats = engine.stats()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_parameters(cls, model_dir: str | Path, parameters: Mapping[str, str], **overrides: object
                        ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_parameters(model_dir, parameters, **overrides))

    @property
    def tokenizer(self):  # noqa: ANN201 - tokenizer.Tokenizer
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def cache_config_info(self) -> dict[str, str]:
        """vllm:cache_config_info's labels (fixed settings: safe from any thread), so that
        inference gateways read the KV capacity (num_gpu_blocks x block_size) as from vLLM."""
        e, cfg = self.engine, self.engine.config
        return {"block_size": str(cfg.block_size), "cache_dtype": cfg.dtype,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(cfg.kv_cache_memory_bytes),
                "kv_cache_size_tokens": str(e.kv.pool.num_blocks * cfg.block_size),
                "num_cpu_blocks": str(e.kv.cpu_pool.num_blocks), "num_gpu_blocks": str(e.kv.pool.num_blocks)}

    def check_text_length(self, text: str) -> None:
        """See LLMEngine.check_text_length (safe from any thread: reads fixed settings only)."""
        self.engine.check_text_length(text)

    async def generate(
        self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (deltas; with n > 1 interleaved, told apart by `index`).

        Raises ValueError (bad prompt, duplicate id) before the first output. The iterator ends after
        the last sequence's finished output. Closing it early (or cancelling the consuming task)
        aborts the request.
        """
        if self._stopped:
            raise RuntimeError("the engine is stopped")
        sampling = sampling or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.engine.encode_prompt(prompt)  # validates here, on the caller's side
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sampling.n)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._send(("add", request_id, ids, sampling))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
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
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its iterator receives finished outputs with finish_reason "abort"."""
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The latest snapshot (taken after each step)."""
        with self._lock:
            return self._stats

    def shutdown(self) -> None:
        """Stop the engine thread; requests still running get a RuntimeError."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- engine thread ----------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain_commands(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return outs
            if cmd[0] == "add":
                _, rid, ids, sampling = cmd
                try:
                    self.engine.add_request(rid, ids, sampling)
                except ValueError as e:
                    self._fail(rid, e)
            else:
                outs.extend(self.engine.abort(cmd[1]))

    def _loop(self) -> None:
        while not self._stopped:
            try:
                outs = self._drain_commands()
                if not self.engine.has_unfinished():
                    self._snapshot()
                    self._dispatch(outs)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outs.extend(self.engine.step())
                self._snapshot()
                self._dispatch(outs)
            except Exception as e:  # a step failed: fail everything in flight, keep serving
                with self._lock:
                    rids = list(self._streams)
                for rid in rids:
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001 - keep failing the rest
                        pass
                    self._fail(rid, RuntimeError(f"LLM engine step failed: {e!r}"))
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._fail(rid, RuntimeError("the engine was shut down"))

    def _snapshot(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats

    def _dispatch(self, outs: list[RequestOutput]) -> None:
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


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
