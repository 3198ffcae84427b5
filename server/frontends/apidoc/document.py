"""The OpenAPI 3.0 document, built from the HTTP app's own router: every route it serves appears,
described by OPERATIONS (a route missing there is a test failure, tests/e2e/test_openapi.py), and
nothing it does not serve. Swagger UI 4 (the swagger-ui-bundle package) renders OpenAPI 3.0, so
the document is 3.0.3.

Catch-all routes (`/v2/cudasharedmemory/{tail}`, named repositories) answer only "not
implemented" and are left out; so are the trailing-slash aliases of the OpenAI routes."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from pier import __version__
from pier.frontends.apidoc.schemas import SCHEMAS, STRING, Schema, ref

OPENAPI = "3.0.3"
_JSON = "application/json"


def _body(name: str, content_type: str = _JSON) -> dict[str, Any]:
    return {"content": {content_type: {"schema": ref(name)}}}


def _ok(name: str | None = None, content_type: str = _JSON, description: str = "OK") -> dict[str, Any]:
    if name is None:
        return {"200": {"description": description}}
    return {"200": {"description": description, **_body(name, content_type)}}


_TEXT_EMPTY = {"description": "An empty text/plain body", "content": {"text/plain": {"schema": STRING}}}
_SSE = {"description": "Server-sent events: one `data: {json}` line per response (OpenAI: ending `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": STRING}}}
_LORA_OK = {"200": {"description": "vLLM's plain-text success line",
                    "content": {"text/plain": {"schema": STRING}}}}
_PROMETHEUS = {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": STRING}}}


def _op(summary: str, tag: str, responses: dict[str, Any], body: str | None = None, openai: bool = False,
        optional_body: bool = False, **extra: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": [tag], "responses": {
        **responses, "default": {"description": "An error", **_body("OpenAIError" if openai else "Error")}}}
    if body is not None:
        op["requestBody"] = {"required": not optional_body, **_body(body)}
    op.update(extra)
    return op


M, V = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
R = "/v2/repository/models/{model}"
_HEALTH = {"200": _TEXT_EMPTY, "400": _TEXT_EMPTY}
_READY = {"200": _TEXT_EMPTY, "400": {"description": "Not ready: Triton's body, with the state and reason of a "
                                                    "version Pier knows (e.g. a load's progress)",
                                      "content": {"text/plain": {"schema": STRING}}}}


def _per_version(path: str, method: str, op: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method, M + path): op, (method, V + path): {**op, "summary": op["summary"] + " (one version)"}}


OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/v2/health/live"): _op("Server live", "health", _HEALTH),
    ("GET", "/v2/health/ready"): _op("Server ready", "health", _HEALTH),
    ("GET", "/v2"): _op("Server metadata", "metadata", _ok("ServerMetadata")),
    ("GET", "/v2/models/stats"): _op("Statistics of every model", "statistics", _ok("ModelStatistics")),
    **_per_version("/infer", "POST", _op("Inference (JSON; binary tensors with Inference-Header-Content-Length)",
                                         "inference", _ok("InferenceResponse"), "InferenceRequest")),
    **_per_version("", "GET", _op("Model metadata", "metadata", _ok("ModelMetadata"))),
    **_per_version("/ready", "GET", _op("Model ready", "health", _READY)),
    **_per_version("/config", "GET", _op("Model configuration", "model-config", _ok("ModelConfig"))),
    **_per_version("/stats", "GET", _op("Model statistics", "statistics", _ok("ModelStatistics"))),
    **_per_version("/generate", "POST", _op("Generate (one JSON answer)", "inference", _ok("GenerateResponse"),
                                            "GenerateRequest")),
    **_per_version("/generate_stream", "POST", _op("Generate, streamed", "inference", {"200": _SSE},
                                                   "GenerateRequest")),
    ("POST", "/v2/repository/index"): _op("Repository index", "model-repository", _ok("RepositoryIndex"),
                                          "RepositoryIndexRequest", optional_body=True),
    ("POST", R + "/load"): _op("Load or reload a model", "model-repository", _ok(), "LoadRequest",
                               optional_body=True),
    ("POST", R + "/unload"): _op("Unload a model", "model-repository", _ok(), "UnloadRequest", optional_body=True),
    ("POST", R + "/versions/{version}/load"): _op("Load one version", "model-repository", _ok()),
    ("POST", R + "/versions/{version}/unload"): _op("Unload one version", "model-repository", _ok()),
    ("POST", R + "/rollout"): _op("Split unversioned traffic between versions", "model-repository", _ok("Traffic"),
                                  "RolloutRequest", optional_body=True),
    ("POST", R + "/rollback"): _op("Send all traffic back to one version", "model-repository", _ok("Traffic"),
                                   "RolloutRequest", optional_body=True),
    ("GET", R + "/traffic"): _op("Traffic per version", "model-repository", _ok("Traffic")),
    ("POST", "/reset_prefix_cache"): _op("Forget the LLM models' cached prefixes (vLLM's)", "model-repository",
                                         _ok()),
    ("GET", "/v2/logging"): _op("Log settings", "logging", _ok("LogSettings")),
    ("POST", "/v2/logging"): _op("Update log settings", "logging", _ok("LogSettings"), "LogSettings",
                                 optional_body=True),
    ("GET", "/v2/trace/setting"): _op("Trace settings", "trace", _ok("TraceSettings")),
    ("POST", "/v2/trace/setting"): _op("Update trace settings", "trace", _ok("TraceSettings"), "TraceSettings",
                                       optional_body=True),
    ("GET", M + "/trace/setting"): _op("A model's trace settings", "trace", _ok("TraceSettings")),
    ("POST", M + "/trace/setting"): _op("Update a model's trace settings", "trace", _ok("TraceSettings"),
                                        "TraceSettings", optional_body=True),
    ("GET", "/v1/models"): _op("The LLM models (OpenAI)", "openai", _ok("ModelList"), openai=True),
    ("POST", "/v1/completions"): _op("Completions (OpenAI)", "openai", {"200": {
        "description": "The completion, or with `stream` server-sent events",
        "content": {_JSON: {"schema": ref("Completion")}, "text/event-stream": {"schema": STRING}}}},
        "CompletionRequest", openai=True),
    ("POST", "/v1/chat/completions"): _op("Chat completions (OpenAI)", "openai", {"200": {
        "description": "The chat completion, or with `stream` server-sent events",
        "content": {_JSON: {"schema": ref("ChatCompletion")}, "text/event-stream": {"schema": STRING}}}},
        "ChatCompletionRequest", openai=True),
    ("POST", "/v1/embeddings"): _op("Embeddings (OpenAI)", "openai", _ok("Embeddings"), "EmbeddingRequest",
                                    openai=True),
    ("POST", "/v1/load_lora_adapter"): _op("Load a LoRA adapter (vLLM's)", "model-repository", _LORA_OK,
                                           "LoadLoRARequest", openai=True),
    ("POST", "/v1/unload_lora_adapter"): _op("Unload a LoRA adapter (vLLM's)", "model-repository", _LORA_OK,
                                             "UnloadLoRARequest", openai=True),
    ("POST", "/tokenize"): _op("Tokenize (vLLM's)", "openai", _ok("Tokens"), "TokenizeRequest", openai=True),
    ("POST", "/detokenize"): _op("Detokenize (vLLM's)", "openai", _ok("Text"), "DetokenizeRequest", openai=True),
    ("GET", "/health"): _op("Health (vLLM's)", "health", {"200": {"description": "Healthy"}}, openai=True),
    ("GET", "/ping"): _op("Health (SageMaker's ping)", "health", {"200": {"description": "Healthy"}}, openai=True),
    ("POST", "/ping"): _op("Health (SageMaker's ping)", "health", {"200": {"description": "Healthy"}}, openai=True),
    ("GET", "/version"): _op("Server version (vLLM's)", "metadata", _ok("Version"), openai=True),
    ("GET", "/metrics"): _op("Prometheus metrics (also on the metrics port)", "metrics", {"200": _PROMETHEUS}),
    ("GET", "/"): _op("The status page (HTML)", "status", {"200": {"description": "HTML",
                                                                   "content": {"text/html": {"schema": STRING}}}}),
    ("GET", "/api/status"): _op("The status page's data", "status", _ok("Status")),
    ("GET", "/static/status.js"): _op("The status page's script", "status", {"200": {
        "description": "JavaScript", "content": {"text/javascript": {"schema": STRING}}}}),
    ("GET", "/static/status.css"): _op("The status page's style sheet", "status", {"200": {
        "description": "CSS", "content": {"text/css": {"schema": STRING}}}}),
    ("GET", "/docs/{name}"): _op("Swagger UI's files", "api", {"200": {
        "description": "CSS or JavaScript", "content": {"text/css": {"schema": STRING},
                                                        "text/javascript": {"schema": STRING}}}}),
    ("GET", "/openapi.json"): _op("This document", "api", {"200": {
        "description": "OpenAPI 3.0", "content": {_JSON: {"schema": {"type": "object"}}}}}),
    ("GET", "/docs"): _op("Swagger UI for this document (no network needed)", "api", {"200": {
        "description": "HTML", "content": {"text/html": {"schema": STRING}}}}),
}
for _region in ("systemsharedmemory", "cudasharedmemory"):
    _base = f"/v2/{_region}"
    OPERATIONS.update({
        ("GET", _base + "/status"): _op(f"{_region} regions", "shared-memory", _ok("SharedMemoryStatus")),
        ("GET", _base + "/region/{region}/status"): _op(f"One {_region} region", "shared-memory",
                                                        _ok("SharedMemoryStatus")),
        ("POST", _base + "/unregister"): _op(f"Unregister every {_region} region", "shared-memory", _ok()),
        ("POST", _base + "/region/{region}/unregister"): _op(f"Unregister a {_region} region", "shared-memory",
                                                             _ok()),
        ("POST", _base + "/region/{region}/register"): _op(
            f"Register a {_region} region", "shared-memory", _ok(),
            "SharedMemoryRegister" if _region == "systemsharedmemory" else "CudaSharedMemoryRegister"),
    })

_PARAM = re.compile(r"\{(\w+)(?::([^}]*))?\}")


def _template(path: str) -> tuple[str, list[Schema]]:
    """aiohttp's `/v2/models/{model}/versions/{version:[0-9]+}` -> OpenAPI's path and parameters."""
    params: list[Schema] = []
    for name, pattern in _PARAM.findall(path):
        schema: Schema = {"type": "string", "minLength": 1}
        if pattern:
            schema["pattern"] = f"^{pattern}$"
        else:
            schema["pattern"] = "^[^/]+$"
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", path), params


def served_routes(app: web.Application) -> list[tuple[str, str, str]]:
    """(method, OpenAPI path, aiohttp path) of every route the document covers."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        raw = info.get("formatter") or info.get("path")
        if raw is None or route.method == "HEAD" or "{tail" in raw or (raw.endswith("/") and raw != "/"):
            continue
        out.append((route.method, _template(raw)[0], raw))
    return out


def build(app: web.Application) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, raw in served_routes(app):
        op = OPERATIONS.get((method, path))
        if op is None:
            op = _op(f"{method} {path} (undocumented)", "undocumented", {"200": {"description": "OK"}})
        params = _template(raw)[1]
        entry = {**op, "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}".rstrip("_")}
        if params:
            entry["parameters"] = params
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": OPENAPI,
        "info": {"title": "Pier", "version": __version__,
                 "description": "KServe v2 inference (as Triton speaks it), Triton's extensions, the OpenAI "
                                "API and Pier's own routes. Errors are `{\"error\": \"...\"}`, OpenAI's shape "
                                "on the OpenAI routes. With --api-key every route but the health probes and "
                                "/metrics needs `Authorization: Bearer KEY`."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}}},
    }


_SWAGGER = ("swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js")
_TYPES = {".css": "text/css", ".js": "text/javascript"}


def _swagger_file(name: str) -> bytes:
    import swagger_ui_bundle

    return (resources.files(swagger_ui_bundle).joinpath("vendor") / _version_dir() / name).read_bytes()


def _version_dir() -> str:
    import swagger_ui_bundle

    return next(p.name for p in resources.files(swagger_ui_bundle).joinpath("vendor").iterdir()
                if p.name.startswith("swagger-ui-"))


_DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Pier API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script src="/docs/swagger-ui-standalone-preset.js"></script>
<script>window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset], layout: "StandaloneLayout",
  validatorUrl: null});</script>
</body></html>
"""


def add_routes(app: web.Application) -> None:
    """/openapi.json (built once, at the first request: every route is registered by then), /docs
    and Swagger UI's files under /docs/."""
    cache: list[bytes] = []

    async def document(request: web.Request) -> web.Response:
        if not cache:
            cache.append(orjson.dumps(build(request.app)))
        return web.Response(body=cache[0], content_type=_JSON)

    async def docs(request: web.Request) -> web.Response:
        return web.Response(text=_DOCS_PAGE, content_type="text/html")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _SWAGGER:
            raise web.HTTPNotFound()
        return web.Response(body=_swagger_file(name), content_type=_TYPES[name[name.rfind("."):]],
                            headers={"Cache-Control": "max-age=86400"})

    app.router.add_get("/openapi.json", document)
    app.router.add_get("/docs", docs)
    app.router.add_get("/docs/{name:swagger-ui[a-z-]*\\.(?:css|js)}", asset)
