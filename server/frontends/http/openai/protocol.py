"""The OpenAI API's request checks shared by completions and chat (the body, `model`, the sampling
fields), read as vLLM's pydantic models read them (lax mode), and errors in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from pier.contract import llm
from pier.contract.errors import ErrorCode, PierError
from pier.frontends.http import codec
from pier.frontends.json_data import json_type

# Body fields passed to the engine's sampling parameters (OpenAI's and vLLM's names).
SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
            "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens",
            "include_stop_str_in_output", "logit_bias", "priority")
_STATUS_TYPES = {400: "BadRequestError", 401: "invalid_request_error", 404: "NotFoundError", 413: "BadRequestError",
                 429: "RateLimitError", 500: "InternalServerError",
                 501: "NotImplementedError", 503: "ServiceUnavailableError"}
_CODE_STATUS = {ErrorCode.INVALID_ARG: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.UNSUPPORTED: 400,
                ErrorCode.TOO_LARGE: 413, ErrorCode.UNAVAILABLE: 503, ErrorCode.RATE_LIMITED: 429,
                ErrorCode.UNAUTHENTICATED: 401}


class BadRequest(Exception):
    """A request this frontend refuses: its status (4xx, or 500), message and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error(status: int, message: str, param: str | None = None) -> web.Response:
    doc = {"error": {"message": message, "type": _STATUS_TYPES.get(status, "BadRequestError"), "param": param,
                     "code": status}}
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def pier_error(exc: PierError) -> web.Response:
    """An error from the data plane or the model, before anything was sent (an overloaded model's
    refusal with its Retry-After)."""
    response = error(_CODE_STATUS.get(exc.code, 500), exc.message)
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def stream_error(exc: PierError) -> dict[str, Any]:
    """The error event of a stream that had started."""
    return {"error": {"message": exc.message, "type": "BadRequestError", "param": None,
                      "code": _CODE_STATUS.get(exc.code, 500)}}


# Boolean request fields read here (`logprobs` is one in chat; completions' integer logprobs is
# checked with the other sampling fields).
_FLAGS = ("stream", "echo", "add_generation_prompt", "continue_final_message", "return_tokens_as_token_ids")
_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}
_INTS = ("max_tokens", "max_completion_tokens", "n", "top_logprobs", "seed", "top_k", "min_tokens", "priority")


def lax_bool(doc: dict[str, Any], key: str) -> None:
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
        raise BadRequest(f"{key} must be a boolean, got {value!r}.", key)


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


async def read_body(request: web.Request, max_json_size: int) -> dict[str, Any]:
    """The request's JSON object, its boolean fields read as bools."""
    try:
        raw = await codec.read_body(request, max_json_size, json_only=True)
        doc = codec.parse_json(raw)
    except PierError as exc:
        raise BadRequest(exc.message, None, 413 if exc.code is ErrorCode.TOO_LARGE else 400) from None
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in _FLAGS:
        lax_bool(doc, key)
    return doc


def check_model(name: Any, models: list[str], not_serving: Callable[[str], str | None] | None = None) -> str:
    """The request's `model`, one of `models` (the LLM models served). `not_serving`: why a model
    the server knows serves no version now (its engine restarts, say), refused 503 with that reason."""
    if name is None and len(models) == 1:  # as vLLM: the model is optional when one is served
        return models[0]
    if name is None and models:
        raise BadRequest(f"'model' is required: this server serves {', '.join(models)}.", "model")
    if name is not None and not isinstance(name, str):  # a malformed request, not an unknown model
        raise BadRequest(f"model must be a string, got {json_type(name)}.", "model")
    if name is not None and name not in models and not_serving is not None and (why := not_serving(name)):
        raise BadRequest(f"The model `{name}` is not available now: {why}", "model", 503)
    if name not in models:
        raise BadRequest(f"The model `{name}` does not exist. Models served here: {', '.join(models) or 'none'}.",
                         "model", 404)
    return name


def sampling_parameters(doc: dict[str, Any], chat: bool) -> tuple[dict[str, Any], int | None]:
    """The sampling_parameters input for the backend, and the logprobs asked for (alternatives per token;
    None: no logprobs). Chat's max tokens may be max_completion_tokens, its logprobs a boolean
    with top_logprobs beside it."""
    for key in _INTS if chat else (*_INTS, "logprobs"):  # chat's logprobs is a boolean
        _lax_int(doc, key)
    out = {k: doc[k] for k in SAMPLING if doc.get(k) is not None}
    out[llm.SAMPLING_MAX_TOKENS] = _max_tokens(doc, chat)
    temperature = doc.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}.", "temperature")
    if doc.get("stream_options") is not None:
        if not doc.get("stream"):
            raise BadRequest("stream_options can only be set when stream is true.", "stream_options")
        if not isinstance(doc["stream_options"], dict):
            raise BadRequest("stream_options must be an object.", "stream_options")
    _check_n(doc)
    logprobs = _chat_logprobs(doc) if chat else _completion_logprobs(doc)
    if logprobs is not None:
        out[llm.SAMPLING_LOGPROBS] = logprobs
    return out, logprobs


def _max_tokens(doc: dict[str, Any], chat: bool) -> int | None:
    max_tokens = doc.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = doc.get("max_tokens")
    if max_tokens is None and not chat:  # absent or null: the completions API's default, as vLLM
        max_tokens = 16
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)  # 3.0, as pydantic's lax int
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise BadRequest(f"max_tokens must be an integer, got {max_tokens!r}.", "max_tokens")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    return max_tokens


def _check_n(doc: dict[str, Any]) -> None:
    n = doc.get("n")
    if n is None:  # absent or null (the SDK's n=None): one choice
        n = 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise BadRequest(f"n must be an integer, got {n!r}.", "n")
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.", "n")
    if n > 1 and doc.get("temperature", 1.0) == 0:
        raise BadRequest("n must be 1 when using greedy sampling.", "n")


def _chat_logprobs(doc: dict[str, Any]) -> int | None:
    """Chat: `logprobs` true asks for them, `top_logprobs` alternatives per token."""
    lax_bool(doc, "logprobs")
    top = doc.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}.", "top_logprobs")
    if top and not doc.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs set to true.", "top_logprobs")
    return int(top or 0) if doc.get("logprobs") else None


def _completion_logprobs(doc: dict[str, Any]) -> int | None:
    """Completions: `logprobs` is the number of alternatives per token."""
    if doc.get("logprobs") is None:
        return None
    if isinstance(doc["logprobs"], bool) or not isinstance(doc["logprobs"], int) or doc["logprobs"] < 0:
        raise BadRequest("logprobs must be a non-negative integer.", "logprobs")
    return doc["logprobs"]


# Every body field Pier reads (each implemented), per endpoint.
_COMMON = frozenset({"model", "stream", "stream_options", "n", "max_tokens", "logprobs", "response_format",
                     "structured_outputs", "return_tokens_as_token_ids", *SAMPLING})
FIELDS = {
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template",
                     "chat_template_kwargs", "add_generation_prompt", "continue_final_message"},
    False: _COMMON | {"prompt", "suffix", "echo"},
}
# Accepted for compatibility, with no effect on the answer: OpenAI's end-user id (abuse tracking),
# and fields whose value asks for nothing beyond the default (a non-default value is refused).
COMPATIBLE = frozenset({"user"})
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "store": (False,), "parallel_tool_calls": (True, False), "service_tier": ("auto", "default"),
    "metadata": ({},), "modalities": (["text"],),
}


def check_fields(doc: dict[str, Any], chat: bool) -> None:
    """No silent ignoring: a field Pier does not implement is a 400 that names it, in OpenAI's own
    words for an unknown argument (vLLM answers 200 and logs that it ignored it). A null value
    asks for nothing and passes."""
    for key, value in doc.items():
        if key in FIELDS[chat] or key in COMPATIBLE or value is None:
            continue
        if key in DEFAULT_ONLY:
            if value not in DEFAULT_ONLY[key]:
                raise BadRequest(f"{key}={value!r} is not supported by this server (only the default, "
                                 f"{DEFAULT_ONLY[key][0]!r}, is).", key)
            continue
        raise BadRequest(f"Unrecognized request argument supplied: {key} (this server does not implement it; "
                         "docs/llm.md lists the fields it reads).", key)


def structured_outputs(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The request's output constraint for the engine (vLLM's `structured_outputs` object), from
    OpenAI's `response_format` (json_object, json_schema) or vLLM's `structured_outputs` (json,
    json_object, regex, choice, grammar); the engine compiles it and refuses what it cannot honour."""
    fmt, so = doc.get("response_format"), doc.get("structured_outputs")
    if fmt is not None and so is not None:
        raise BadRequest("set response_format or structured_outputs, not both.", "response_format")
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("structured_outputs must be an object.", "structured_outputs")
        return so
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema must be an object with a 'schema' object.",
                             "response_format")
        return {"json": spec.get("schema", {})}  # `strict` or not, the schema is enforced
    raise BadRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                     "response_format")
