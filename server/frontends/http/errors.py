"""ErrorCode -> HTTP status (Triton's HttpCodeFromError, plus 413 for oversized bodies)."""

from __future__ import annotations

import orjson
from aiohttp import web

from pier.contract.errors import ErrorCode, PierError, printable

_STATUS = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.UNAUTHENTICATED: 401,
}


def http_status(code: ErrorCode) -> int:
    return _STATUS.get(code, 400)


def error_response(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=orjson.dumps({"error": printable(message)}),
                        content_type="application/json")


def internal_error(exc: Exception) -> web.Response:
    """A bug's answer: 500 naming the exception, never a dropped connection."""
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def from_error(exc: PierError) -> web.Response:
    response = error_response(http_status(exc.code), exc.message)
    if exc.retry_after is not None:  # an overloaded model: when to try again
        response.headers["Retry-After"] = str(exc.retry_after)
    return response
