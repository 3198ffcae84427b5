"""OpenAI-compatible API on the HTTP port, for models served by the LLM backend:
`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (chat template applied),
`stream: true` as server-sent events ending with `data: [DONE]`, usage counts, OpenAI's and
vLLM's sampling fields, errors in OpenAI's shape. Each call is an ordinary request to the
model through the data plane (the LLM backend's tensors, streamed), so it is scheduled,
counted and cancelled (client gone) like any other."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from pier import __version__
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from pier.data_plane import DataPlane
from pier.frontends.http import codec
from pier.frontends.json_data import json_type

# Body fields passed to the engine's sampling parameters (OpenAI's and vLLM's names).
_SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
             "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens",
             "include_stop_str_in_output", "logit_bias")
_STATUS_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 500: "InternalServerError",
                 501: "NotImplementedError", 503: "ServiceUnavailableError"}
_CODE_STATUS = {ErrorCode.INVALID_ARG: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.UNSUPPORTED: 400,
                ErrorCode.TOO_LARGE: 413, ErrorCode.UNAVAILABLE: 503}


def error(status: int, message: str, param: str | None = None) -> web.Response:
    doc = {"error": {"message": message, "type": _STATUS_TYPES.get(status, "BadRequestError"), "param": param,
                     "code": status}}
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _bytes_tensor(name: str, text: str) -> Tensor:
    return Tensor(name, "BYTES", [1], np.array([text.encode("utf-8")], dtype=object))


# Boolean request fields read here (`logprobs` is one in chat; completions' integer logprobs is
# checked with the other sampling fields).
_FLAGS = ("stream", "echo", "add_generation_prompt", "continue_final_message", "return_tokens_as_token_ids")
_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def _lax_bool(doc: dict[str, Any], key: str) -> None:
    """Make `doc[key]` (when set) a bool, reading it as vLLM's pydantic models do (lax mode): 0/1
    and yes/no-style strings count, anything else is a 400."""
    value = doc.get(key)
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int) and value in (0, 1):
        doc[key] = bool(value)
    elif isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        doc[key] = value.strip().lower() in _TRUE
    else:
        raise _BadRequest(f"{key} must be a boolean, got {value!r}.", key)


MAX_PROMPTS = 1024  # prompts in one completions request
_INTS = ("max_tokens", "max_completion_tokens", "n", "top_logprobs", "seed", "top_k", "min_tokens")


def _lax_int(doc: dict[str, Any], key: str) -> None:
    """Read `doc[key]` (when set) as vLLM's pydantic models read an int in lax mode: a bool, a
    whole float or a string of digits counts; anything else is left for the field's own check."""
    value = doc.get(key)
    if isinstance(value, bool):
        doc[key] = int(value)
    elif isinstance(value, float) and value.is_integer():
        doc[key] = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit() and value.strip().isascii():
        doc[key] = int(value.strip())


def _bool_tensor(name: str, value: bool) -> Tensor:
    return Tensor(name, "BOOL", [1], np.array([value]))


def _first(response: InferenceResponse, name: str) -> Any:
    for t in response.outputs:
        if t.name == name:
            value = t.data.reshape(-1)[0]
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value.item()
    return None


class OpenAIHandlers:
    def __init__(self, plane: DataPlane, max_json_size: int) -> None:
        self.plane = plane
        self.max_json_size = max_json_size

    # ---- helpers -------------------------------------------------------------------------

    def _llm_models(self) -> list[str]:
        return list(self.plane.models_with_backend("llm"))

    def _check_model(self, name: Any) -> str:
        models = self._llm_models()
        if name is None and len(models) == 1:  # as vLLM: the model is optional when one is served
            return models[0]
        if name is None and models:
            raise _BadRequest(f"'model' is required: this server serves {', '.join(models)}.", "model")
        if name is not None and not isinstance(name, str):  # a malformed request, not an unknown model
            raise _BadRequest(f"model must be a string, got {json_type(name)}.", "model")
        if name not in models:
            raise _BadRequest(f"The model `{name}` does not exist. Models served here: {', '.join(models) or 'none'}.",
                              "model", 404)
        return name

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await codec.read_body(request, self.max_json_size, json_only=True)
            doc = codec.parse_json(raw)
        except PierError as exc:
            raise _BadRequest(exc.message, None, 413 if exc.code is ErrorCode.TOO_LARGE else 400) from None
        if not isinstance(doc, dict):
            raise _BadRequest("the request body must be a JSON object")
        for key in _FLAGS:
            _lax_bool(doc, key)
        return doc

    @staticmethod
    def _sampling(doc: dict[str, Any], chat: bool) -> tuple[dict[str, Any], int | None]:
        for key in _INTS if chat else (*_INTS, "logprobs"):  # chat's logprobs is a boolean
            _lax_int(doc, key)
        out = {k: doc[k] for k in _SAMPLING if doc.get(k) is not None}
        max_tokens = doc.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = doc.get("max_tokens")
        if max_tokens is None and not chat:  # absent or null: the completions API's default, as vLLM
            max_tokens = 16
        if isinstance(max_tokens, float) and max_tokens.is_integer():
            max_tokens = int(max_tokens)  # 3.0, as pydantic's lax int
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise _BadRequest(f"max_tokens must be an integer, got {max_tokens!r}.", "max_tokens")
            if max_tokens < 1:
                raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        out["max_tokens"] = max_tokens
        temperature = doc.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 2:
            raise _BadRequest(f"temperature must be between 0 and 2, got {temperature}.", "temperature")
        if doc.get("stream_options") is not None:
            if not doc.get("stream"):
                raise _BadRequest("stream_options can only be set when stream is true.", "stream_options")
            if not isinstance(doc["stream_options"], dict):
                raise _BadRequest("stream_options must be an object.", "stream_options")
        n = doc.get("n")
        if n is None:  # absent or null (the SDK's n=None): one choice
            n = 1
        if isinstance(n, bool) or not isinstance(n, int):
            raise _BadRequest(f"n must be an integer, got {n!r}.", "n")
        if n < 1:
            raise _BadRequest(f"n must be at least 1, got {n}.", "n")
        if n > 1 and doc.get("temperature", 1.0) == 0:
            raise _BadRequest("n must be 1 when using greedy sampling.", "n")
        logprobs: int | None = None
        if chat:
            _lax_bool(doc, "logprobs")
            top = doc.get("top_logprobs")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
                raise _BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}.", "top_logprobs")
            if top and not doc.get("logprobs"):
                raise _BadRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
            if doc.get("logprobs"):
                logprobs = int(top or 0)
        elif doc.get("logprobs") is not None:
            if isinstance(doc["logprobs"], bool) or not isinstance(doc["logprobs"], int) or doc["logprobs"] < 0:
                raise _BadRequest("logprobs must be a non-negative integer.", "logprobs")
            logprobs = doc["logprobs"]
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out, logprobs

    def _request(self, model: str, prompt: str | list[int] | None, messages: Any, sampling: dict[str, Any],
                 logprobs: bool) -> InferenceRequest:
        text = prompt if isinstance(prompt, str) else ""
        inputs = [_bytes_tensor("text_input", text), _bool_tensor("stream", True),
                  _bytes_tensor("sampling_parameters", json.dumps(sampling)),
                  _bool_tensor("exclude_input_in_output", True), _bool_tensor("return_finish_reason", True),
                  _bool_tensor("return_num_input_tokens", True), _bool_tensor("return_num_output_tokens", True),
                  _bool_tensor("return_logprobs", logprobs)]
        if messages is not None:
            inputs.append(_bytes_tensor("chat_messages", json.dumps(messages)))
        if isinstance(prompt, list):
            ids = np.array(prompt, dtype=np.int64)
            inputs.append(Tensor("input_ids", "INT64", [len(prompt)], ids))
        outputs = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "sequence_index",
                   "stop_reason"]
        if logprobs:
            outputs.append("logprobs")
        if "prompt_logprobs" in sampling:
            outputs.append("prompt_logprobs")
        return InferenceRequest(model, "", inputs, [RequestedOutput(o) for o in outputs], id=uuid.uuid4().hex)

    async def _deltas(self, request: InferenceRequest, keep_prompt_logprobs: bool = True,
                      as_ids: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        """Per-sequence deltas: {index, text, finish_reason, stop_reason, prompt_tokens, completion_tokens,
        logprobs}."""
        stream = self.plane.responses(request)
        try:
            async for item in stream:
                lp = _first(item, "logprobs")
                lp_doc = json.loads(lp) if lp else None
                prompt_part = _prompt_part(_first(item, "prompt_logprobs"), keep_prompt_logprobs)
                if as_ids:
                    lp_doc, prompt_part = (_as_ids(d) if d else d for d in (lp_doc, prompt_part))
                stop = _first(item, "stop_reason")
                yield {"index": int(_first(item, "sequence_index") or 0), "text": _first(item, "text_output") or "",
                       "finish_reason": _first(item, "finish_reason") or None,
                       "stop_reason": json.loads(stop) if stop else None,
                       "prompt_tokens": int(_first(item, "num_input_tokens") or 0),
                       "completion_tokens": int(_first(item, "num_output_tokens") or 0),
                       "logprobs": lp_doc, "prompt_logprobs": prompt_part}
        finally:
            await stream.aclose()

    @staticmethod
    def _prompts(prompt: Any) -> list[str | list[int]]:
        """A completions `prompt`: a string, a list of token ids, or a list of either (a batch)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(prompt, str) or ids(prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
            prompts = prompt
        else:
            raise _BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either.", "prompt")
        if any(p == "" for p in prompts):  # as vLLM (the BOS token alone is no prompt)
            raise _BadRequest("The decoder prompt cannot be empty.", "prompt")
        if len(prompts) > MAX_PROMPTS:  # each is a request of its own: a bound on what one call can queue
            raise _BadRequest(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request.", "prompt")
        for p in prompts:
            bad = next((t for t in p if not 0 <= t < 2**63), None) if isinstance(p, list) else None
            if bad is not None:
                raise _BadRequest(f"token id {bad} in prompt is out of range.", "prompt")
        return prompts

    async def _run(self, request: web.Request, chat: bool) -> web.StreamResponse:
        gens: list[AsyncGenerator[dict[str, Any], None]] = []
        role = "assistant"  # chat: the answer's role (the last message's when no generation prompt is added)
        echo: list[str | None] = []  # completions `echo`: each prompt's text (None: a token-id prompt, from the model)
        try:
            doc = await self._body(request)
            model = self._check_model(doc.get("model"))
            sampling, logprobs = self._sampling(doc, chat)
            fmt = doc.get("response_format")
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise _BadRequest("response_format other than {\"type\": \"text\"} (structured output) is not "
                                  "supported by this server.", "response_format")
            if chat:
                messages = doc.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise _BadRequest("messages must be a non-empty list.", "messages")
                _check_messages(messages)
                if doc.get("tools") and doc.get("tool_choice", "auto") != "none":
                    # vLLM without a tool parser answers the same way.
                    raise _BadRequest("tool calling is not supported by this server: send tool_choice \"none\" or "
                                      "no tools.", "tool_choice")
                chat_payload, role = _chat_payload(doc, messages)
                infers = [self._request(model, "", chat_payload, sampling, logprobs is not None)]
            else:
                if doc.get("suffix"):
                    raise _BadRequest("suffix is not supported by this server.", "suffix")
                prompts = self._prompts(doc.get("prompt"))
                if doc.get("echo"):
                    # The prompt's tokens get logprobs too (lm-eval's loglikelihood pattern); a token-id
                    # prompt's text comes back with them (the backend decodes it).
                    if logprobs is not None or not all(isinstance(p, str) for p in prompts):
                        sampling["prompt_logprobs"] = logprobs or 0
                    echo = [p if isinstance(p, str) else None for p in prompts]
                infers = [self._request(model, p, None, sampling, logprobs is not None) for p in prompts]
            as_ids = bool(doc.get("return_tokens_as_token_ids"))  # vLLM's: tokens as "token_id:N"
            gens = [self._deltas(infer, logprobs is not None, as_ids) for infer in infers]
            # Every prompt's first answer before anything is sent: a bad request is a plain 4xx.
            firsts = await asyncio.gather(*(anext(g, None) for g in gens), return_exceptions=True)
            for f in firsts:
                if isinstance(f, BaseException):
                    raise f
                if f is None:
                    raise _BadRequest("the model sent no response", status=500)
            self._check_context(model, sampling.get("max_tokens"), firsts)
        except _BadRequest as exc:
            await _close(gens)
            return error(exc.status, exc.message, exc.param)
        except PierError as exc:
            await _close(gens)
            return error(_CODE_STATUS.get(exc.code, 500), exc.message)
        n = int(sampling.get("n", 1))
        prompt_tokens = sum(f["prompt_tokens"] for f in firsts)  # type: ignore[index]
        deltas = _merge(list(zip(firsts, gens)), n)  # type: ignore[arg-type]
        first = await anext(deltas)
        created = int(time.time())
        ident = ("chatcmpl-" if chat else "cmpl-") + infers[0].id
        echoed = [echo[k // n] for k in range(n * len(echo))]  # per choice: its prompt's text (None: from the model)
        if doc.get("stream"):
            options = doc.get("stream_options") or {}
            usage = bool(isinstance(options, dict) and options.get("include_usage"))
            return await self._stream(request, deltas, first, ident, created, model, chat, prompt_tokens,
                                      usage, usage and bool(options.get("continuous_usage_stats")), echoed, role,
                                      n)
        return await self._whole(deltas, first, ident, created, model, chat, n * len(gens), prompt_tokens, echoed,
                                 role, n)

    async def _whole(self, deltas: AsyncGenerator[dict[str, Any], None], first: dict[str, Any], ident: str,
                     created: int, model: str, chat: bool, n: int, prompt_tokens: int,
                     echo: list[str | None], role: str, per_prompt: int) -> web.Response:
        texts: dict[int, list[str]] = {}
        finish: dict[int, str | None] = {}
        stops: dict[int, str | int | None] = {}
        completion: dict[int, int] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        item: dict[str, Any] | None = first
        try:
            while item is not None:
                i = item["index"]
                texts.setdefault(i, []).append(item["text"])
                if item["prompt_logprobs"]:  # echo: the prompt's text and (with logprobs) entries come first
                    _fill_echo(echo, i, per_prompt, item["prompt_logprobs"])
                    if "logprobs" in item["prompt_logprobs"]:
                        lps.setdefault(i, []).insert(0, item["prompt_logprobs"])
                if item["logprobs"]:
                    lps.setdefault(i, []).append(item["logprobs"])
                if item["finish_reason"]:
                    finish[i] = item["finish_reason"]
                    stops[i] = item["stop_reason"]
                completion[i] = item["completion_tokens"]
                item = await anext(deltas, None)
        except PierError as exc:
            return error(_CODE_STATUS.get(exc.code, 500), exc.message)
        finally:
            await deltas.aclose()
        choices = []
        for i in range(n):
            text = ((echo[i] or "") if echo else "") + "".join(texts.get(i, []))
            logprobs = _logprobs(lps.get(i, []), chat)
            if chat:
                choices.append({"index": i, "message": {"role": role, "content": text},
                                "logprobs": logprobs, "finish_reason": finish.get(i, "stop"),
                                "stop_reason": stops.get(i)})
            else:
                choices.append({"index": i, "text": text, "logprobs": logprobs,
                                "finish_reason": finish.get(i, "stop"), "stop_reason": stops.get(i)})
        total = sum(completion.values())
        doc = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model, "choices": choices,
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": total,
                         "total_tokens": prompt_tokens + total}}
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def _stream(self, request: web.Request, deltas: AsyncGenerator[dict[str, Any], None], first: dict[str, Any],
                      ident: str, created: int, model: str, chat: bool, prompt_tokens: int,
                      include_usage: bool, continuous_usage: bool, echo: list[str | None], role: str,
                      per_prompt: int) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                            "Cache-Control": "no-cache"})
        await reply.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(doc: dict[str, Any]) -> None:
            await reply.write(b"data: " + orjson.dumps(doc) + b"\n\n")

        completion: dict[int, int] = {}

        def usage_now() -> dict[str, int]:
            total = sum(completion.values())
            return {"prompt_tokens": prompt_tokens, "completion_tokens": total, "total_tokens": prompt_tokens + total}

        def chunk(choices: list[dict[str, Any]], final: bool = False) -> dict[str, Any]:
            """With include_usage every chunk has `usage`: null, then the totals in a last chunk of its
            own; with continuous_usage_stats too, every chunk carries the running totals (vLLM)."""
            doc: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": model, "choices": choices}
            if include_usage:
                doc["usage"] = usage_now() if final or continuous_usage else None
            return doc

        started: set[int] = set()
        sent: dict[int, int] = {}  # completion tokens of each choice that chunks went out for
        offset: dict[int, int] = {}  # completions logprobs: characters of each choice's text so far
        item: dict[str, Any] | None = first
        try:
            while item is not None:
                i = item["index"]
                completion[i] = item["completion_tokens"]
                if echo and i not in started:  # the prompt goes out first, as its own chunk
                    started.add(i)
                    part = item["prompt_logprobs"]
                    if part:
                        _fill_echo(echo, i, per_prompt, part)
                    prompt_lp = _logprobs([part] if part and "logprobs" in part else [], False)
                    if prompt_lp:
                        offset[i] = sum(len(t) for t in prompt_lp["tokens"])
                    await send(chunk([{"index": i, "text": echo[i] or "", "logprobs": prompt_lp,
                                       "finish_reason": None, "stop_reason": None}]))
                logprobs = _logprobs([item["logprobs"]] if item["logprobs"] else [], chat, offset.get(i, 0))
                if logprobs and not chat:  # text_offset runs on across chunks
                    offset[i] = offset.get(i, 0) + sum(len(t) for t in logprobs["tokens"])
                if chat:
                    if i not in started:
                        started.add(i)
                        await send(chunk([{"index": i, "delta": {"role": role, "content": ""},
                                           "logprobs": None, "finish_reason": None}]))
                    delta = {"content": item["text"]} if item["text"] or not item["finish_reason"] else {}
                    choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": item["finish_reason"],
                              "stop_reason": item["stop_reason"]}
                else:
                    choice = {"index": i, "text": item["text"], "logprobs": logprobs,
                              "finish_reason": item["finish_reason"], "stop_reason": item["stop_reason"]}
                if item["text"] or item["finish_reason"] or logprobs or item["completion_tokens"] > sent.get(i, 0):
                    await send(chunk([choice]))  # a chunk per step that made tokens, as vLLM's
                    sent[i] = item["completion_tokens"]
                item = await anext(deltas, None)
            if include_usage:
                await send(chunk([], final=True))
        except PierError as exc:
            await send({"error": {"message": exc.message, "type": "BadRequestError", "param": None,
                                  "code": _CODE_STATUS.get(exc.code, 500)}})
        finally:
            await deltas.aclose()  # when the client went away too: that cancels the request
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply

    # ---- routes --------------------------------------------------------------------------

    def _check_context(self, model: str, max_tokens: Any, firsts: list[Any]) -> None:
        """As vLLM's OpenAI server: a prompt plus max_tokens past the model's context is a 400
        (the engine would stop early with "length"). The prompt's token count is known once the
        backend answered; the request is cancelled with the error."""
        limit = self.plane.models_with_backend("llm").get(model, {}).get("max_model_len")
        if not isinstance(max_tokens, int) or not isinstance(limit, int):
            return
        for f in firsts:
            asked = f["prompt_tokens"] + max_tokens
            if asked > limit:
                raise _BadRequest(
                    f"This model's maximum context length is {limit} tokens. However, you requested {asked} "
                    f"tokens ({f['prompt_tokens']} in the messages, {max_tokens} in the completion). Please reduce "
                    "the length of the messages or completion.")

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "pier", "root": m, "parent": None,
                 **info} for m, info in self.plane.models_with_backend("llm").items()]
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=False)

    # vLLM's server probes, for health checks written against it
    async def health(self, request: web.Request) -> web.Response:
        try:
            ready = self.plane.ready()
        except PierError:  # exiting
            ready = False
        return web.Response(status=200 if ready else 503)

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({"version": __version__}), content_type="application/json")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=True)


def _chat_payload(doc: dict[str, Any], messages: list[Any]) -> tuple[Any, str]:
    """What the LLM backend's chat_messages input carries: the messages, or, when the request sets
    template options (add_generation_prompt, continue_final_message, chat_template_kwargs, tools),
    an object with them; and the answer's role (as vLLM: the last message's without a generation prompt)."""
    if doc.get("chat_template") is not None:
        raise _BadRequest("a chat_template in the request is not supported: the model's template is used.",
                          "chat_template")
    add = doc.get("add_generation_prompt", True)
    cont = doc.get("continue_final_message", False)
    kwargs = doc.get("chat_template_kwargs")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if not isinstance(value, bool):
            raise _BadRequest(f"{name} must be a boolean.", name)
    # the options' other checks (both true, kwargs not an object) are the backend's (_render_chat)
    role = "assistant" if add else str(messages[-1]["role"])
    tools = doc.get("tools")  # only with tool_choice "none" here: rendered, as vLLM renders them by default
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _BadRequest("tools must be a list of tool objects.", "tools")
    if add and not cont and not kwargs and not tools:
        return messages, role
    payload = {"messages": messages, "add_generation_prompt": add, "continue_final_message": cont,
               "chat_template_kwargs": kwargs or {}}
    if tools:
        payload["tools"] = tools
    return payload, role


def _as_ids(doc: dict[str, Any]) -> dict[str, Any]:
    """return_tokens_as_token_ids: a logprobs doc's tokens and alternatives as "token_id:N" (vLLM's
    form, for tokens whose text is not a whole character)."""
    if "ids" not in doc:  # the prompt's text alone (echo without logprobs)
        return doc
    out = dict(doc, tokens=[f"token_id:{t}" for t in doc["ids"]])
    out["logprobs"] = [None if e is None else [e[0], [[f"token_id:{a[2]}", a[1], a[2]] for a in e[1]]]
                       for e in doc["logprobs"]]
    return out


def _prompt_part(payload: Any, keep_logprobs: bool) -> dict[str, Any] | None:
    """The backend's prompt_logprobs output: {"text", "tokens", "logprobs"}; only the prompt's text
    when the request did not ask for logprobs (echo of a token-id prompt)."""
    if not payload:
        return None
    doc = json.loads(payload)
    return doc if keep_logprobs else {"text": doc.get("text", "")}


def _fill_echo(echo: list[str | None], i: int, per_prompt: int, part: dict[str, Any]) -> None:
    """A token-id prompt's echo text, from the model's decoding of it, for every choice of that prompt."""
    first = i - i % per_prompt
    for j in range(first, min(first + per_prompt, len(echo))):
        if echo[j] is None:
            echo[j] = part.get("text", "")


def _check_messages(messages: list[Any]) -> None:
    """Each message: an object with a string role, and content that is a string, a list of text
    parts, or (assistant turns only) null; else a 400 naming the message."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadRequest(f"messages[{i}] must be an object with a string 'role'.", "messages")
        content = m.get("content")
        if isinstance(content, str) or (content is None and m["role"] == "assistant"):
            continue
        if not isinstance(content, list):
            raise _BadRequest(f"messages[{i}].content must be a string or a list of content parts.", "messages")
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _BadRequest(f"messages[{i}].content has a '{kind}' part: this model takes text parts only.",
                                  "messages")


async def _close(gens: list[AsyncGenerator[dict[str, Any], None]]) -> None:
    for g in gens:
        await g.aclose()  # cancels that prompt's request


async def _merge(streams: list[tuple[dict[str, Any], AsyncGenerator[dict[str, Any], None]]],
                 n: int) -> AsyncGenerator[dict[str, Any], None]:
    """One stream of deltas for a batch of prompts, as they come: prompt p's sequence i becomes
    choice p * n + i (vLLM's numbering). Closing it cancels every prompt's request."""
    if len(streams) == 1:
        first, gen = streams[0]
        try:
            yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

    async def pump(p: int, first: dict[str, Any], gen: AsyncGenerator[dict[str, Any], None]) -> None:
        try:
            item: dict[str, Any] | None = first
            while item is not None:
                queue.put_nowait({**item, "index": item["index"] + p * n})
                item = await anext(gen, None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(p, first, gen)) for p, (first, gen) in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close([gen for _, gen in streams])


def _logprobs(parts: list[dict[str, Any]], chat: bool, start: int = 0) -> dict[str, Any] | None:
    """The backend's per-delta {"tokens": [...], "logprobs": [[lp, [[tok, lp], ...best first]], ...]} in
    OpenAI's shapes. Chat: every alternative, best first. Completions: text offsets from `start`;
    top_logprobs is a {token: logprob} object (alternatives whose texts coincide share a key, as in
    vLLM's) that holds the chosen token too."""
    if not parts:
        return None
    tokens = [t for p in parts for t in p["tokens"]]
    entries = [e or (None, None) for p in parts for e in p["logprobs"]]  # None: a prompt's first token
    if chat:
        return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                              for t, v, *_ in top or []]}
                            for tok, (lp, top) in zip(tokens, entries)]}
    offsets, pos = [], start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    tops: list[dict[str, float] | None] = []
    for tok, (lp, top) in zip(tokens, entries):
        alternatives = {t: v for t, v, *_ in top or []}
        tops.append(None if lp is None else alternatives if tok in alternatives else {**alternatives, tok: lp})
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


def add_routes(app: web.Application, plane: DataPlane, max_json_size: int) -> None:
    h = OpenAIHandlers(plane, max_json_size)
    for slash in ("", "/"):  # with a trailing slash too, as vLLM's server answers
        app.router.add_get("/v1/models" + slash, h.models)
        app.router.add_post("/v1/completions" + slash, h.completions)
        app.router.add_post("/v1/chat/completions" + slash, h.chat_completions)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ping", h.health)
    app.router.add_post("/ping", h.health)
    app.router.add_get("/version", h.version)
