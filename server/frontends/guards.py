"""The data plane's guards for when no gateway stands in front: API keys and rate limits. Both are
off by default. The frontends apply them (HTTP: frontends/http/middleware.py; gRPC:
frontends/grpc/guard.py); health probes and the metrics port stay open.

- API keys (`--api-key`, `--api-key-file`): a request carries one as `Authorization: Bearer KEY` or
  `api-key: KEY` (HTTP headers, gRPC metadata), or as the password of HTTP Basic credentials
  (`Authorization: Basic`, what a browser sends for the status page); compared in constant time.
- Rate limits: token buckets (`--rate-limit-model=[MODEL=]RATE[:BURST]`, requests per second; a
  default for every model and overrides per model) and one per API key (`--rate-limit-key`). A
  request over a limit is refused at once (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED) and
  counted in `pier_rate_limited_requests_total{model,scope}`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


def parse_keys(keys: Iterable[str], files: Iterable[str]) -> frozenset[str]:
    """The keys given on the command line and in key files (one per line; blank lines and #
    comments skipped). Raises ValueError naming a file that cannot be read."""
    out = {k.strip() for k in keys if k.strip()}
    for name in files:
        try:
            lines = Path(name).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {name}: {exc.strerror or exc}") from None
        out |= {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
    return frozenset(out)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries (`Authorization: Bearer K`, `api-key: K`, or Basic credentials
    whose password is K: a browser's answer to the status page's prompt), if any."""
    auth = headers.get("authorization") or headers.get("Authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get("api-key") or headers.get("Api-Key")
    if key is None and auth and auth[:6].lower() == "basic ":
        try:
            return base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return key


class ApiKeys:
    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, key: str | None) -> bool:
        if key is None:
            return False
        given = key.encode()
        ok = False
        for k in self._keys:  # every comparison runs: the time says nothing about which key
            ok |= hmac.compare_digest(given, k)
        return ok


@dataclass(frozen=True)
class Rate:
    per_second: float
    burst: float


def parse_rate(text: str, flag: str) -> Rate:
    """RATE[:BURST]: requests per second, and how many may come at once (default: max(1, RATE))."""
    rate_text, _, burst_text = text.partition(":")
    try:
        rate = float(rate_text)
        burst = float(burst_text) if burst_text else max(1.0, rate)
    except ValueError:
        raise ValueError(f"{flag}: expected RATE[:BURST] (requests per second), got {text!r}") from None
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(burst) and burst >= 1):
        raise ValueError(f"{flag}: the rate must be > 0 and the burst >= 1, got {text!r}")
    return Rate(rate, burst)


def parse_model_rates(specs: Iterable[str]) -> tuple[Rate | None, dict[str, Rate]]:
    """--rate-limit-model values: [MODEL=]RATE[:BURST]; without MODEL, every model's default."""
    default: Rate | None = None
    per_model: dict[str, Rate] = {}
    for spec in specs:
        name, sep, rate = spec.rpartition("=")
        if sep and not name:
            raise ValueError(f"--rate-limit-model: a model name is missing before '=' in {spec!r}")
        parsed = parse_rate(rate, "--rate-limit-model")
        if name:
            per_model[name] = parsed
        else:
            default = parsed
    return default, per_model


@dataclass
class _Bucket:
    rate: Rate
    tokens: float
    stamp: float

    def take(self, now: float) -> float:
        """0 when a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.rate.burst, self.tokens + (now - self.stamp) * self.rate.per_second)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate.per_second


@dataclass
class RateLimiter:
    model_default: Rate | None = None
    per_model: dict[str, Rate] = field(default_factory=dict)
    per_key: Rate | None = None
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    refused: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, scope) -> requests refused

    @property
    def enabled(self) -> bool:
        return self.model_default is not None or bool(self.per_model) or self.per_key is not None

    def admit(self, model: str, key: str | None) -> tuple[float, str] | None:
        """None when the request may run; else (seconds until it could, the limit's scope)."""
        now = time.monotonic()
        with self._lock:
            checks = []
            rate = self.per_model.get(model, self.model_default)
            if rate is not None:
                checks.append((("model", model), rate, "model"))
            if self.per_key is not None and key is not None:
                checks.append((("key", key), self.per_key, "key"))
            for bucket_key, rate, scope in checks:
                bucket = self._buckets.get(bucket_key)
                if bucket is None:
                    if len(self._buckets) > 100_000:  # keys and model names come from clients: stay bounded
                        self._buckets.clear()
                    bucket = self._buckets[bucket_key] = _Bucket(rate, rate.burst, now)
                wait = bucket.take(now)
                if wait:
                    self.refused[(model, scope)] = self.refused.get((model, scope), 0) + 1
                    return wait, scope
        return None

    def refund(self, model: str, key: str | None) -> None:
        """Give back what `admit` took for a request that will be admitted again elsewhere (a
        frontend process relays it whole to the server, whose own check counts it)."""
        with self._lock:
            for bucket_key in [("model", model)] + ([("key", key)] if key is not None else []):
                bucket = self._buckets.get(bucket_key)
                if bucket is not None:
                    bucket.tokens = min(bucket.rate.burst, bucket.tokens + 1)

    def prometheus(self) -> str:
        from pier.contract.prometheus import family

        rows = [f'pier_rate_limited_requests_total{{model="{m}",scope="{s}"}} {n}\n'
                for (m, s), n in sorted(self.refused.items())]
        return family("pier_rate_limited_requests_total", "counter",
                      "Requests refused by a rate limit (--rate-limit-model, --rate-limit-key)", rows) if rows else ""


def limited_message(model: str, scope: str, wait: float) -> str:
    what = f"model '{model}'" if scope == "model" else "this API key"
    return f"rate limit exceeded for {what}: retry after {math.ceil(wait)} s"
