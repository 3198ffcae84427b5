"""The LLM backend (`backend: "llm"`): a Hugging Face folder served by the paged-KV engine with
continuous batching. Decoupled, with the tensors Triton's vLLM backend uses, so clients written
for Triton + vLLM work unchanged, plus Pier's extras for the OpenAI frontend: the LLM tensor
protocol, named and described in pier.contract.llm (inputs text_input, stream,
sampling_parameters, ...; outputs text_output, finish_reason, ..., logprobs).

With `stream` true each response carries the new text of one sequence; otherwise one response
per sequence carries its whole text (the prompt first, unless exclude_input_in_output). The
last response has the final flag. The engine runs its own step thread; `execute` only hands
requests over, so the instance is free at once and batching happens inside the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pier.backends.llm import degrade
from pier.backends.llm.adapter_model import BASES, AdapterInstance
from pier.backends.llm.chat import render_chat
from pier.backends.llm.config import INTERNAL_PREFIX
from pier.backends.llm.logprob_docs import CONTEXT_TOKENS, logprobs_doc, token_texts
from pier.backends.llm.metrics import LLMMetrics, phase_times
from pier.contract import llm
from pier.contract.backend import Backend, InstanceContext, LoadProgress, ModelContext, ModelInstance, Overload
from pier.contract.errors import PierError, internal, invalid_arg, unavailable
from pier.contract.llm import INPUTS, OUTPUTS
from pier.contract.types import ExecuteResult, InferenceRequest, ModelSignature, Outputs, Tensor

log = logging.getLogger("pier.llm")


def _scalar(request: InferenceRequest, name: str) -> Any:
    for t in request.inputs:
        if t.name == name:
            flat = t.data.reshape(-1)
            if flat.size != 1:
                raise invalid_arg(f"input '{name}' must hold one element, got {flat.size}")
            value = flat[0]
            return value.item() if isinstance(value, np.generic) else value
    return None


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_arg(f"input '{name}' is not valid UTF-8") from None
    return str(value)


def _timings(out: Any) -> dict[str, str]:
    """A finished sequence's phases, as the TIMINGS response parameter (pier.contract.llm)."""
    phases = phase_times(out.metrics)
    return {llm.TIMINGS: json.dumps(phases)} if phases is not None else {}


def _bytes(name: str, value: bytes) -> Tensor:
    return Tensor(name, "BYTES", [1], np.array([value], dtype=object))


def _uint32(name: str, value: int) -> Tensor:
    return Tensor(name, "UINT32", [1], np.array([value], np.uint32))


class LLMInstance(ModelInstance):
    # execute() only parses and hands requests over (a task on the server's loop streams the
    # answers): short enough to run on the loop itself, which then starts the task with no thread
    # hop there and back; a long parse (a large chat template) still goes to a worker thread.
    may_run_on_event_loop = True
    unbatched = True

    def __init__(self, ctx: ModelContext, where: InstanceContext) -> None:
        from pier.backends.llm.async_engine import AsyncLLMEngine, EngineClient, EngineDeadError
        from pier.backends.llm.config import EngineConfig
        from pier.backends.llm.core_client import EngineCoreClient
        from pier.backends.llm.lora import resolve_lora_modules
        from pier.backends.llm.sampling_params import SamplingParams

        self._sampling_cls = SamplingParams
        self.name = ctx.spec.name
        params = dict(ctx.spec.parameters)
        folder = Path(params["model_path"]) if params.get("model_path") else ctx.version_dir
        overrides: dict[str, Any] = {}
        if where.kind == "KIND_GPU":
            overrides["device"] = f"cuda:{where.device_id or 0}"
        if ctx.services is None:
            raise unavailable("the LLM backend runs inside the server (it streams from the server's event loop)")
        self.tool_call_parser = params.get(llm.INFO_TOOL_CALL_PARSER) or None
        if self.tool_call_parser is not None and self.tool_call_parser not in llm.TOOL_CALL_PARSERS:
            raise unavailable(f"tool_call_parser {self.tool_call_parser!r} is not one of "
                              f"{', '.join(llm.TOOL_CALL_PARSERS)}")
        self._dead_error = EngineDeadError
        # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter since the engine started, in the order
        # of their last change (name: path, None for an unload), applied again to a restarted core
        self._runtime_lora: dict[str, str | None] = {}
        self._health_reports = 0
        try:
            params = resolve_lora_modules(params, ctx.version_dir)
            self.watermark = degrade.Watermark(params, ctx.spec.name)
            in_process = EngineConfig.from_parameters(params, **overrides).parallel.engine_core == "thread"
            self.engine: EngineClient
            def on_progress(progress: LoadProgress) -> None:
                ctx.report_progress(where.name, progress)

            if in_process:
                self.engine = AsyncLLMEngine.from_parameters(folder, params, on_progress, **overrides)
            else:
                def report(reason: str | None) -> None:
                    ctx.report_health(where.name, reason)
                    BASES.health(self.name, self, reason)  # the adapter models running on this engine

                def on_health(reason: str | None) -> None:
                    """From the engine's supervisor thread. A restarted core serves its startup set of
                    LoRA adapters: the runtime loads and unloads are applied again before it is READY."""
                    self._health_reports += 1
                    if reason is None and self._runtime_lora:
                        seq = self._health_reports
                        asyncio.run_coroutine_threadsafe(self._restore_lora(), self._loop).add_done_callback(
                            lambda _: report(None) if seq == self._health_reports else None)
                        return
                    report(reason)

                self.engine = EngineCoreClient.from_parameters(folder, params, on_health, on_progress, **overrides)
        except (ValueError, OSError, KeyError, RuntimeError) as exc:
            raise unavailable(f"cannot load the LLM in {folder}: {exc}") from None
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # Responses are built on the server's loop: the engine thread hands each step's outputs
        # straight to it, and from there they reach the frontend (one thread hop per step).
        self._loop = ctx.services.event_loop
        self._tasks: set[asyncio.Task[None]] = set()  # the streams running (a task needs a reference)
        self.metrics = LLMMetrics(self.engine.max_model_len)
        self.degrades = self.watermark.threshold is not None
        BASES.register(self.name, self)

    def overload(self, request: InferenceRequest) -> Overload | None:
        """Past the KV watermark (degrade.py): Retry-After is the mean time a request took here."""
        e2e = self.metrics.e2e
        return self.watermark.check(self.engine.stats().kv_cache_usage, request, e2e.total / e2e.n if e2e.n else 1)

    # ---- requests ------------------------------------------------------------------------

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        return self.run(requests)

    def run(self, requests: Sequence[InferenceRequest], lora: str | None = None) -> list[ExecuteResult]:
        """Execute `requests`, with LoRA adapter `lora` (an adapter model's, adapter_model.py) whatever
        they ask."""
        results: list[ExecuteResult] = []
        for request in requests:
            try:
                job = self._parse(request, lora)
                answer = self._tokenizer_answer(request, *job)
            except PierError as exc:
                results.append(exc)
                continue
            if answer is not None:  # tokenize / detokenize: answered at once, nothing generated
                sink = request.response_sink
                assert sink is not None  # _parse checked it
                sink(Outputs(answer), True)
            else:
                self._start(request, self._serve(request, *job))
            results.append(Outputs([]))
        return results

    def _start(self, request: InferenceRequest, serve: Coroutine[Any, Any, None]) -> None:
        """Run `serve` on the server's loop (started here when execute runs on it), cancelled through
        the request's on_cancel when its client goes away."""
        handle: asyncio.Task[None] | concurrent.futures.Future[None]
        if asyncio._get_running_loop() is self._loop:
            handle = self._loop.create_task(serve)
            self._tasks.add(handle)
            handle.add_done_callback(self._tasks.discard)
        else:
            handle = asyncio.run_coroutine_threadsafe(serve, self._loop)
        request.on_cancel = handle.cancel
        if request.cancelled:  # the stream closed before on_cancel was set
            handle.cancel()

    def _parse(self, request: InferenceRequest, lora: str | None = None) -> tuple[Any, Any, dict[str, bool]]:
        if request.response_sink is None:
            raise invalid_arg("the LLM model is decoupled: use gRPC ModelStreamInfer, generate or generate_stream")
        flags = {name: bool(_scalar(request, name)) for name in llm.FLAG_INPUTS}
        raw = _scalar(request, llm.SAMPLING_PARAMETERS)
        sampling_doc: dict[str, Any] = {}
        if raw not in (None, b"", ""):
            try:
                sampling_doc = json.loads(_text(raw, llm.SAMPLING_PARAMETERS))
            except RecursionError:
                raise invalid_arg("sampling_parameters: the JSON is nested too deeply") from None
            except ValueError as exc:
                raise invalid_arg(f"sampling_parameters is not valid JSON: {exc}") from None
            if not isinstance(sampling_doc, dict):
                raise invalid_arg("sampling_parameters must be a JSON object")
        # Triton's vLLM backend also takes sampling fields as request parameters (generate's
        # "parameters": {"temperature": 0, ...}); the sampling_parameters input wins.
        known = {f.name for f in dataclasses.fields(self._sampling_cls)} - {"extra"}
        sampling_doc = {**{k: v for k, v in request.parameters.items() if k in known}, **sampling_doc}
        facts = self.engine.facts
        defaults = facts.generation_defaults  # generation_config.json's, for what the request leaves out (vLLM)
        sampling_doc = {**defaults, **{k: v for k, v in sampling_doc.items() if v is not None or k not in defaults}}
        if lora is not None:
            sampling_doc[llm.SAMPLING_LORA_NAME] = lora
        if flags[llm.EMBED]:  # one forward pass over the prompt, nothing generated
            sampling_doc = {**sampling_doc, "embed": True, "max_tokens": 1}
        try:
            sampling = self._sampling_cls.from_json(sampling_doc)
        except (ValueError, TypeError) as exc:
            raise invalid_arg(f"invalid sampling_parameters: {exc}") from None
        cap = facts.max_tokens_cap
        if cap is not None and not sampling.embed:
            if sampling.max_tokens is None:
                sampling = dataclasses.replace(sampling, max_tokens=cap)
            elif sampling.max_tokens > cap:
                raise invalid_arg(f"max_tokens={sampling.max_tokens} is more than this model allows "
                                  f"(max_tokens_cap={cap})")
        messages = _scalar(request, llm.CHAT_MESSAGES)
        token_ids = next((t for t in request.inputs if t.name == llm.INPUT_IDS), None)
        if token_ids is not None and token_ids.data.size:
            prompt: Any = [int(v) for v in token_ids.data.reshape(-1)]
            flags[llm.EXCLUDE_INPUT_IN_OUTPUT] = True
        elif messages not in (None, b"", ""):
            try:
                text = render_chat(self.tokenizer, json.loads(_text(messages, llm.CHAT_MESSAGES)))
                self.engine.check_text_length(text)
            except RecursionError:
                raise invalid_arg("chat_messages: the JSON is nested too deeply") from None
            except (ValueError, TypeError) as exc:
                raise invalid_arg(f"chat_messages: {exc}") from None
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
            flags[llm.EXCLUDE_INPUT_IN_OUTPUT] = True
        else:
            value = _scalar(request, llm.TEXT_INPUT)
            if value is None:
                raise invalid_arg(f"input '{llm.TEXT_INPUT}' is required")
            prompt = _text(value, llm.TEXT_INPUT)
        return prompt, sampling, flags

    def _tokenizer_answer(self, request: InferenceRequest, prompt: Any, sampling: Any,
                          flags: dict[str, bool]) -> list[Tensor] | None:
        """TOKENIZE: the prompt's ids (text with special tokens, as the engine would see it; chat
        as rendered) and their count. DETOKENIZE: input_ids as text. None: generate."""
        if flags[llm.TOKENIZE]:
            ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
            return [Tensor(llm.PROMPT_IDS, "INT64", [len(ids)], np.array(ids, dtype=np.int64)),
                    Tensor(llm.NUM_INPUT_TOKENS, "UINT32", [1], np.array([len(ids)], dtype=np.uint32))]
        if flags[llm.DETOKENIZE]:
            if prompt == "":  # no ids: no text
                return [_bytes(llm.TEXT_OUTPUT, b"")]
            if not isinstance(prompt, list):
                raise invalid_arg(f"detokenize needs the token ids in '{llm.INPUT_IDS}'")
            vocab = self.tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < max(vocab, self.engine.facts.vocab_size)]
            if bad:
                raise invalid_arg(f"token ids outside the vocabulary (size {vocab}): {bad[:10]}")
            return [_bytes(llm.TEXT_OUTPUT, self.tokenizer.decode(prompt, skip_special_tokens=False).encode())]
        return None

    async def _serve(self, request: InferenceRequest, prompt: Any, sampling: Any, flags: dict[str, bool]) -> None:
        sink = request.response_sink
        assert sink is not None
        rid = f"{request.id or 'req'}-{next(self._ids)}"
        stream = flags[llm.STREAM]
        prefix = "" if stream or flags[llm.EXCLUDE_INPUT_IN_OUTPUT] or not isinstance(prompt, str) else prompt
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[Any]] = {}
        logprob_ids: dict[int, list[int]] = {}  # the tokens `logprobs` (not yet sent) are for
        # what each sequence's logprob tokens are decoded after (so that a token reads as it does in
        # the text): the prompt's last tokens, then the sequence's own
        context: dict[int, list[int]] = {}
        pending_prompt_lp: dict[int, Any] = {}  # prompt logprobs not yet sent (their output carried no text)
        remaining = sampling.n
        timed = request.parameters.get(llm.TIMINGS) is True  # a traced OpenAI call's (pier.contract.llm)
        started = time.monotonic()
        last_token_at: dict[int, float] = {}
        try:
            gen = self.engine.generate(prompt, sampling, request_id=rid)
            async for out in gen:
                if out.embedding is not None:  # an EMBED request's one answer
                    sink(Outputs([Tensor(llm.EMBEDDING, "FP32", [len(out.embedding)],
                                         np.array(out.embedding, dtype=np.float32)),
                                  Tensor(llm.NUM_INPUT_TOKENS, "UINT32", [1],
                                         np.array([out.prompt_tokens], dtype=np.uint32))]), True)
                    self.metrics.requests_ok += 1
                    return
                now = time.monotonic()
                if out.token_ids:
                    if out.index not in last_token_at:
                        self.metrics.ttft.observe(now - started)
                    else:
                        gap = (now - last_token_at[out.index]) / len(out.token_ids)
                        for _ in out.token_ids:
                            self.metrics.itl.observe(gap)
                    last_token_at[out.index] = now
                if out.finished:
                    remaining -= 1
                    if out.finish_reason != llm.FINISH_ABORT:
                        self.metrics.observe_finished(out, sampling)
                final = remaining <= 0
                # prompt logprobs come with a sequence's first output: keep them for its first response
                if out.prompt_logprobs is not None:
                    pending_prompt_lp[out.index] = out.prompt_logprobs
                # streamed: a response per step that made tokens, its text empty while a character or
                # a possible stop string is pending (as Triton's vLLM backend and vLLM's SSE streams)
                emits = out.finished or (stream and bool(out.text or out.token_ids))
                if emits and out.index in pending_prompt_lp:
                    out = dataclasses.replace(out, prompt_logprobs=pending_prompt_lp.pop(out.index))
                if flags[llm.RETURN_LOGPROBS] and out.index not in context:
                    context[out.index] = list((out.prompt_ids or [])[-CONTEXT_TOKENS:])
                params = _timings(out) if timed and out.finished else {}
                if stream:
                    if emits:
                        sink(Outputs(self._tensors(out.text, out, flags, out.logprobs, out.finished, out.token_ids,
                                                   context.get(out.index)), params), final)
                    if flags[llm.RETURN_LOGPROBS]:
                        context[out.index] = (context[out.index] + out.token_ids)[-CONTEXT_TOKENS:]
                else:
                    texts.setdefault(out.index, []).append(out.text)
                    if out.logprobs:
                        logprobs.setdefault(out.index, []).extend(out.logprobs)
                        logprob_ids.setdefault(out.index, []).extend(out.token_ids)
                    if out.finished:
                        whole = prefix + "".join(texts.pop(out.index, []))
                        sink(Outputs(self._tensors(whole, out, flags, logprobs.pop(out.index, None), True,
                                                   logprob_ids.pop(out.index, []), context.get(out.index)), params),
                             final)
                if final:
                    self.metrics.e2e.observe(time.monotonic() - started)
                    if out.finish_reason == llm.FINISH_ABORT:
                        self.metrics.requests_aborted += 1
                    else:
                        self.metrics.requests_ok += 1
                    return
        except asyncio.CancelledError:  # the client went away: closing the generator aborted it
            self.metrics.requests_aborted += 1
        except ValueError as exc:  # the engine refused the prompt (too long, bad ids)
            sink(invalid_arg(str(exc)), True)
        except self._dead_error as exc:  # its process died (or it stopped): the message says how
            sink(unavailable(str(exc)), True)
        except Exception as exc:
            sink(internal(f"LLM engine error: {type(exc).__name__}: {exc}"), True)

    def _tensors(self, text: str, out: Any, flags: dict[str, bool], lps: Any, finished: bool,
                 lp_ids: Sequence[int] = (), context: Sequence[int] | None = None) -> list[Tensor]:
        tensors = [_bytes(llm.TEXT_OUTPUT, text.encode("utf-8"))]
        if flags[llm.RETURN_FINISH_REASON]:
            reason = (out.finish_reason or "") if finished else ""
            tensors.append(_bytes(llm.FINISH_REASON, reason.encode()))
            if finished:  # the stop string or stop token id that ended it, JSON (null for length/abort)
                tensors.append(_bytes(llm.STOP_REASON, json.dumps(
                    out.stop_reason if out.finish_reason == llm.FINISH_STOP else None).encode()))
        if flags[llm.RETURN_NUM_INPUT_TOKENS]:
            tensors.append(_uint32(llm.NUM_INPUT_TOKENS, out.prompt_tokens))
        if flags[llm.RETURN_NUM_OUTPUT_TOKENS]:
            tensors.append(_uint32(llm.NUM_OUTPUT_TOKENS, out.completion_tokens))
        tensors.append(_uint32(llm.SEQUENCE_INDEX, out.index))
        if out.prompt_logprobs is not None:  # sampling's prompt_logprobs: once, in the first response
            ids = [t for t, _, _ in out.prompt_logprobs]
            doc = logprobs_doc(self.tokenizer, ids, [(lp, top) for _, lp, top in out.prompt_logprobs], [])
            doc[llm.PROMPT_TEXT] = self.tokenizer.decode(ids)  # the prompt, for echo
            tensors.append(_bytes(llm.PROMPT_LOGPROBS, json.dumps(doc).encode()))
        if flags[llm.RETURN_LOGPROBS]:
            payload = json.dumps(logprobs_doc(self.tokenizer, lp_ids if lps else [], lps or [], context or [])).encode()
            tensors.append(_bytes(llm.LOGPROBS, payload))
        return tensors

    def _token_texts(self, ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """See logprob_docs.token_texts, with this model's tokenizer."""
        return token_texts(self.tokenizer, ids, context)

    # ---- metrics -------------------------------------------------------------------------

    def prometheus(self, model: str, version: str) -> str:
        facts = self.engine.facts
        return self.metrics.render(self.engine.stats(), model, facts.cache_config_info, facts.max_loras) + \
            self.watermark.render(model)

    def info(self) -> dict[str, Any]:
        lora = {llm.INFO_LORA_ADAPTERS: {n: p for n, p in self.engine.lora_adapters.items()
                                         if not n.startswith(INTERNAL_PREFIX)}} if self.engine.facts.max_loras else {}
        return {llm.INFO_MAX_MODEL_LEN: self.engine.max_model_len, llm.INFO_TOOL_CALL_PARSER: self.tool_call_parser,
                **lora}

    async def update_lora(self, name: str, path: str | None, inplace: bool) -> tuple[int, str]:
        if not self.engine.facts.max_loras:
            return 400, "LoRA feature is not enabled."
        status, text = await self.engine.update_lora(name, path, inplace)
        if status == 200 and not name.startswith(INTERNAL_PREFIX):  # adapter models add theirs again themselves
            self._runtime_lora.pop(name, None)
            self._runtime_lora[name] = path
        return status, text

    async def _restore_lora(self) -> None:
        """Apply the runtime adapter loads and unloads to a restarted engine core."""
        for name, path in list(self._runtime_lora.items()):
            try:
                status, text = await self.engine.update_lora(name, path, True)
            except Exception as exc:  # noqa: BLE001 - the engine died again: its next restart retries
                status, text = 503, str(exc)
            if status != 200 and not (path is None and status == 404):  # an unload of a runtime-only adapter
                log.error("model '%s': LoRA adapter '%s' could not be %s again after the engine restarted: %s",
                          self.name, name, "unloaded" if path is None else "loaded", text)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    def load_report(self) -> dict[str, float]:
        stats = self.engine.stats()  # the last step's (the engine core sends them with its outputs)
        return {"kv_cache_usage_perc": stats.kv_cache_usage, "num_requests_waiting": float(stats.num_waiting)}

    def close(self) -> None:
        BASES.unregister(self.name, self)
        self.engine.shutdown()  # requests still streaming fail with the engine's error


class LLMBackend(Backend):
    name = llm.BACKEND_NAME
    default_model_filename = "config.json"

    def describe(self, model_path: Path) -> ModelSignature | None:
        """Triton's vLLM-backend tensors (auto-complete): only text_input is required."""
        return ModelSignature(INPUTS, OUTPUTS, optional_inputs=tuple(n for n, _, _ in INPUTS if n != llm.TEXT_INPUT),
                              decoupled=True)

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        if llm.BASE_MODEL_PARAMETER in model.spec.parameters:  # an adapter of another LLM model
            return AdapterInstance(model, instance)
        if not model.spec.decoupled:
            raise invalid_arg(f"LLM model '{model.spec.name}' must be decoupled "
                              "(model_transaction_policy { decoupled: true }; auto-complete sets it)")
        return LLMInstance(model, instance)

    def configure(self, settings: dict[str, str]) -> tuple[str, ...]:
        """--backend-config=llm,kv_cache_degrade_threshold=F: the default of every LLM model."""
        return degrade.configure(settings)


BACKEND = LLMBackend()
