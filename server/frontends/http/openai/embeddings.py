"""`POST /v1/embeddings` (OpenAI's, as vLLM serves it) for two kinds of model behind one base URL:

- an LLM (the LLM backend): the EMBED request of the LLM tensor protocol, vLLM's embed runner for
  decoder models (the last prompt token's final hidden state, L2-normalised); text or token ids;
- any other model that declares itself an embedding model with the config parameter
  `openai_embeddings` = "<text input>,<embedding output>" (an ensemble like `embed`: tokenizer +
  encoder): each input string is a request to it (its dynamic batcher batches them); text only,
  and it reports no token counts (usage is 0: the tokenizer is inside the model).

`encoding_format` "float" or "base64" (little-endian float32, what the openai SDK asks for when
the caller does not choose), `dimensions` (the first N, renormalised; more than the model has is a
400), `user` accepted with no effect; any other field is a 400 that names it."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np

from pier.contract import llm
from pier.contract.types import InferenceRequest, RequestedOutput, Tensor
from pier.dataplane.plane import DataPlane
from pier.frontends.http.openai.llm_io import bool_tensor, bytes_tensor, one_response
from pier.frontends.http.openai.protocol import BadRequest

PARAMETER = "openai_embeddings"  # the config parameter that declares an embedding model
FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


def check_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and
                                                       0 <= t < 2**63 for t in x)

    if isinstance(value, str) or ids(value):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(x, str) or ids(x) for x in value):
        items = value
    else:
        raise BadRequest("input must be a string, a list of strings, a list of token ids, or a list of lists of "
                         "token ids.", "input")
    if any(x == "" for x in items):
        raise BadRequest("input strings must not be empty.", "input")
    if len(items) > MAX_INPUTS:
        raise BadRequest(f"input holds {len(items)} items; at most {MAX_INPUTS} per request.", "input")
    return items


def _request(model: str, inputs: list[Tensor], outputs: list[str]) -> InferenceRequest:
    return InferenceRequest(model, "", inputs, [RequestedOutput(o) for o in outputs], id=uuid.uuid4().hex)


async def _one(plane: DataPlane, request: InferenceRequest, output: str) -> tuple[np.ndarray, int]:
    got = await one_response(plane, request)
    if output not in got:
        raise BadRequest(f"the model answered without its '{output}' output", status=500)
    count = got.get(llm.NUM_INPUT_TOKENS)
    return got[output].astype(np.float32).reshape(-1), int(count.reshape(-1)[0]) if count is not None else 0


async def embed(plane: DataPlane, model: str, doc: dict[str, Any], declared: str | None) -> dict[str, Any]:
    """The whole answer for `doc` (`declared`: a KServe model's `openai_embeddings` value; None: an LLM)."""
    for key, value in doc.items():
        if key not in FIELDS and value is not None:
            raise BadRequest(f"Unrecognized request argument supplied: {key}", key)
    items = check_inputs(doc.get("input"))
    fmt = doc.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest(f"encoding_format must be 'float' or 'base64', got {fmt!r}.", "encoding_format")
    dims = doc.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise BadRequest("dimensions must be a positive integer.", "dimensions")
    if declared is None:
        calls = [_one(plane, _request(model, _llm_inputs(x), [llm.EMBEDDING, llm.NUM_INPUT_TOKENS]), llm.EMBEDDING)
                 for x in items]
    else:
        text_input, _, output = declared.partition(",")
        if not text_input or not output:
            raise BadRequest(f"model '{model}' has a malformed {PARAMETER} parameter {declared!r} (expected "
                             "'<text input>,<embedding output>')", status=500)
        if any(not isinstance(x, str) for x in items):
            raise BadRequest(f"model '{model}' takes text: token ids are for an LLM's embeddings.", "input")
        batched = plane.resolve(model).spec.max_batch_size > 0
        shape = [1, 1] if batched else [1]
        texts = [x for x in items if isinstance(x, str)]
        calls = [_one(plane, _request(model, [Tensor(text_input.strip(), "BYTES", shape,
                                                     np.array([x.encode("utf-8")], dtype=object).reshape(shape))],
                                      [output.strip()]), output.strip()) for x in texts]
    results = await asyncio.gather(*calls)
    data = []
    for i, (vector, _) in enumerate(results):
        if dims is not None:
            if dims > vector.size:
                raise BadRequest(f"dimensions={dims} is more than the model's {vector.size}.", "dimensions")
            vector = vector[:dims]
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        encoded: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() if fmt == "base64" \
            else vector.astype(np.float32).tolist()
        data.append({"object": "embedding", "embedding": encoded, "index": i})
    tokens = sum(n for _, n in results)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "id": f"embd-{uuid.uuid4().hex}"}


def _llm_inputs(item: str | list[int]) -> list[Tensor]:
    inputs = [bytes_tensor(llm.TEXT_INPUT, item if isinstance(item, str) else ""), bool_tensor(llm.EMBED, True),
              bool_tensor(llm.STREAM, False)]
    if isinstance(item, list):
        inputs.append(Tensor(llm.INPUT_IDS, "INT64", [len(item)], np.array(item, dtype=np.int64)))
    return inputs
