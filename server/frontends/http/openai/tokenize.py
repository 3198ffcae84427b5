"""vLLM's `POST /tokenize` and `POST /detokenize`: the model's own tokenizer through the LLM
tensor protocol (TOKENIZE / DETOKENIZE requests: nothing is generated), so the ids are exactly
those the engine would compute with.

/tokenize takes `prompt` (text, special tokens added unless `add_special_tokens` is false) or
`messages` (rendered by the chat template, with `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, `tools`) and answers {"count", "max_model_len", "tokens", "token_strs"};
/detokenize takes `tokens` and answers {"prompt"}."""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from pier.contract import llm
from pier.contract.types import InferenceRequest, RequestedOutput, Tensor
from pier.frontends.http.openai.chat import chat_payload, check_messages
from pier.frontends.http.openai.llm_io import bool_tensor, bytes_tensor
from pier.frontends.http.openai.protocol import BadRequest, lax_bool

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _unknown(doc: dict[str, Any], allowed: frozenset[str]) -> None:
    for key, value in doc.items():
        if key not in allowed and value is not None:
            raise BadRequest(f"Unrecognized request argument supplied: {key}", key)


def tokenize_request(model: str, doc: dict[str, Any]) -> InferenceRequest:
    _unknown(doc, TOKENIZE_FIELDS)
    for key in ("add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs"):
        lax_bool(doc, key)
    if doc.get("return_token_strs"):
        raise BadRequest("return_token_strs is not supported by this server.", "return_token_strs")
    inputs = [bool_tensor(llm.TOKENIZE, True)]
    if doc.get("messages") is not None:
        if doc.get("prompt") is not None:
            raise BadRequest("send prompt or messages, not both.", "messages")
        payload, _ = chat_payload(doc, check_messages(doc["messages"]))
        inputs += [bytes_tensor(llm.TEXT_INPUT, ""), bytes_tensor(llm.CHAT_MESSAGES, json.dumps(payload))]
    else:
        prompt = doc.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (or send messages).", "prompt")
        if doc.get("add_special_tokens") is False:
            raise BadRequest("add_special_tokens false is not supported by this server.", "add_special_tokens")
        inputs.append(bytes_tensor(llm.TEXT_INPUT, prompt))
    return InferenceRequest(model, "", inputs, [RequestedOutput(llm.PROMPT_IDS), RequestedOutput(llm.NUM_INPUT_TOKENS)],
                            id=uuid.uuid4().hex)


def detokenize_request(model: str, doc: dict[str, Any]) -> InferenceRequest:
    _unknown(doc, DETOKENIZE_FIELDS)
    tokens = doc.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens must be a list of token ids.", "tokens")
    if any(not 0 <= t < 2**63 for t in tokens):
        raise BadRequest("a token id is out of range.", "tokens")
    inputs = [bool_tensor(llm.DETOKENIZE, True), bytes_tensor(llm.TEXT_INPUT, ""),
              Tensor(llm.INPUT_IDS, "INT64", [len(tokens)], np.array(tokens, dtype=np.int64))]
    return InferenceRequest(model, "", inputs, [RequestedOutput(llm.TEXT_OUTPUT)], id=uuid.uuid4().hex)
