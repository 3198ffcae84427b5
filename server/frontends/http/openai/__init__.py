"""OpenAI-compatible API on the HTTP port, for models served by the LLM backend:
`GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (chat template applied),
`stream: true` as server-sent events ending with `data: [DONE]`, usage counts, OpenAI's and
vLLM's sampling fields, errors in OpenAI's shape. Each call is an ordinary request to the
model through the data plane (the LLM backend's tensors, pier.contract.llm, streamed), so it is
scheduled, counted and cancelled (client gone) like any other.

- `protocol`: the request checks both endpoints share, and errors in OpenAI's shape;
- `completions`, `chat`: each endpoint's own fields and choice shapes (an `endpoint.Endpoint`);
- `llm_io`: the inference request for a prompt, and the backend's responses as deltas;
- `logprobs`: the backend's logprobs documents in OpenAI's shapes;
- `choices`: a batch's deltas merged into one stream of choices, and the whole (non-streamed) answer;
- `streaming`: the streamed answer (server-sent events);
- `tools`: tool calls, forced through structured output or found in the text by a parser;
- `tokenize`: vLLM's /tokenize and /detokenize;
- `embeddings`: /v1/embeddings, for LLMs and for models declared with `openai_embeddings`;
- `service`: the handlers, running a call through the above.
"""

from __future__ import annotations

from aiohttp import web

from pier.dataplane.plane import DataPlane
from pier.frontends.http.openai.service import OpenAIHandlers


def add_routes(app: web.Application, plane: DataPlane, max_json_size: int) -> None:
    h = OpenAIHandlers(plane, max_json_size)
    for slash in ("", "/"):  # with a trailing slash too, as vLLM's server answers
        app.router.add_get("/v1/models" + slash, h.models)
        app.router.add_post("/v1/completions" + slash, h.completions)
        app.router.add_post("/v1/chat/completions" + slash, h.chat_completions)
        app.router.add_post("/v1/embeddings" + slash, h.embeddings)
    app.router.add_post("/v1/load_lora_adapter", h.load_lora_adapter)  # vLLM's; restricted as model control
    app.router.add_post("/v1/unload_lora_adapter", h.unload_lora_adapter)
    app.router.add_post("/tokenize", h.tokenize)  # vLLM's
    app.router.add_post("/detokenize", h.detokenize)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ping", h.health)
    app.router.add_post("/ping", h.health)
    app.router.add_get("/version", h.version)
