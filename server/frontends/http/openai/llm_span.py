"""The OpenAI API's span in OpenTelemetry trace mode: one SERVER span per completions or chat call,
named `llm_request` as vLLM's (`{operation} {model}` with OTEL_SEMCONV_STABILITY_OPT_IN=
gen_ai_latest_experimental, as vLLM does then), the caller's traceparent its parent, sampled by the
model's trace settings. Each prompt's request is a child trace under it (its model span, as
Triton's). Its attributes are the GenAI semantic conventions' current names (opentelemetry-
semantic-conventions) and, beside them, the names vLLM's llm_request span has carried, for
dashboards built on vLLM; the timings are the call's as its client saw them (time to first token,
end to end) and the engine's phases (queue, prefill, decode, inference: pier.contract.llm.TIMINGS;
with several sequences, those of the slowest)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from pier.contract import llm
from pier.contract.types import InferenceRequest
from pier.dataplane.plane import DataPlane
from pier.frontends.http.openai.llm_io import Delta
from pier.observability.otel import OtelTrace

SPAN = "llm_request"
# vLLM's names of the sampling settings it records (gen_ai.request.<name>), then the current
# conventions' further ones.
_SAMPLING = ("temperature", "top_p", "max_tokens", "top_k", "frequency_penalty", "presence_penalty", "seed")


def start(plane: DataPlane, request: web.Request, model: str, request_id: str, received_ns: int,
          operation: str, infers: list[InferenceRequest]) -> OtelTrace | None:
    """The call's span when it is traced; each request is marked as its child (or, when the call is
    not sampled, as not traced: the call decides, not each of its prompts)."""
    tracer = plane.tracer
    if not tracer.propagates:  # Triton's mode: each request is sampled as any other
        return None
    latest = "gen_ai_latest_experimental" in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    trace = tracer.begin_call(f"{operation} {model}" if latest else SPAN, model, request_id,
                              request.headers.get("traceparent", ""), received_ns)
    for infer in infers:
        infer.trace = trace.child(model, infer.id) if trace is not None else False
        if trace is not None:
            infer.parameters[llm.TIMINGS] = True
    return trace


class Watch:
    """What a call's deltas said, as they pass: tokens, finish reasons, first and last token times,
    the engine's phases."""

    def __init__(self) -> None:
        self.completion: dict[int, int] = {}
        self.finish: dict[int, str] = {}
        self.first_token_ns: int | None = None
        self.last_token_ns: int | None = None
        self.phases: dict[str, float] = {}

    async def watch(self, deltas: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
        try:
            async for item in deltas:
                i = item["index"]
                if item["completion_tokens"] > self.completion.get(i, 0):
                    now = time.perf_counter_ns()
                    self.first_token_ns = self.first_token_ns or now
                    self.last_token_ns = now
                self.completion[i] = item["completion_tokens"]
                if item["finish_reason"]:
                    self.finish[i] = item["finish_reason"]
                if item.get("timings"):
                    for name, value in json.loads(item["timings"]).items():
                        self.phases[name] = max(value, self.phases.get(name, 0.0))
                yield item
        finally:
            await deltas.aclose()


def finish(trace: OtelTrace, doc: dict[str, Any], model: str, sampling: dict[str, Any], operation: str,
           request_id: str, received_ns: int, answer_id: str = "", prompt_tokens: int = 0, choices: int = 0,
           watched: Watch | None = None, error: str = "") -> None:
    """Set the call's attributes and end its span (`error`: the error.type of a call that failed)."""
    a: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": str(doc.get("model", model)),
                         "gen_ai.response.model": model, "gen_ai.request.id": request_id,
                         "gen_ai.request.stream": bool(doc.get("stream"))}
    for name in _SAMPLING:
        value = sampling.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            a[f"gen_ai.request.{name}"] = value
    n = sampling.get(llm.SAMPLING_N, 1)
    a["gen_ai.request.n"] = n  # vLLM's
    if n != 1:
        a["gen_ai.request.choice.count"] = n
    stop = sampling.get("stop")
    if stop:
        a["gen_ai.request.stop_sequences"] = [stop] if isinstance(stop, str) else [str(s) for s in stop]
    if error:
        a["error.type"] = error
    if watched is not None:
        output = sum(watched.completion.values())
        a.update({"gen_ai.response.id": answer_id, "gen_ai.usage.input_tokens": prompt_tokens,
                  "gen_ai.usage.output_tokens": output,
                  "gen_ai.usage.prompt_tokens": prompt_tokens, "gen_ai.usage.completion_tokens": output,  # vLLM's
                  "gen_ai.usage.num_sequences": choices,
                  "gen_ai.response.finish_reasons": [watched.finish[i] for i in sorted(watched.finish)]})
        now = time.perf_counter_ns()
        a["gen_ai.latency.e2e"] = (now - received_ns) / 1e9
        if watched.first_token_ns is not None:
            a["gen_ai.latency.time_to_first_token"] = ttft = (watched.first_token_ns - received_ns) / 1e9
            if doc.get("stream"):
                a["gen_ai.response.time_to_first_chunk"] = ttft
        a.update({f"gen_ai.latency.{name}": value for name, value in watched.phases.items()})
    trace.set_attributes(a)
    trace.end()
