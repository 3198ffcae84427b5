"""The handlers: one call of completions or chat, checked, sent to the model as one request per
prompt, and answered whole or streamed; and the models list and vLLM's server probes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

import pier.frontends.http.openai.embeddings as embeddings
import pier.frontends.http.openai.llm_span as llm_span
import pier.frontends.http.openai.tokenize as tokenization
import pier.frontends.http.openai.tools as tools
from pier import __version__
from pier.contract import llm
from pier.contract.errors import PierError
from pier.dataplane.plane import DataPlane
from pier.frontends.http.middleware import MODEL_KEY, request_id
from pier.frontends.http.openai.chat import CHAT
from pier.frontends.http.openai.choices import Deltas, close, merge, whole
from pier.frontends.http.openai.completions import COMPLETIONS
from pier.frontends.http.openai.endpoint import Call, Endpoint
from pier.frontends.http.openai.llm_io import Delta, inference_request, one_response, response_deltas
from pier.frontends.http.openai.protocol import (
    BadRequest,
    check_fields,
    check_model,
    error,
    pier_error,
    read_body,
    sampling_parameters,
    structured_outputs,
)
from pier.frontends.http.openai.streaming import stream
from pier.observability.otel import OtelTrace


async def _first_deltas(gens: list[Deltas]) -> list[Delta]:
    """Every prompt's first answer before anything is sent: a bad request is a plain 4xx."""
    firsts = await asyncio.gather(*(anext(g, None) for g in gens), return_exceptions=True)
    out: list[Delta] = []
    for f in firsts:
        if isinstance(f, BaseException):
            raise f
        if f is None:
            raise BadRequest("the model sent no response", status=500)
        out.append(f)
    return out


class OpenAIHandlers:
    def __init__(self, plane: DataPlane, max_json_size: int) -> None:
        self.plane = plane
        self.max_json_size = max_json_size

    @staticmethod
    def _check_context(info: dict[str, Any], max_tokens: Any, firsts: list[Delta]) -> None:
        """As vLLM's OpenAI server: a prompt plus max_tokens past the model's context is a 400
        (the engine would stop early with "length"). The prompt's token count is known once the
        backend answered; the request is cancelled with the error."""
        limit = info.get(llm.INFO_MAX_MODEL_LEN)
        if not isinstance(max_tokens, int) or not isinstance(limit, int):
            return
        for f in firsts:
            asked = f["prompt_tokens"] + max_tokens
            if asked > limit:
                raise BadRequest(
                    f"This model's maximum context length is {limit} tokens. However, you requested {asked} "
                    f"tokens ({f['prompt_tokens']} in the messages, {max_tokens} in the completion). Please reduce "
                    "the length of the messages or completion.")

    async def _run(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        received = time.perf_counter_ns()
        gens: list[Deltas] = []
        trace: OtelTrace | None = None
        operation = "chat" if endpoint.chat else "text_completion"  # gen_ai.operation.name
        doc: dict[str, Any] = {}
        sampling: dict[str, Any] = {}
        try:
            doc = await read_body(request, self.max_json_size)
            llms = self.plane.models_with_backend(llm.BACKEND_NAME)  # read once for the whole call
            adapters = lora_adapters(llms)
            name = doc.get("model")
            asked = check_model(name, [*llms, *adapters] if name is not None else list(llms), self.plane.not_serving)
            # MODEL_KEY: gateway_headers reports this model's load (an adapter's: its base's)
            model = request[MODEL_KEY] = adapters[asked][0] if asked in adapters else asked
            info = llms.get(model, {})
            check_fields(doc, endpoint.chat)
            sampling, logprobs = sampling_parameters(doc, endpoint.chat)
            if asked in adapters:  # the base model runs the adapter
                sampling[llm.SAMPLING_LORA_NAME] = asked
            constraint = structured_outputs(doc)
            tool_plan = None
            if endpoint.chat:  # forced tool calls are structured output too
                tool_plan, forced = tools.plan(doc, info.get(llm.INFO_TOOL_CALL_PARSER))
                constraint = forced or constraint
            if constraint is not None:
                sampling[llm.SAMPLING_STRUCTURED_OUTPUTS] = constraint
            plan = endpoint.plan(doc, sampling, logprobs)
            plan.tools = tool_plan
            rid = request_id(request)
            infers = [inference_request(model, p, plan.messages, sampling, logprobs is not None, rid)
                      for p in plan.prompts]
            trace = llm_span.start(self.plane, request, model, rid, received, operation, infers)
            as_ids = bool(doc.get("return_tokens_as_token_ids"))  # vLLM's: tokens as "token_id:N"
            gens = [response_deltas(self.plane, infer, logprobs is not None, as_ids) for infer in infers]
            firsts = await _first_deltas(gens)
            self._check_context(info, sampling.get(llm.SAMPLING_MAX_TOKENS), firsts)
        except (BadRequest, PierError) as exc:
            await close(gens)
            if trace is not None:
                llm_span.finish(trace, doc, model, sampling, operation, rid, received, error=type(exc).__name__)
            return error(exc.status, exc.message, exc.param) if isinstance(exc, BadRequest) else pier_error(exc)
        n = int(sampling.get(llm.SAMPLING_N, 1))
        watched = llm_span.Watch() if trace is not None else None
        deltas = merge(list(zip(firsts, gens)), n)
        if watched is not None:
            deltas = watched.watch(deltas)
        first = await anext(deltas)
        # the model that answered: an overloaded model's fallback (dataplane/degrade.py), else the one asked
        answered = asked if firsts[0]["model"] in ("", model) else firsts[0]["model"]
        call = Call(endpoint, endpoint.id_prefix + infers[0].id, int(time.time()), answered,
                    prompt_tokens=sum(f["prompt_tokens"] for f in firsts), choices=n * len(gens), per_prompt=n,
                    role=plan.role, echo=[plan.echo[k // n] for k in range(n * len(plan.echo))], tools=plan.tools,
                    asked=asked if answered != asked else "")
        try:
            if doc.get("stream"):
                options = doc.get("stream_options") or {}
                usage = bool(isinstance(options, dict) and options.get("include_usage"))
                return await stream(request, call, deltas, first, usage,
                                    usage and bool(options.get("continuous_usage_stats")))
            return await whole(call, deltas, first)
        finally:
            if trace is not None:
                llm_span.finish(trace, doc, answered, sampling, operation, rid, received, call.ident,
                                call.prompt_tokens, call.choices, watched)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        llms = self.plane.models_with_backend(llm.BACKEND_NAME)
        served = {**{m: None for m in self.plane.models_with_parameter(embeddings.PARAMETER)},
                  **{m: info.get(llm.INFO_MAX_MODEL_LEN) for m, info in llms.items()
                     if llm.INFO_LORA_PARENT not in info}}
        data = [{"id": m, "object": "model", "created": created, "owned_by": "pier", "root": m, "parent": None,
                 llm.INFO_MAX_MODEL_LEN: limit} for m, limit in sorted(served.items())]
        # LoRA adapters as vLLM 0.32 lists them: root = the adapter's folder, parent = the base, max_model_len null
        # (adapter models too: root = the folder of the version unversioned requests reach first)
        adapters = {**lora_adapters(llms), **{m: (info[llm.INFO_LORA_PARENT], info[llm.INFO_LORA_ROOT])
                                              for m, info in llms.items() if llm.INFO_LORA_PARENT in info}}
        data += [{"id": a, "object": "model", "created": created, "owned_by": "pier", "root": path, "parent": base,
                  llm.INFO_MAX_MODEL_LEN: None} for a, (base, path) in sorted(adapters.items())]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}: 200 with a
        plain-text success line, or vLLM's error (400, 404) in OpenAI's shape."""
        try:
            doc = await read_body(request, self.max_json_size)
            name, path = doc.get("lora_name"), doc.get("lora_path")
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.")
            status, text = await self.plane.update_lora(self._lora_base(doc), name, path, bool(doc.get("load_inplace")))
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        return web.Response(status=200, text=text) if status == 200 else error(status, text)

    def _lora_base(self, doc: dict[str, Any]) -> str:
        """The LLM model whose adapters a load or unload changes: the one with LoRA on (Pier's `model`
        field names it when several have)."""
        serving = [m for m, info in self.plane.models_with_backend(llm.BACKEND_NAME).items()
                   if info.get(llm.INFO_LORA_ADAPTERS) is not None]
        model = doc.get("model")
        if model is not None and model not in serving:
            raise BadRequest(f"The model `{model}` does not exist or serves no LoRA adapters.", "model", 404)
        if model is None and len(serving) != 1:
            raise BadRequest("LoRA feature is not enabled." if not serving else
                             f"Several models serve LoRA adapters ({', '.join(serving)}): name one in 'model'.")
        return model or serving[0]

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}."""
        try:
            doc = await read_body(request, self.max_json_size)
            name = doc.get("lora_name")
            if not isinstance(name, str) or not name:
                raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
            status, text = await self.plane.update_lora(self._lora_base(doc), name, None, False)
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        return web.Response(status=200, text=text) if status == 200 else error(status, text)

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's /v1/embeddings, for LLMs and for models declared with openai_embeddings."""
        try:
            doc = await read_body(request, self.max_json_size)
            llms = self.plane.models_with_backend(llm.BACKEND_NAME)
            declared = self.plane.models_with_parameter(embeddings.PARAMETER)
            model = check_model(doc.get("model"), sorted({*llms, *declared}))
            body = await embeddings.embed(self.plane, model, doc, None if model in llms else declared[model])
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except PierError as exc:
            return pier_error(exc)
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the model's token ids for a prompt or a chat."""
        try:
            doc = await read_body(request, self.max_json_size)
            models = self.plane.models_with_backend(llm.BACKEND_NAME)
            model = check_model(doc.get("model"), list(models))
            got = await one_response(self.plane, tokenization.tokenize_request(model, doc))
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except PierError as exc:
            return pier_error(exc)
        ids = [int(t) for t in got[llm.PROMPT_IDS].reshape(-1)]
        body = {"count": len(ids), "max_model_len": models[model].get(llm.INFO_MAX_MODEL_LEN), "tokens": ids,
                "token_strs": None}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids back to text."""
        try:
            doc = await read_body(request, self.max_json_size)
            model = check_model(doc.get("model"), list(self.plane.models_with_backend(llm.BACKEND_NAME)))
            got = await one_response(self.plane, tokenization.detokenize_request(model, doc))
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except PierError as exc:
            return pier_error(exc)
        text = got[llm.TEXT_OUTPUT].reshape(-1)[0]
        return web.Response(body=orjson.dumps({"prompt": text.decode("utf-8", "replace")}),
                            content_type="application/json")

    # vLLM's server probes, for health checks written against it
    async def health(self, request: web.Request) -> web.Response:
        try:
            ready = self.plane.ready()
        except PierError:  # exiting
            ready = False
        return web.Response(status=200 if ready else 503)

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"version": __version__}), content_type="application/json")


def lora_adapters(llms: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """The LoRA adapters the LLM models serve (their info()): name -> (base model, folder). A model's
    own name wins over an adapter's."""
    return {a: (m, path) for m, info in llms.items() for a, path in (info.get(llm.INFO_LORA_ADAPTERS) or {}).items()
            if a not in llms}
