"""The data plane's guards (server/frontends/guards.py) and the restricted APIs
(server/frontends/restrictions.py) without a server: API keys from flags and files, the key a
request presents, token buckets per model and per key (burst, refill, refunds, a bounded table,
the refusals counted for Prometheus), the flags' errors; the restriction rules in tritonserver's
words and the category of every HTTP path and gRPC method they apply to. (Through a real server,
with the real clients: tests/e2e/test_guards.py, tests/e2e/test_tritonserver_flags.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pier.frontends.grpc.restrict import _GRPC_CATEGORIES
from pier.frontends.guards import (
    ApiKeys,
    Rate,
    RateLimiter,
    limited_message,
    parse_keys,
    parse_model_rates,
    parse_rate,
    presented_key,
)
from pier.frontends.http.middleware import http_category
from pier.frontends.restrictions import CATEGORIES, parse
from pier.protocol import grpc_service_pb2, health_pb2


def test_keys_come_from_flags_and_files(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# one per line\n\n  k3  \nk4\n#k5\n")
    assert parse_keys(["k1", " k2 ", " "], [str(tmp_path / "keys")]) == {"k1", "k2", "k3", "k4"}
    with pytest.raises(ValueError, match="--api-key-file /nonexistent/keys: No such file or directory"):
        parse_keys([], ["/nonexistent/keys"])


def test_the_key_a_request_presents() -> None:
    assert presented_key({"authorization": "Bearer  k1 "}) == "k1"
    assert presented_key({"Authorization": "bearer k1"}) == "k1"  # the scheme is case-insensitive
    assert presented_key({"api-key": "k2"}) == "k2"
    assert presented_key({"authorization": "Basic dXNlcjpwdw==", "api-key": "k3"}) == "k3"
    # A browser's Basic credentials (the status page): the password is the key
    assert presented_key({"authorization": "Basic dXNlcjpwdw=="}) == "pw" and presented_key({}) is None
    assert presented_key({"authorization": "Basic !!"}) is None


def test_only_a_whole_key_is_allowed() -> None:
    keys = ApiKeys(frozenset({"secret-one", "secret-two"}))
    assert keys.enabled and keys.allows("secret-one") and keys.allows("secret-two")
    for wrong in ("secret", "secret-one ", "SECRET-ONE", "", None):
        assert not keys.allows(wrong), wrong
    assert not ApiKeys(frozenset()).enabled


def test_rate_flags() -> None:
    assert parse_rate("10", "--f") == Rate(10, 10) and parse_rate("0.5", "--f") == Rate(0.5, 1)  # burst >= 1
    assert parse_rate("2:5", "--f") == Rate(2, 5)
    for text in ("0", "-1", "nan", "inf", "1:0.5", "fast", "1:x", ""):
        with pytest.raises(ValueError, match="--f: "):
            parse_rate(text, "--f")
    assert parse_model_rates(["5", "simple=2:3"]) == (Rate(5, 5), {"simple": Rate(2, 3)})
    assert parse_model_rates([]) == (None, {})
    with pytest.raises(ValueError, match="a model name is missing before '='"):
        parse_model_rates(["=3"])


def test_buckets_refuse_past_the_burst_and_refill_at_the_rate() -> None:
    limiter = RateLimiter(model_default=Rate(20, 2), per_model={"slow": Rate(0.01, 1)})
    assert limiter.enabled and not RateLimiter().enabled
    assert limiter.admit("m", None) is None and limiter.admit("m", None) is None  # the burst
    refused = limiter.admit("m", None)
    assert refused is not None and refused[1] == "model" and 0 < refused[0] <= 0.05  # one token at 20 a second
    assert limiter.admit("other", None) is None  # each model its own bucket
    time.sleep(refused[0] + 0.01)
    assert limiter.admit("m", None) is None
    two = RateLimiter(model_default=Rate(2, 1))
    assert two.admit("m", None) is None
    time.sleep(0.1)  # a fifth of a token back
    partly = two.admit("m", None)
    assert partly is not None and partly[0] < 0.45  # the time until the rest of the token is there (0.4 s)
    idle = RateLimiter(model_default=Rate(50, 2))
    assert idle.admit("m", None) is None
    time.sleep(0.1)  # five tokens' worth of time
    assert [idle.admit("m", None) is None for _ in range(3)] == [True, True, False]  # never more than the burst
    assert limiter.admit("slow", None) is None  # its own rate
    wait, scope = limiter.admit("slow", None) or (0.0, "")
    assert scope == "model" and 99 < wait <= 100
    assert limited_message("slow", "model", wait) == "rate limit exceeded for model 'slow': retry after 100 s"


def test_a_key_has_its_own_bucket_across_models_and_a_refund_gives_a_token_back() -> None:
    limiter = RateLimiter(per_key=Rate(0.01, 2))
    assert limiter.admit("a", "k1") is None and limiter.admit("b", "k1") is None
    refused = limiter.admit("c", "k1")
    assert refused is not None and refused[1] == "key"
    assert limiter.admit("c", "k2") is None and limiter.admit("c", None) is None  # another key; no key, no bucket
    limiter.refund("c", "k1")  # a frontend process relayed the request: the server admits it again
    assert limiter.admit("c", "k1") is None and limiter.admit("c", "k1") is not None
    for _ in range(5):
        limiter.refund("c", "k2")
    assert [limiter.admit("c", "k2") is None for _ in range(3)] == [True, True, False]  # never past the burst
    assert limiter.refused == {("c", "key"): 3}
    assert limiter.prometheus() == (
        "# HELP pier_rate_limited_requests_total Requests refused by a rate limit (--rate-limit-model, "
        "--rate-limit-key)\n# TYPE pier_rate_limited_requests_total counter\n"
        'pier_rate_limited_requests_total{model="c",scope="key"} 3\n')
    assert RateLimiter(per_key=Rate(1, 1)).prometheus() == ""  # no family until something is refused


def test_the_bucket_table_stays_bounded_whatever_names_clients_send() -> None:
    limiter = RateLimiter(model_default=Rate(1, 1))
    for i in range(100_002):
        limiter.admit(f"made-up-{i}", None)
    assert len(limiter._buckets) < 100_000


@pytest.mark.parametrize("flag", ["--http-restricted-api", "--grpc-restricted-protocol"])
def test_restriction_rules_in_tritonservers_words(flag: str) -> None:
    kind = "protocol" if "grpc" in flag else "api"
    assert parse(["health,metadata:admin-key=s3cret", "model-repository:k=v=w"], flag) == {
        "health": ("admin-key", "s3cret"), "metadata": ("admin-key", "s3cret"), "model-repository": ("k", "v=w")}
    assert parse([], flag) == {}
    for specs, words in ((["model-reposit:k=v"], f"{flag}: unknown restricted {kind} 'model-reposit' (one of "
                                                 f"{', '.join(CATEGORIES)})"),
                         (["health, metadata:k=v"], f"unknown restricted {kind} ' metadata'"),
                         (["inference"], f"{flag} option format is '<config name>:<setting>=<value>'. Got inference"),
                         (["health:k="], "option format is '<config name>:<setting>=<value>'. Got health:k="),
                         ([":k=v"], "Got :k=v"), (["health:=v"], "Got health:=v"),
                         (["inference,inference:k=v"], f"restricted {kind} 'inference' can not be specified in "
                                                       "multiple config groups"),
                         (["health:k=v", "health,metadata:k2=v2"], f"restricted {kind} 'health' can not be "
                                                                   "specified in multiple config groups")):
        with pytest.raises(ValueError) as refused:
            parse(specs, flag)
        assert words in str(refused.value), (specs, str(refused.value))


@pytest.mark.parametrize("path, category", [
    ("/v2/health/live", "health"), ("/v2/health/ready", "health"), ("/v2/models/m/ready", "health"),
    ("/v2/models/m/versions/2/ready", "health"), ("/v2", "metadata"), ("/v2/models/m", "metadata"),
    ("/v2/models/m/versions/2", "metadata"), ("/v2/models/m/config", "model-config"),
    ("/v2/models/m/versions/2/config", "model-config"), ("/v2/models/stats", "statistics"),
    ("/v2/models/m/stats", "statistics"), ("/v2/models/m/infer", "inference"),
    ("/v2/models/m/versions/2/infer", "inference"), ("/v2/models/m/generate", "inference"),
    ("/v2/models/m/generate_stream", "inference"), ("/v1/chat/completions", "inference"),
    ("/v1/models", "inference"), ("/v2/repository/index", "model-repository"),
    ("/v2/repository/models/m/load", "model-repository"), ("/v2/systemsharedmemory/status", "shared-memory"),
    ("/v2/systemsharedmemory/region/r/register", "shared-memory"),
    ("/v2/cudasharedmemory/region/r/unregister", "shared-memory"), ("/v2/logging", "logging"),
    ("/v2/trace/setting", "trace"), ("/v2/models/m/trace/setting", "trace"),
    ("/v2/models/infer/config", "model-config"),  # a model named "infer"
    ("/metrics", None), ("/", None),
])
def test_each_http_path_has_its_category(path: str, category: str | None) -> None:
    assert http_category(path) == category


def test_every_grpc_method_has_its_category() -> None:
    methods = {m.name for s in (grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                                health_pb2.DESCRIPTOR.services_by_name["Health"]) for m in s.methods}
    # a new RPC must be given one (Watch, the health stream, has none)
    assert methods - {"Watch"} == set(_GRPC_CATEGORIES)
    assert set(_GRPC_CATEGORIES.values()) == set(CATEGORIES)
