"""The OpenAI frontend's side of the LLM tensor protocol (pier.contract.llm): a call's inference
request, and the backend's streamed responses read back as per-sequence deltas."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np

from pier.contract import llm
from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from pier.dataplane.plane import DataPlane

Delta = dict[str, Any]
"""One response of one sequence: {model (the one that answered), index, text, finish_reason, stop_reason,
prompt_tokens, completion_tokens, logprobs, prompt_logprobs, timings} (logprobs, prompt_logprobs:
LOGPROBS documents, or None; timings: the engine's phases in a traced call's last response, or None)."""


def bytes_tensor(name: str, text: str) -> Tensor:
    return Tensor(name, "BYTES", [1], np.array([text.encode("utf-8")], dtype=object))


def bool_tensor(name: str, value: bool) -> Tensor:
    return Tensor(name, "BOOL", [1], np.array([value]))


def inference_request(model: str, prompt: str | list[int] | None, messages: Any, sampling: dict[str, Any],
            logprobs: bool, request_id: str = "") -> InferenceRequest:
    """A streamed request for one prompt (text or token ids) or one chat (`messages`: what the
    chat_messages input carries), every output it can ask for; `request_id`: the call's (its
    X-Request-Id), else a new one."""
    text = prompt if isinstance(prompt, str) else ""
    inputs = [bytes_tensor(llm.TEXT_INPUT, text), bool_tensor(llm.STREAM, True),
              bytes_tensor(llm.SAMPLING_PARAMETERS, json.dumps(sampling)),
              bool_tensor(llm.EXCLUDE_INPUT_IN_OUTPUT, True), bool_tensor(llm.RETURN_FINISH_REASON, True),
              bool_tensor(llm.RETURN_NUM_INPUT_TOKENS, True), bool_tensor(llm.RETURN_NUM_OUTPUT_TOKENS, True),
              bool_tensor(llm.RETURN_LOGPROBS, logprobs)]
    if messages is not None:
        inputs.append(bytes_tensor(llm.CHAT_MESSAGES, json.dumps(messages)))
    if isinstance(prompt, list):
        ids = np.array(prompt, dtype=np.int64)
        inputs.append(Tensor(llm.INPUT_IDS, "INT64", [len(prompt)], ids))
    outputs = [llm.TEXT_OUTPUT, llm.FINISH_REASON, llm.NUM_INPUT_TOKENS, llm.NUM_OUTPUT_TOKENS, llm.SEQUENCE_INDEX,
               llm.STOP_REASON]
    if logprobs:
        outputs.append(llm.LOGPROBS)
    if llm.SAMPLING_PROMPT_LOGPROBS in sampling:
        outputs.append(llm.PROMPT_LOGPROBS)
    return InferenceRequest(model, "", inputs, [RequestedOutput(o) for o in outputs],
                            id=request_id or uuid.uuid4().hex)


async def one_response(plane: DataPlane, request: InferenceRequest) -> dict[str, np.ndarray]:
    """The tensors of a request that answers once (tokenize, detokenize, an embedding), by name;
    the model's refusal is raised (PierError)."""
    stream = plane.responses(request)
    try:
        async for item in stream:
            return {t.name: t.data for t in item.outputs}
    finally:
        await stream.aclose()
    raise PierError(ErrorCode.INTERNAL, "the model sent no response")


def _scalars(response: InferenceResponse) -> dict[str, Any]:
    """Each output's one element (text decoded), by name: read once per response."""
    out: dict[str, Any] = {}
    for t in response.outputs:
        value = t.data.reshape(-1)[0]
        out[t.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value.item()
    return out


async def response_deltas(plane: DataPlane, request: InferenceRequest, keep_prompt_logprobs: bool = True,
                          as_ids: bool = False) -> AsyncGenerator[Delta, None]:
    """The request's responses as deltas; closing it cancels the request. `keep_prompt_logprobs`
    false keeps only the prompt's text of prompt_logprobs; `as_ids` writes tokens as "token_id:N"."""
    stream = plane.responses(request)
    try:
        async for item in stream:
            got = _scalars(item)
            lp = got.get(llm.LOGPROBS)
            lp_doc = json.loads(lp) if lp else None
            prompt_part = _prompt_part(got.get(llm.PROMPT_LOGPROBS), keep_prompt_logprobs)
            if as_ids:
                lp_doc, prompt_part = (_as_ids(d) if d else d for d in (lp_doc, prompt_part))
            stop = got.get(llm.STOP_REASON)
            yield {"model": item.model_name, "index": int(got.get(llm.SEQUENCE_INDEX) or 0),
                   "text": got.get(llm.TEXT_OUTPUT) or "",
                   "finish_reason": got.get(llm.FINISH_REASON) or None,
                   "stop_reason": json.loads(stop) if stop else None,
                   "prompt_tokens": int(got.get(llm.NUM_INPUT_TOKENS) or 0),
                   "completion_tokens": int(got.get(llm.NUM_OUTPUT_TOKENS) or 0),
                   "logprobs": lp_doc, "prompt_logprobs": prompt_part, "timings": item.parameters.get(llm.TIMINGS)}
    finally:
        await stream.aclose()


def _as_ids(doc: dict[str, Any]) -> dict[str, Any]:
    """return_tokens_as_token_ids: a logprobs doc's tokens and alternatives as "token_id:N" (vLLM's
    form, for tokens whose text is not a whole character)."""
    if llm.LOGPROBS_IDS not in doc:  # the prompt's text alone (echo without logprobs)
        return doc
    out = {**doc, llm.LOGPROBS_TOKENS: [f"token_id:{t}" for t in doc[llm.LOGPROBS_IDS]]}
    out[llm.LOGPROBS_ENTRIES] = [None if e is None else [e[0], [[f"token_id:{a[2]}", a[1], a[2]] for a in e[1]]]
                                 for e in doc[llm.LOGPROBS_ENTRIES]]
    return out


def _prompt_part(payload: Any, keep_logprobs: bool) -> dict[str, Any] | None:
    """The backend's prompt_logprobs output: {"text", "tokens", "logprobs"}; only the prompt's text
    when the request did not ask for logprobs (echo of a token-id prompt)."""
    if not payload:
        return None
    doc = json.loads(payload)
    return doc if keep_logprobs else {llm.PROMPT_TEXT: doc.get(llm.PROMPT_TEXT, "")}
