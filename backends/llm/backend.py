"""The LLM backend (`backend: "llm"`): a Hugging Face folder served by the paged-KV engine with
continuous batching. Decoupled, with the tensors Triton's vLLM backend uses, so clients written
for Triton + vLLM work unchanged:

  inputs   text_input (BYTES), stream (BOOL), sampling_parameters (BYTES, JSON of vLLM's
           sampling fields), exclude_input_in_output (BOOL), return_finish_reason,
           return_num_input_tokens, return_num_output_tokens (BOOL); Pier's extras for the
           OpenAI frontend: chat_messages (BYTES, JSON list of chat messages: the chat template
           is applied), input_ids (INT64, a prompt given as token ids), return_logprobs (BOOL)
  outputs  text_output (BYTES); finish_reason (BYTES), num_input_tokens / num_output_tokens
           (UINT32), sequence_index (UINT32), logprobs (BYTES, JSON) when asked for

With `stream` true each response carries the new text of one sequence; otherwise one response
per sequence carries its whole text (the prompt first, unless exclude_input_in_output). The
last response has the final flag. The engine runs its own step thread; `execute` only hands
requests over, so the instance is free at once and batching happens inside the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pier.contract.backend import Backend, ExecuteResult, InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import PierError, internal, invalid_arg, unavailable
from pier.contract.types import InferenceRequest, ModelSignature, Tensor

INPUTS = (
    ("text_input", "BYTES", (1,)),
    ("stream", "BOOL", (1,)),
    ("sampling_parameters", "BYTES", (1,)),
    ("exclude_input_in_output", "BOOL", (1,)),
    ("return_finish_reason", "BOOL", (1,)),
    ("return_num_input_tokens", "BOOL", (1,)),
    ("return_num_output_tokens", "BOOL", (1,)),
    ("return_logprobs", "BOOL", (1,)),
    ("chat_messages", "BYTES", (1,)),
    ("input_ids", "INT64", (-1,)),
)
OUTPUTS = (
    ("text_output", "BYTES", (-1,)),
    ("finish_reason", "BYTES", (-1,)),
    ("num_input_tokens", "UINT32", (-1,)),
    ("num_output_tokens", "UINT32", (-1,)),
    ("sequence_index", "UINT32", (-1,)),
    ("logprobs", "BYTES", (-1,)),
    ("stop_reason", "BYTES", (-1,)),
    ("prompt_logprobs", "BYTES", (-1,)),
)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


_N_BUCKETS = (1, 2, 5, 10, 20)


def _one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            self.counts[i] += 1
            self.total += value
            self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        with self.lock:
            rows, cumulative = [], 0
            for b, c in zip(self.buckets, self.counts):
                cumulative += c
                rows.append(f'{name}_bucket{{{labels},le="{b}"}} {cumulative}\n')
            rows.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}\n')
            rows.append(f"{name}_sum{{{labels}}} {self.total}\n")
            rows.append(f"{name}_count{{{labels}}} {self.n}\n")
            return rows


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


_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _plain_message(message: Any) -> dict[str, Any]:
    """A message as string-content chat templates expect it, as vLLM renders them: content given as
    a list of text parts is their texts joined by newlines, null content is empty, and the
    `developer` role (OpenAI's newer name) is `system`."""
    if not isinstance(message, dict):
        raise ValueError("each message must be an object")
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = [p["text"] for p in content
                 if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
        if len(texts) != len(content):
            raise ValueError("message content parts must be text parts ({'type': 'text', 'text': ...})")
        out["content"] = "\n".join(texts)
    if out.get("role") == "developer":
        out["role"] = "system"
    return out


_CONTEXT_TOKENS = 4  # tokens decoded before a logprob token, for its leading space and pending bytes


def alone_text(tokenizer: Any, token: int) -> str:
    return str(tokenizer.decode([token], skip_special_tokens=False)).replace("\ufffd", "")


def _render_chat(tokenizer: Any, doc: Any) -> str:
    """chat_messages: a list of messages, or {"messages", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "tools"} (the OpenAI frontend's template options).
    continue_final_message renders without a generation prompt and ends the text right after the
    last message's content, so the model continues it."""
    options: dict[str, Any] = doc if isinstance(doc, dict) else {"messages": doc}
    messages = options.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    add = bool(options.get("add_generation_prompt", True))
    cont = bool(options.get("continue_final_message", False))
    kwargs = options.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or _TEMPLATE_NAMES & kwargs.keys():
        raise ValueError(f"chat_template_kwargs must be an object without {sorted(_TEMPLATE_NAMES)}")
    if add and cont:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    tools = options.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    messages = [_plain_message(m) for m in messages]
    if tools:  # the template shows the model the tools (as HF's apply_chat_template(tools=...))
        kwargs = {**kwargs, "tools": tools}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, **kwargs)
    final = messages[-1].get("content")
    if cont and isinstance(final, str) and final and (at := text.rfind(final)) >= 0:
        text = text[: at + len(final)]
    return text


class LLMInstance(ModelInstance):
    may_run_on_event_loop = False
    unbatched = True

    def __init__(self, ctx: ModelContext, where: InstanceContext) -> None:
        from pier.backends.llm.async_engine import AsyncLLMEngine
        from pier.backends.llm.sampling_params import SamplingParams

        self._sampling_cls = SamplingParams
        params = dict(ctx.spec.parameters)
        folder = Path(params["model_path"]) if params.get("model_path") else ctx.version_dir
        overrides: dict[str, Any] = {}
        if where.kind == "KIND_GPU":
            overrides["device"] = f"cuda:{where.device_id or 0}"
        try:
            self.engine = AsyncLLMEngine.from_parameters(folder, params, **overrides)
        except (ValueError, OSError, KeyError) as exc:
            raise unavailable(f"cannot load the LLM in {folder}: {exc}") from None
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"llm-io-{where.name}", daemon=True)
        self._thread.start()
        self._ttft = _Histogram(_TTFT_BUCKETS)
        self._itl = _Histogram(_ITL_BUCKETS)
        self._e2e = _Histogram(_E2E_BUCKETS)
        tokens = _one_two_five(self.engine.max_model_len)
        # per finished sequence, as vLLM's request-level histograms (name -> (help, histogram))
        self._per_request = {
            "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                                _Histogram(_E2E_BUCKETS)),
            "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                                    _Histogram(_E2E_BUCKETS)),
            "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                                  _Histogram(_E2E_BUCKETS)),
            "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                                 _Histogram(_E2E_BUCKETS)),
            "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                           _Histogram(_ITL_BUCKETS)),
            "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", _Histogram(tokens)),
            "vllm:request_generation_tokens": ("Number of generation tokens processed.", _Histogram(tokens)),
            "vllm:request_params_max_tokens": ("Histogram of the max_tokens request parameter.", _Histogram(tokens)),
            "vllm:request_params_n": ("Histogram of the n request parameter.", _Histogram(_N_BUCKETS)),
        }
        self._requests_ok = 0
        self._requests_aborted = 0

    # ---- requests ------------------------------------------------------------------------

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        results: list[ExecuteResult] = []
        for request in requests:
            try:
                job = self._parse(request)
            except PierError as exc:
                results.append(exc)
                continue
            asyncio.run_coroutine_threadsafe(self._serve(request, *job), self._loop)
            results.append([])
        return results

    def _parse(self, request: InferenceRequest) -> tuple[Any, Any, dict[str, bool]]:
        if request.response_sink is None:
            raise invalid_arg("the LLM model is decoupled: use gRPC ModelStreamInfer, generate or generate_stream")
        flags = {name: bool(_scalar(request, name)) for name in (
            "stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
            "return_num_output_tokens", "return_logprobs")}
        raw = _scalar(request, "sampling_parameters")
        sampling_doc: dict[str, Any] = {}
        if raw not in (None, b"", ""):
            try:
                sampling_doc = json.loads(_text(raw, "sampling_parameters"))
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
        try:
            sampling = self._sampling_cls.from_json(sampling_doc)
        except (ValueError, TypeError) as exc:
            raise invalid_arg(f"invalid sampling_parameters: {exc}") from None
        messages = _scalar(request, "chat_messages")
        token_ids = next((t for t in request.inputs if t.name == "input_ids"), None)
        if token_ids is not None and token_ids.data.size:
            prompt: Any = [int(v) for v in token_ids.data.reshape(-1)]
            flags["exclude_input_in_output"] = True
        elif messages not in (None, b"", ""):
            try:
                text = _render_chat(self.tokenizer, json.loads(_text(messages, "chat_messages")))
                self.engine.check_text_length(text)
            except RecursionError:
                raise invalid_arg("chat_messages: the JSON is nested too deeply") from None
            except (ValueError, TypeError) as exc:
                raise invalid_arg(f"chat_messages: {exc}") from None
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
            flags["exclude_input_in_output"] = True
        else:
            value = _scalar(request, "text_input")
            if value is None:
                raise invalid_arg("input 'text_input' is required")
            prompt = _text(value, "text_input")
        return prompt, sampling, flags

    async def _serve(self, request: InferenceRequest, prompt: Any, sampling: Any, flags: dict[str, bool]) -> None:
        sink = request.response_sink
        assert sink is not None
        rid = f"{request.id or 'req'}-{next(self._ids)}"
        stream = flags["stream"]
        prefix = "" if stream or flags["exclude_input_in_output"] or not isinstance(prompt, str) else prompt
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[Any]] = {}
        logprob_ids: dict[int, list[int]] = {}  # the tokens `logprobs` (not yet sent) are for
        # what each sequence's logprob tokens are decoded after (so that a token reads as it does in
        # the text): the prompt's last tokens, then the sequence's own
        context: dict[int, list[int]] = {}
        pending_prompt_lp: dict[int, Any] = {}  # prompt logprobs not yet sent (their output carried no text)
        remaining = sampling.n
        started = time.monotonic()
        last_token_at: dict[int, float] = {}
        consumer = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch_cancel(request, consumer))
        try:
            gen = self.engine.generate(prompt, sampling, request_id=rid)
            async for out in gen:
                now = time.monotonic()
                if out.token_ids:
                    if out.index not in last_token_at:
                        self._ttft.observe(now - started)
                    else:
                        gap = (now - last_token_at[out.index]) / len(out.token_ids)
                        for _ in out.token_ids:
                            self._itl.observe(gap)
                    last_token_at[out.index] = now
                if out.finished:
                    remaining -= 1
                    if out.finish_reason != "abort":
                        self._observe_finished(out, sampling)
                final = remaining <= 0
                # prompt logprobs come with a sequence's first output: keep them for its first response
                if out.prompt_logprobs is not None:
                    pending_prompt_lp[out.index] = out.prompt_logprobs
                # streamed: a response per step that made tokens, its text empty while a character or
                # a possible stop string is pending (as Triton's vLLM backend and vLLM's SSE streams)
                emits = out.finished or (stream and bool(out.text or out.token_ids))
                if emits and out.index in pending_prompt_lp:
                    out = dataclasses.replace(out, prompt_logprobs=pending_prompt_lp.pop(out.index))
                if flags["return_logprobs"] and out.index not in context:
                    context[out.index] = list((out.prompt_ids or [])[-_CONTEXT_TOKENS:])
                if stream:
                    if emits:
                        sink(self._tensors(out.text, out, flags, out.logprobs, out.finished, out.token_ids,
                                           context.get(out.index)), final)
                    if flags["return_logprobs"]:
                        context[out.index] = (context[out.index] + out.token_ids)[-_CONTEXT_TOKENS:]
                else:
                    texts.setdefault(out.index, []).append(out.text)
                    if out.logprobs:
                        logprobs.setdefault(out.index, []).extend(out.logprobs)
                        logprob_ids.setdefault(out.index, []).extend(out.token_ids)
                    if out.finished:
                        whole = prefix + "".join(texts.pop(out.index, []))
                        sink(self._tensors(whole, out, flags, logprobs.pop(out.index, None), True,
                                           logprob_ids.pop(out.index, []), context.get(out.index)), final)
                if final:
                    self._e2e.observe(time.monotonic() - started)
                    if out.finish_reason == "abort":
                        self._requests_aborted += 1
                    else:
                        self._requests_ok += 1
                    return
        except asyncio.CancelledError:  # the client went away: closing the generator aborted it
            self._requests_aborted += 1
        except ValueError as exc:  # the engine refused the prompt (too long, bad ids)
            sink(invalid_arg(str(exc)), True)
        except Exception as exc:
            sink(internal(f"LLM engine error: {type(exc).__name__}: {exc}"), True)
        finally:
            watcher.cancel()

    def _observe_finished(self, out: Any, sampling: Any) -> None:
        """vLLM's request-level histograms, for a sequence that finished (not aborted); the request's
        parameters once, with its first sequence."""
        h = {name: hist for name, (_, hist) in self._per_request.items()}
        if out.index == 0:
            h["vllm:request_params_n"].observe(sampling.n)
            if sampling.max_tokens is not None:
                h["vllm:request_params_max_tokens"].observe(sampling.max_tokens)
        h["vllm:request_prompt_tokens"].observe(out.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(out.completion_tokens)
        m = out.metrics
        if m is None or m.first_scheduled_time is None:
            return
        end = m.finished_time or m.last_token_time or m.first_scheduled_time
        h["vllm:request_queue_time_seconds"].observe(m.first_scheduled_time - m.arrival_time)
        h["vllm:request_inference_time_seconds"].observe(end - m.first_scheduled_time)
        if m.first_token_time is not None:
            h["vllm:request_prefill_time_seconds"].observe(m.first_token_time - m.first_scheduled_time)
            last = m.last_token_time or m.first_token_time
            h["vllm:request_decode_time_seconds"].observe(last - m.first_token_time)
            if out.completion_tokens > 1:
                h["vllm:request_time_per_output_token_seconds"].observe(
                    (last - m.first_token_time) / (out.completion_tokens - 1))

    @staticmethod
    async def _watch_cancel(request: InferenceRequest, task: asyncio.Task | None) -> None:
        while task is not None and not task.done():
            if request.cancelled:
                task.cancel()
                return
            await asyncio.sleep(0.05)

    def _tensors(self, text: str, out: Any, flags: dict[str, bool], lps: Any, finished: bool,
                 lp_ids: Sequence[int] = (), context: Sequence[int] | None = None) -> list[Tensor]:
        tensors = [Tensor("text_output", "BYTES", [1], np.array([text.encode("utf-8")], dtype=object))]
        if flags["return_finish_reason"]:
            reason = (out.finish_reason or "") if finished else ""
            tensors.append(Tensor("finish_reason", "BYTES", [1], np.array([reason.encode()], dtype=object)))
            if finished:  # the stop string or stop token id that ended it, JSON (null for length/abort)
                stop = json.dumps(out.stop_reason if out.finish_reason == "stop" else None).encode()
                tensors.append(Tensor("stop_reason", "BYTES", [1], np.array([stop], dtype=object)))
        if flags["return_num_input_tokens"]:
            tensors.append(Tensor("num_input_tokens", "UINT32", [1], np.array([out.prompt_tokens], np.uint32)))
        if flags["return_num_output_tokens"]:
            tensors.append(Tensor("num_output_tokens", "UINT32", [1], np.array([out.completion_tokens], np.uint32)))
        tensors.append(Tensor("sequence_index", "UINT32", [1], np.array([out.index], np.uint32)))
        if out.prompt_logprobs is not None:  # sampling's prompt_logprobs: once, in the first response
            ids = [t for t, _, _ in out.prompt_logprobs]
            doc = self._logprobs_doc(ids, [(lp, top) for _, lp, top in out.prompt_logprobs], [])
            doc["text"] = self.tokenizer.decode(ids)  # the prompt, for echo
            tensors.append(Tensor("prompt_logprobs", "BYTES", [1], np.array([json.dumps(doc).encode()], dtype=object)))
        if flags["return_logprobs"]:
            payload = json.dumps(self._logprobs_doc(lp_ids if lps else [], lps or [], context or [])).encode()
            tensors.append(Tensor("logprobs", "BYTES", [1], np.array([payload], dtype=object)))
        return tensors

    def _logprobs_doc(self, ids: Sequence[int], entries: Sequence[tuple[float | None, Any]],
                      context: Sequence[int]) -> dict[str, Any]:
        """{"tokens": [text of each id], "ids": [...], "logprobs": [[logprob, [[alternative text,
        logprob, id], ...]] or None]}: the logprobs and prompt_logprobs outputs (None: a prompt's first token has no
        logprob). A token's text is what it adds to the text after `context` and the ids before it
        ('' for a byte that only starts a character, the whole character for the byte that ends it,
        as vLLM); alternatives are decoded alone, best first."""
        def ranked(top: dict[int, float] | None) -> list[list[Any]]:
            best = sorted((top or {}).items(), key=lambda kv: -kv[1])
            return [[alone_text(self.tokenizer, t), v, t] for t, v in best]

        return {"tokens": self._token_texts(ids, context), "ids": list(ids),
                "logprobs": [None if lp is None else [lp, ranked(top)] for lp, top in entries]}

    def _token_texts(self, ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """Each token's text in place: decode a short window ending at it and take what it adds to
        the window before it (whole characters only)."""
        def text(window: list[int]) -> str:
            return self.tokenizer.decode(window, skip_special_tokens=False).rstrip("\ufffd")

        window = list(context[-_CONTEXT_TOKENS:])
        before = text(window)
        out: list[str] = []
        for t in ids:
            window.append(t)
            after = text(window)
            out.append(after[len(before):] if after.startswith(before) else alone_text(self.tokenizer, t))
            before = after
            if len(window) > 2 * _CONTEXT_TOKENS and after == self.tokenizer.decode(
                    window, skip_special_tokens=False):  # no character pending: the window may slide
                window = window[-_CONTEXT_TOKENS:]
                before = text(window)
        return out

    # ---- metrics -------------------------------------------------------------------------

    def prometheus(self, model: str, version: str) -> str:
        s = self.engine.stats()
        labels = f'model_name="{model}"'
        parts: list[str] = []

        def family(name: str, kind: str, help_text: str, rows: list[str]) -> None:
            parts.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" + "".join(rows))

        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:num_requests_swapped", "Number of requests swapped to CPU.", s.num_swapped),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            family(name, "gauge", help_text, [f"{name}{{{labels}}} {value}\n"])
        for name, help_text, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens),
        ):
            family(name, "counter", help_text, [f"{name}_total{{{labels}}} {value}\n"])
        family("vllm:request_success", "counter", "Count of successfully processed requests.",
               [f'vllm:request_success_total{{{labels},finished_reason="finished"}} {self._requests_ok}\n',
                f'vllm:request_success_total{{{labels},finished_reason="abort"}} {self._requests_aborted}\n'])
        for name, help_text, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self._ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self._itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self._e2e),
        ):
            family(name, "histogram", help_text, hist.render(name, labels))
        for name, (help_text, hist) in self._per_request.items():
            family(name, "histogram", help_text, hist.render(name, labels))
        return "".join(parts)

    def info(self) -> dict[str, Any]:
        return {"max_model_len": self.engine.max_model_len}

    def close(self) -> None:
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class LLMBackend(Backend):
    name = "llm"
    default_model_filename = "config.json"

    def describe(self, model_path: Path) -> ModelSignature | None:
        """Triton's vLLM-backend tensors (auto-complete): only text_input is required."""
        return ModelSignature(INPUTS, OUTPUTS, optional_inputs=tuple(n for n, _, _ in INPUTS if n != "text_input"),
                              decoupled=True)

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        if not model.spec.decoupled:
            raise invalid_arg(f"LLM model '{model.spec.name}' must be decoupled "
                              "(model_transaction_policy { decoupled: true }; auto-complete sets it)")
        return LLMInstance(model, instance)


BACKEND = LLMBackend()
