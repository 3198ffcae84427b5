"""aiohttp application for KServe v2 + Triton extensions. Handlers only translate: wire ->
DataPlane -> wire. Unknown paths answer 404 {"error":"Not Found"}, wrong verbs 405."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from pier.contract import llm
from pier.contract.errors import ErrorCode, PierError, invalid_arg
from pier.contract.types import InferenceRequest, InferenceResponse
from pier.control.plane import ControlPlane
from pier.dataplane import shared_memory
from pier.dataplane.plane import DataPlane, InferencePlane
from pier.frontends import restrictions
from pier.frontends.apidoc import document as apidoc
from pier.frontends.guards import ApiKeys, RateLimiter
from pier.frontends.http import codec, fastpath, generate, openai
from pier.frontends.http.errors import error_response
from pier.frontends.http.infer import InferHandler, web_reply
from pier.frontends.http.middleware import error_middleware, gateway_headers, guard_middleware, restrict_middleware
from pier.frontends.status.page import StatusPage
from pier.lifecycle.loaded_model import LoadedModel
from pier.observability import log_settings
from pier.tensors.validation import HeaderPattern, forward_headers
from pier.tensors.validation import header_pattern as compile_pattern

log = logging.getLogger("pier.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(doc: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=headers)


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


def _fallback(asked: LoadedModel, answer: InferenceResponse | PierError) -> dict[str, str]:
    """x-pier-fallback-from when an overloaded model's fallback answered (dataplane/degrade.py)."""
    if isinstance(answer, PierError) or answer.model_name == asked.spec.name:
        return {}
    return {llm.FALLBACK_FROM_HEADER: asked.spec.name}


def _version(request: web.Request) -> str:
    return request.match_info.get("version", "")


class HttpHandlers:
    def __init__(self, plane: DataPlane, control: ControlPlane, max_json_size: int,
                 header_pattern: HeaderPattern | None = None) -> None:
        self.plane = plane
        self.control = control
        self.max_json_size = max_json_size
        self.header_pattern = header_pattern  # --http-header-forward-pattern
        self.inference = InferHandler(plane, max_json_size, header_pattern)

    # Health answers as Triton 2.51's (probed): text/plain, empty when ready.
    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.plane.live() else 400, content_type="text/plain")

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.plane.ready() else 400, content_type="text/plain")

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(self.plane.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.Response:
        return _json(self.plane.model_metadata(request.match_info["model"], _version(request)))

    async def model_ready(self, request: web.Request) -> web.Response:
        # Real Triton 2.51 answers an unknown or unready model with 400 and this body (probed).
        try:
            ok = self.plane.model_ready(request.match_info["model"], _version(request))
        except PierError:
            ok = False
        if ok:
            return web.Response(status=200, content_type="text/plain")
        known = self.control.version_state(request.match_info["model"], _version(request))
        if known is None:
            return web.Response(status=400, content_type="text/plain", text='{"error":"Model version not ready"}')
        # A version Pier knows: its state and reason too (LOADING, "loading weights: 7/12 shards, ...").
        doc = {"error": "Model version not ready", "state": known[0], "reason": known[1]}
        return web.Response(status=400, content_type="text/plain", body=orjson.dumps(doc))

    async def model_config(self, request: web.Request) -> web.Response:
        return _json(self.plane.model_config_json(request.match_info["model"], _version(request)))

    async def model_stats(self, request: web.Request) -> web.Response:
        name = request.match_info.get("model", "")
        return _json({"model_stats": self.plane.statistics(name, _version(request))})

    async def _body(self, request: web.Request, what: str) -> dict:
        body = await codec.read_body(request, self.max_json_size, json_only=True)
        if not body.strip():
            return {}
        doc = codec.parse_json(body)
        if not isinstance(doc, dict):
            raise PierError(ErrorCode.INVALID_ARG, f"the {what} request must be a JSON object")
        return doc

    async def _parameters(self, request: web.Request, what: str) -> dict:
        params = (await self._body(request, what)).get("parameters", {})
        if not isinstance(params, dict):
            raise PierError(ErrorCode.INVALID_ARG, f"the {what} request's 'parameters' must be a JSON object")
        return params

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: 200 (empty) when every model forgot its cached
        prefixes, 409 while requests hold them (vLLM's newer answer). A model category route:
        restricted and keyed like the repository API."""
        if request.query.get("reset_running_requests", "false").lower() not in ("false", "0"):
            raise invalid_arg("reset_running_requests=true is not supported: retry when no request is running")
        if not await self.plane.reset_prefix_cache():
            return error_response(409, "Prefix cache reset failed: requests are running (retry when idle)")
        return web.Response(status=200)

    async def repository_index(self, request: web.Request) -> web.Response:
        doc = await self._body(request, "index")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):  # Triton answers 500; it is the client's mistake
            raise invalid_arg(f"repository index: 'ready' must be a boolean, got {orjson.dumps(ready).decode()}")
        return _json(await self.control.index(ready))

    async def repository_load(self, request: web.Request) -> web.Response:
        params = await self._parameters(request, "load")
        for key, value in params.items():
            if key.startswith("file:"):
                params[key] = codec.decode_base64(value, f"load parameter '{key}'")
        await self.control.load(request.match_info["model"], params)
        return _empty(200)

    async def repository_unload(self, request: web.Request) -> web.Response:
        await self.control.unload(request.match_info["model"], await self._parameters(request, "unload"))
        return _empty(200)

    async def version_load(self, request: web.Request) -> web.Response:
        await self.control.load_version(request.match_info["model"], _version(request))
        return _empty(200)

    async def version_unload(self, request: web.Request) -> web.Response:
        await self.control.unload_version(request.match_info["model"], _version(request))
        return _empty(200)

    async def rollout(self, request: web.Request) -> web.Response:
        doc = await self._body(request, "rollout")
        version = doc.get("version")
        return _json(self.control.rollout(request.match_info["model"], doc.get("weights"),
                                          None if version is None else str(version)))

    async def rollback(self, request: web.Request) -> web.Response:
        version = (await self._body(request, "rollback")).get("version")
        return _json(self.control.rollback(request.match_info["model"], None if version is None else str(version)))

    async def traffic(self, request: web.Request) -> web.Response:
        return _json(self.control.traffic(request.match_info["model"]))

    async def _generate_request(self, request: web.Request) -> tuple[InferenceRequest, LoadedModel]:
        """The request and the one version that decodes and runs it."""
        name, version = request.match_info["model"], _version(request)
        raw = await codec.read_body(request, self.max_json_size, json_only=True)
        doc = codec.parse_json(raw) if raw.strip() else {}
        model = self.plane.resolve(name, version)
        metadata = self.plane.describe(model, all_versions=not version)
        if isinstance(doc, dict):
            generate.check_duplicate_inputs(raw, metadata)
        generated = generate.decode(name, version, doc, metadata, model.spec.max_batch_size > 0)
        forward_headers(self.header_pattern, request.headers.items(), generated.parameters)
        return generated, model

    async def generate(self, request: web.Request) -> web.Response:
        """One JSON answer. As in Triton, the model must produce exactly one response (a decoupled
        model's flag-only final does not count); a second one cancels the request."""
        answer = None
        generated, model = await self._generate_request(request)
        stream = self.plane.responses(generated, model)
        try:
            async for item in stream:
                if answer is not None:
                    raise invalid_arg("generate expects model to produce exactly 1 response, this model sent "
                                      "more: use generate_stream (or ask the model for a single response, e.g. "
                                      "\"stream\": false)")
                answer = item
        finally:
            await stream.aclose()  # cancels the request if it is still producing
        if answer is None:
            raise invalid_arg("generate expects model to produce exactly 1 response, this model sent none")
        return _json(generate.encode(answer), _fallback(model, answer))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one `data: {json}` per response; a refused request is an ordinary
        JSON error, a model's error `data: {"error": ...}` (as the first response: status 400)."""
        generated, model = await self._generate_request(request)
        stream = self.plane.infer_stream(generated, model)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            raise PierError(ErrorCode.INTERNAL, "the model sent no response") from None
        # As Triton: a request refused before it runs is a plain JSON error (raised above); a model
        # whose first response is an error answers 400 with that error as the stream's one event.
        reply = web.StreamResponse(status=400 if isinstance(first, PierError) else 200,
                                   headers={"Content-Type": "text/event-stream; charset=utf-8",
                                            "Cache-Control": "no-cache", **_fallback(model, first)})
        await reply.prepare(request)
        try:
            item: InferenceResponse | PierError = first
            while True:
                if isinstance(item, PierError):
                    doc: dict = {"error": item.message}
                elif not item.outputs:
                    doc = {}
                else:
                    doc = generate.encode(item)
                if doc:
                    await reply.write(b"data: " + orjson.dumps(doc) + b"\n\n")
                if reply.status != 200:
                    break
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    break
        finally:
            await stream.aclose()  # also when the client went away: that cancels the request
        await reply.write_eof()
        return reply

    async def shm_status(self, request: web.Request) -> web.Response:
        return _json(self.plane.shared_memory.status(request.match_info.get("region", "")))

    async def shm_register(self, request: web.Request) -> web.Response:
        doc = await self._body(request, "shared memory register")
        fields = []
        for key in ("key", "offset", "byte_size"):
            if key not in doc and key != "offset":  # as Triton: the offset defaults to 0
                raise invalid_arg(f"Shared memory register request has no '{key}' field")
            value = doc.get(key, 0)
            ok = isinstance(value, str) if key == "key" else type(value) is int and value >= 0
            if not ok:
                raise invalid_arg(f"Shared memory register request's '{key}' must be "
                                  + ("a string" if key == "key" else "a non-negative integer"))
            fields.append(value)
        self.plane.shared_memory.register(request.match_info["region"], *fields)
        return _empty(200)

    async def shm_unregister(self, request: web.Request) -> web.Response:
        self.plane.shared_memory.unregister(request.match_info.get("region", ""))
        return _empty(200)

    async def cuda_shm_status(self, request: web.Request) -> web.Response:
        return _json(shared_memory.cuda_status(request.match_info.get("region", "")))

    async def cuda_shm_register(self, request: web.Request) -> web.Response:
        await self._body(request, "cuda shared memory register")
        shared_memory.cuda_register(request.match_info["region"])
        return _empty(200)

    async def cuda_shm_unregister(self, request: web.Request) -> web.Response:
        return _empty(200)

    async def logging_get(self, request: web.Request) -> web.Response:
        return _json(log_settings.current().as_dict())

    async def logging_update(self, request: web.Request) -> web.Response:
        return _json(log_settings.update(await self._body(request, "log settings")))

    async def trace_get(self, request: web.Request) -> web.Response:
        return _json(self.plane.trace_settings(request.match_info.get("model", "")))

    async def trace_update(self, request: web.Request) -> web.Response:
        model = request.match_info.get("model", "")
        self.plane.trace_settings(model)  # an unknown model fails before the body is read
        return _json(self.plane.trace_settings(model, await self._body(request, "trace setting")))

    async def not_yet(self, request: web.Request) -> web.Response:
        raise PierError(ErrorCode.UNSUPPORTED, f"{request.path} is not implemented by this server yet")

    async def infer(self, request: web.Request) -> web.Response:
        received = self.inference.received()
        body, json_length = await self.inference.read(request)
        infer_request, resolved = self.decode_infer(request.match_info["model"], _version(request), body, json_length)
        return await self.inference.answer(request.headers, infer_request, received, resolved,
                                           web_reply(request.headers))

    def decode_infer(self, model: str, version: str, body: bytes,
                     json_length: int | None) -> tuple[InferenceRequest, LoadedModel | None]:
        """The request an infer body makes, and the version it runs on when decoding needed it
        (the JSON and binary paths decode without the model: the plane resolves it)."""
        if json_length == 0:  # a raw binary body: decoded against the signature of the version it runs on
            resolved = self.plane.resolve(model, version)
            return codec.decode_raw_request(model, version, self.plane.describe(resolved, not version),
                                            resolved.spec.max_batch_size > 0, body), resolved
        return codec.decode_request(model, version, body, json_length, self.plane.shared_memory), None


# Whole-body cap: binary tensor data is not bounded by --http-max-input-size (as in Triton), but
# the server still refuses a body no tensor could need rather than buffer it.
MAX_BODY_BYTES = (1 << 31) - 1


def close_when_exiting(app: web.Application, plane: InferencePlane) -> None:
    """While the server drains (SIGTERM) requests are still served, as in Triton, each with
    `Connection: close`: a client on a kept-alive connection reconnects, and a load balancer
    sends the new connection to a pod that is staying (readiness is 503 here)."""

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        if plane.exiting:
            response.force_close()  # the headers are computed by now: say so too
            response.headers["Connection"] = "close"

    app.on_response_prepare.append(hook)


def build_app(plane: DataPlane, control: ControlPlane, max_input_size: int,
              restricted: restrictions.Rules | None = None,
              metrics: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None,
              header_pattern: str = "", guards: tuple[ApiKeys, RateLimiter] | None = None,
              status_page: StatusPage | None = None) -> web.Application:
    """The HTTP endpoint; `restricted`: API categories that need a header (--http-restricted-api);
    `metrics`: the metrics port's handler, also served here at /metrics as vLLM's server does (so
    scrape jobs written for vLLM work); `status_page`: the status page, at / and /api/status."""
    middlewares = [error_middleware] + ([restrict_middleware(restricted)] if restricted else [])
    guarded = guards is not None and (guards[0].enabled or guards[1].enabled)
    if guards is not None and guarded:
        middlewares.append(guard_middleware(*guards))
    app = web.Application(middlewares=middlewares, client_max_size=max(max_input_size, MAX_BODY_BYTES))
    close_when_exiting(app, plane)
    gateway_headers(app, plane.load_report)
    h = HttpHandlers(plane, control, max_input_size, compile_pattern(header_pattern))
    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version:[0-9]+}"
    r = app.router
    # Infer first: the router tries the resources under one path prefix in registration order,
    # and these paths overlap no other route (so the order changes no answer, only the work).
    for base in (model, versioned):
        r.add_post(base + "/infer", h.infer)
    r.add_get("/v2/health/live", h.live)
    r.add_get("/v2/health/ready", h.ready)
    r.add_get("/v2", h.server_metadata)
    r.add_get("/v2/models/stats", h.model_stats)
    for base in (model, versioned):
        r.add_get(base, h.model_metadata)
        r.add_get(base + "/ready", h.model_ready)
        r.add_get(base + "/config", h.model_config)
        r.add_get(base + "/stats", h.model_stats)
        r.add_post(base + "/generate", h.generate)
        r.add_post(base + "/generate_stream", h.generate_stream)
    r.add_post("/v2/repository/index", h.repository_index)
    r.add_post("/reset_prefix_cache", h.reset_prefix_cache)
    # CUDA regions cannot be registered: empty status, no-op unregister, register refused.
    for base, status, unregister in (("/v2/systemsharedmemory", h.shm_status, h.shm_unregister),
                                     ("/v2/cudasharedmemory", h.cuda_shm_status, h.cuda_shm_unregister)):
        r.add_get(base + "/status", status)
        r.add_get(base + "/region/{region}/status", status)
        r.add_post(base + "/unregister", unregister)
        r.add_post(base + "/region/{region}/unregister", unregister)
    r.add_post("/v2/systemsharedmemory/region/{region}/register", h.shm_register)
    r.add_post("/v2/cudasharedmemory/region/{region}/register", h.cuda_shm_register)
    # Other CUDA paths: not implemented. The routes above with another verb stay 405 (schemathesis
    # found GET .../unregister answered 501, a server error, by this catch-all).
    r.add_route("*", "/v2/cudasharedmemory/{tail:(?!(?:region/[^/]+/)?(?:status|unregister|register)$).*}",
                h.not_yet)
    r.add_get("/v2/logging", h.logging_get)
    r.add_post("/v2/logging", h.logging_update)
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        r.add_get(path, h.trace_get)
        r.add_post(path, h.trace_update)
    if not guarded and "inference" not in (restricted or {}):  # the fast path has no middleware
        fastpath.install(app, h)  # served below aiohttp where it can (fastpath.InferSite)
    openai.add_routes(app, plane, max_input_size)
    if metrics is not None:
        r.add_get("/metrics", metrics)
    if status_page is not None:
        status_page.add_routes(app, restricted or {})
    repo_model = "/v2/repository/models/{model}"
    r.add_post(repo_model + "/load", h.repository_load)
    r.add_post(repo_model + "/unload", h.repository_unload)
    r.add_post(repo_model + "/versions/{version:[0-9]+}/load", h.version_load)
    r.add_post(repo_model + "/versions/{version:[0-9]+}/unload", h.version_unload)
    r.add_post(repo_model + "/rollout", h.rollout)
    r.add_post(repo_model + "/rollback", h.rollback)
    r.add_get(repo_model + "/traffic", h.traffic)
    # Named repositories (Triton's /v2/repository/{repo}/...): one namespace here, as Triton's HTTP.
    r.add_route("*", "/v2/repository/{repo}/models/{tail:.*}", h.not_yet)
    apidoc.add_routes(app)  # /openapi.json, /docs: last, so that it documents every route above
    return app
