"""The HTTP app's middlewares: every error becomes the one JSON error shape with Triton's status,
and `--http-restricted-api` (pier/restrictions.py parses the rules) is enforced per API category."""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from pier.contract.errors import PierError
from pier.frontends.guards import ApiKeys, RateLimiter, limited_message, presented_key
from pier.frontends.http.errors import error_response, from_error, internal_error
from pier.frontends.restrictions import Rules

log = logging.getLogger("pier.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ENCODINGS = frozenset({"gzip", "deflate", "identity"})
REQUEST_ID = "X-Request-Id"
_REQUEST_ID_KEY = "pier.request_id"
# A made id: 32 hex digits, as vLLM's uuid4().hex looks, but a random prefix per process and a
# counter (uuid4 reads the OS's random source for every request: 2.4 us against 0.24 us).
_ID_PREFIX, _ID_COUNTER = os.urandom(8).hex(), itertools.count()


def request_id(request: web.Request) -> str:
    """The request's id, as gateways correlate it: its X-Request-Id, else a new one; every answer
    carries it back (gateway_headers) and the OpenAI API names its answer by it."""
    rid: str | None = request.get(_REQUEST_ID_KEY)
    if rid is None:
        rid = request[_REQUEST_ID_KEY] = request.headers.get(REQUEST_ID) or new_request_id()
    return rid


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


LOAD_FORMAT, LOAD_METRICS = "endpoint-load-metrics-format", "endpoint-load-metrics"
MODEL_KEY = "pier.model"  # a handler that reads the model from the body (the OpenAI API) leaves it here


def orca(report: dict[str, float], form: str) -> str | None:
    """An ORCA load report as vLLM writes the header (`form`: text or json; anything else: none)."""
    form = form.strip().lower()
    if form == "text":
        return "TEXT " + ", ".join(f"named_metrics.{k}={float(v)}" for k, v in report.items())
    if form == "json":
        return "JSON " + orjson.dumps({"named_metrics": {k: float(v) for k, v in report.items()}}).decode()
    return None


def gateway_headers(app: web.Application, load: Callable[[str], dict[str, float]] | None) -> None:
    """What inference gateways read on every HTTP answer, streamed and error ones included:
    X-Request-Id (a relayed one keeps the server's), and, when the request asks for it with
    `endpoint-load-metrics-format: text|json` (as vLLM and Triton serve it), the model's load as
    an ORCA `endpoint-load-metrics` header (`load`: the data plane's load_report; None in a
    frontend process, which relays such requests to the server)."""

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        if REQUEST_ID not in response.headers:
            response.headers[REQUEST_ID] = request_id(request)
        form = request.headers.get(LOAD_FORMAT)
        if form is not None and load is not None and LOAD_METRICS not in response.headers:
            model = request.match_info.get("model") or request.get(MODEL_KEY)
            report = load(model) if model else {}
            value = orca(report, form) if report else None
            if value is not None:
                response.headers[LOAD_METRICS] = value

    app.on_response_prepare.append(hook)



@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    encoding = request.headers.get("Content-Encoding")
    if encoding is not None and encoding.strip().lower() not in _ENCODINGS:
        return error_response(501, f"Unsupported compression type '{encoding}': use gzip or deflate")
    if log.isEnabledFor(logging.DEBUG):  # --log-verbose / log_verbose_level > 0, as Triton's request lines
        if REQUEST_ID in request.headers:  # a gateway's id: the line says it, for correlation
            log.debug("HTTP request: %s %s (%s %s)", request.method, request.path, REQUEST_ID, request_id(request))
        else:
            log.debug("HTTP request: %s %s", request.method, request.path)
    try:
        return await handler(request)
    except PierError as exc:
        if log.isEnabledFor(logging.DEBUG):  # as Triton's verbose log of a failed request
            log.debug("%s %s failed (%s %s): %s", request.method, request.path, REQUEST_ID, request_id(request),
                      exc.message)
        return from_error(exc)
    except web.RequestPayloadError as exc:
        return error_response(400, f"failed to read the request body ({encoding or 'identity'} encoding): {exc}")
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"request body is too large ({exc.text})")
    except web.HTTPNotFound:
        return error_response(404, "Not Found")
    except web.HTTPMethodNotAllowed:
        return error_response(405, "Method Not Allowed")
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason)
    except ConnectionResetError:  # the client left mid-answer (a stream): nothing to send, no bug to log
        log.debug("client went away during %s %s", request.method, request.path)
        return web.Response(status=499)  # never sent: aiohttp drops it on the closed transport
    except Exception as exc:  # never let a bug turn into a dropped connection
        log.exception("unhandled error on %s %s (%s %s)", request.method, request.path, REQUEST_ID,
                      request_id(request))
        return internal_error(exc)



def http_category(path: str) -> str | None:
    """The API category of an HTTP path (Triton's grouping; Pier's OpenAI routes count as inference)."""
    if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # vLLM's, restricted as model control
        return "model-repository"
    if path.startswith("/v1/"):
        return "inference"
    if path.startswith("/v2/health/"):
        return "health"
    if path.startswith("/v2/repository/") or path == "/reset_prefix_cache":  # vLLM's, restricted as model control
        return "model-repository"
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if path.startswith("/v2/logging"):
        return "logging"
    tail = path.rstrip("/").rsplit("/", 1)[-1]
    if path.endswith("/trace/setting"):
        return "trace"
    return {"stats": "statistics", "config": "model-config", "ready": "health", "infer": "inference",
            "generate": "inference", "generate_stream": "inference"}.get(tail, "metadata" if path.startswith("/v2")
                                                                               else None)


def restrict_middleware(rules: Rules) -> Callable[..., Awaitable[web.StreamResponse]]:
    """`--http-restricted-api`: a restricted category answers 403 unless the request carries the header."""

    @web.middleware
    async def restrict(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        rule = rules.get(http_category(request.path) or "")
        # Only real routes are restricted: an unknown path stays a 404, as in Triton.
        if rule is not None and request.match_info.http_exception is None and request.headers.get(rule[0]) != rule[1]:
            return error_response(403, f"This API is restricted, expecting header '{rule[0]}'")
        return await handler(request)

    return restrict




_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # probes and scrapes stay open
# What a person opens in a browser: a 401 there asks for Basic credentials (the key as the password),
# which the browser then sends with every request of the page.
_BROWSER_PATHS = ("/", "/api/status", "/static/", "/docs")


def _openai_error(status: int, message: str, kind: str, code: str, headers: dict[str, str]) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


async def _model_of(request: web.Request) -> str:
    """The model an inference request names: in the path (/v2), or the JSON body's "model" (/v1)."""
    model = request.match_info.get("model")
    if model is not None:
        return model
    try:
        doc = orjson.loads(await request.read())  # aiohttp keeps the body for the handler
    except (orjson.JSONDecodeError, web.HTTPException):
        return ""
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else ""


def guard_middleware(keys: ApiKeys, limiter: RateLimiter) -> Callable[[web.Request, Handler],
                                                                      Awaitable[web.StreamResponse]]:
    """--api-key: every path but the health probes needs a key (401, in OpenAI's shape on /v1);
    --rate-limit-model / --rate-limit-key: inference requests over a limit get 429 and Retry-After."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        key = presented_key(request.headers)
        if keys.enabled and not (path.startswith("/v2/health/") or path in _OPEN_PATHS) and not keys.allows(key):
            message = ("Incorrect API key provided." if key is not None else
                       "You didn't provide an API key: send Authorization: Bearer KEY (or an api-key header).")
            browser = path == "/" or path.startswith(_BROWSER_PATHS[1:])
            headers = {"WWW-Authenticate": 'Basic realm="pier", charset="UTF-8"' if browser else "Bearer"}
            if path.startswith("/v1/"):
                return _openai_error(401, message, "invalid_request_error", "invalid_api_key", headers)
            response = error_response(401, message)
            response.headers.update(headers)
            return response
        if limiter.enabled and request.method == "POST" and http_category(path) == "inference":
            model = await _model_of(request)
            refused = limiter.admit(model, key)
            if refused is not None:
                return limited_response(path, model, *refused)
        return await handler(request)

    return guard


def limited_response(path: str, model: str, wait: float, scope: str) -> web.Response:
    """429 for a request a rate limit refused (`scope`: "model" or "key"), with Retry-After."""
    message = limited_message(model, scope, wait)
    headers = {"Retry-After": str(max(1, math.ceil(wait)))}
    if path.startswith("/v1/"):
        return _openai_error(429, message, "requests", "rate_limit_exceeded", headers)
    response = error_response(429, message)
    response.headers.update(headers)
    return response


class _ClientMistakes(logging.Filter):
    """aiohttp logs every malformed request (bad Content-Length, broken chunking or gzip) as an
    ERROR with a traceback: any client could flood the log. The client got its 400; keep these
    as one DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError, ConnectionResetError)):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            text = f"{record.getMessage()}: {exc!r}"  # args=() below: no further %-formatting
            record.msg, record.args, record.exc_info, record.exc_text = text, (), None, None
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def quiet_client_mistakes() -> None:
    logging.getLogger("aiohttp.server").addFilter(_ClientMistakes())
