"""Logging as tritonserver configures it: --log-info / --log-warning / --log-error switch each
severity on or off, --log-verbose > 0 adds verbose (DEBUG) lines, --log-format is `default` or
`ISO8601`, --log-file sends the log to a file. The logging extension (GET/POST /v2/logging,
gRPC LogSettings) reads and changes the same settings at run time, except the file, which
Triton refuses to move over the network too. Logging is process-wide, so these settings are."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pier.contract.errors import ErrorCode, PierError, invalid_arg

FORMATS = ("default", "ISO8601")
# tritonserver escapes each message as a JSON string (so a client cannot forge log records with
# newlines in, say, an input name); TRITON_SERVER_ESCAPE_LOG_MESSAGES=0 turns that off, as there.
ESCAPE_VARIABLE = "TRITON_SERVER_ESCAPE_LOG_MESSAGES"


class TritonFormatter(logging.Formatter):
    """tritonserver's log records: `default` is glog's `I1202 00:18:39.425123 <pid> <file>:<line>]
    <message>` (local time), `ISO8601` is `2026-12-02T00:18:39Z I <pid> <file>:<line>] <message>`
    (UTC). Verbose lines are `I` lines, as Triton's LOG_VERBOSE. A message that starts with a
    newline is a table (the startup model table): it follows on its own lines, unescaped, as there."""

    _LETTERS = {logging.ERROR: "E", logging.WARNING: "W"}

    def __init__(self, iso: bool, escape: bool) -> None:
        super().__init__()
        self.iso, self.escape = iso, escape

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        if record.stack_info:
            message = f"{message}\n{self.formatStack(record.stack_info)}"
        if not message.startswith("\n") and self.escape:
            message = json.dumps(message, ensure_ascii=False)
        level = "E" if record.levelno >= logging.ERROR else self._LETTERS.get(record.levelno, "I")
        where = f"{record.process} {record.filename}:{record.lineno}]"
        if self.iso:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            return f"{stamp} {level} {where} {message}"
        local = time.localtime(record.created)
        micros = int((record.created % 1) * 1_000_000)
        return f"{level}{time.strftime('%m%d %H:%M:%S', local)}.{micros:06d} {where} {message}"


@dataclass
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def as_dict(self) -> dict[str, Any]:
        return {"log_file": self.log_file, "log_info": self.log_info, "log_warning": self.log_warning,
                "log_error": self.log_error, "log_verbose_level": self.log_verbose_level,
                "log_format": self.log_format}

    def allows(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self.log_error
        if level >= logging.WARNING:
            return self.log_warning
        if level >= logging.INFO:
            return self.log_info
        return self.log_verbose_level > 0


class _Switches(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _current.allows(record)


_current = LogSettings()
_handler: logging.Handler | None = None
_listeners: list[Callable[[dict[str, Any]], None]] = []


def on_change(listener: Callable[[dict[str, Any]], None]) -> None:
    """Call `listener(settings)` after each update (the frontend processes follow the server's)."""
    _listeners.append(listener)


def current() -> LogSettings:
    return _current


def install(settings: LogSettings) -> None:
    """Route the root logger through one handler that applies `settings` (called once at startup)."""
    global _current, _handler
    if settings.log_format not in FORMATS:
        raise ValueError(f"invalid argument for --log-format, got: {settings.log_format}")
    _current = settings
    handler: logging.Handler = (logging.FileHandler(settings.log_file) if settings.log_file
                                else logging.StreamHandler(sys.stderr))
    handler.addFilter(_Switches())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    _handler = handler
    _apply()


def _apply() -> None:
    logging.getLogger().setLevel(logging.DEBUG if _current.log_verbose_level > 0 else logging.INFO)
    if _handler is not None:
        escape = os.environ.get(ESCAPE_VARIABLE, "1").strip() != "0"
        _handler.setFormatter(TritonFormatter(_current.log_format == "ISO8601", escape))


def update(changes: dict[str, Any]) -> dict[str, Any]:
    """Apply a logging-extension update (all keys checked before any applies); return every setting.
    Unknown keys and null values are ignored, as Triton does."""
    new = LogSettings(**_current.as_dict())
    for key, value in changes.items():
        if value is None:
            continue
        if key == "log_file":
            raise PierError(ErrorCode.UNSUPPORTED, "log file location can not be updated through network protocol")
        if key in ("log_info", "log_warning", "log_error"):
            if not isinstance(value, bool):
                raise invalid_arg(f"invalid value type for '{key}': expected a boolean, got {value!r}")
        elif key == "log_verbose_level":
            if type(value) is not int or not 0 <= value <= 0xFFFFFFFF:  # gRPC carries it as uint32
                raise invalid_arg(f"invalid value for 'log_verbose_level': expected an integer from 0 to "
                                  f"4294967295, got {value!r}")
        elif key == "log_format":
            if value not in FORMATS:
                raise invalid_arg(f"invalid argument for log_format, got: {value}")
        else:
            continue
        setattr(new, key, value)
    _current.__dict__.update(new.__dict__)
    _apply()
    for listener in _listeners:
        listener(_current.as_dict())
    return _current.as_dict()
