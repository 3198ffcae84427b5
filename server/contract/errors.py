"""Protocol-neutral errors. Frontends map `ErrorCode` to HTTP status / gRPC code at the edge."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Mirrors Triton's core status codes (TRITONSERVER_Error_Code)."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    TOO_LARGE = "TOO_LARGE"
    RATE_LIMITED = "RATE_LIMITED"  # Pier's: a rate limit (HTTP 429, gRPC RESOURCE_EXHAUSTED)
    UNAUTHENTICATED = "UNAUTHENTICATED"  # Pier's: no valid API key (HTTP 401, gRPC UNAUTHENTICATED)


def printable(text: str) -> str:
    """`text` as valid UTF-8: a message that quotes client bytes which are not UTF-8 (kept as
    surrogates by the decoders) shows them as \\udcXX escapes instead of failing to encode on the
    way out (JSON bodies, gRPC status details)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class PierError(Exception):
    """An error with a code the frontends know how to report. The message is user-facing."""

    def __init__(self, code: ErrorCode, message: str, retry_after: int | None = None) -> None:
        message = printable(message)
        super().__init__(message)
        self.code = code
        self.message = message
        # whole seconds after which trying again may succeed (HTTP's Retry-After); None: not said
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"PierError({self.code.name}, {self.message!r})"


def invalid_arg(message: str) -> PierError:
    return PierError(ErrorCode.INVALID_ARG, message)


def not_found(message: str) -> PierError:
    return PierError(ErrorCode.NOT_FOUND, message)


def unavailable(message: str, retry_after: int | None = None) -> PierError:
    return PierError(ErrorCode.UNAVAILABLE, message, retry_after)


def unsupported(message: str) -> PierError:
    return PierError(ErrorCode.UNSUPPORTED, message)


def internal(message: str) -> PierError:
    return PierError(ErrorCode.INTERNAL, message)
