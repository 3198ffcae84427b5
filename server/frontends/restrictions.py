"""tritonserver's `--http-restricted-api` / `--grpc-restricted-protocol`: API categories that answer
only requests carrying a given header (an admin key in front of model control, say).

`CATEGORIES[,CATEGORY...]:KEY=VALUE`, repeatable, each category restricted at most once. Refused
requests get Triton 2.51's answers (probed): HTTP 403 `This API is restricted, expecting header
'KEY'`; gRPC UNAVAILABLE `This protocol is restricted, expecting header 'triton-grpc-protocol-KEY'`
(gRPC clients send the key with that prefix, as Triton expects).

This module parses the rules; each frontend enforces them (frontends/http/middleware.py,
frontends/grpc/restrict.py).
"""

from __future__ import annotations

from collections.abc import Sequence

CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")

Rules = dict[str, tuple[str, str]]  # category -> (header key, expected value)


def parse(specs: Sequence[str], flag: str) -> Rules:
    """The rules of every `flag` value; ValueError names the problem in tritonserver 2.51's words
    (probed; qa tests compare them), with the categories allowed where that helps."""
    kind = "protocol" if "protocol" in flag else "api"
    rules: Rules = {}
    for spec in specs:
        categories, sep, header = spec.partition(":")
        key, eq, value = header.partition("=")
        if not sep or not eq or not key or not value or not categories:
            raise ValueError(f"{flag} option format is '<config name>:<setting>=<value>'. Got {spec} "
                             "(CATEGORY[,CATEGORY...]:KEY=VALUE)")
        for category in categories.split(","):
            if category not in CATEGORIES:
                raise ValueError(f"{flag}: unknown restricted {kind} '{category}' (one of {', '.join(CATEGORIES)})")
            if category in rules:
                raise ValueError(f"{flag}: restricted {kind} '{category}' can not be specified in multiple config "
                                 "groups")
            rules[category] = (key, value)
    return rules
