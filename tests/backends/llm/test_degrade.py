"""The KV watermark's settings and decision (backends/llm/degrade.py); the serving behaviour is
tests/e2e/test_llm_degrade.py."""

from __future__ import annotations

import numpy as np
import pytest

from pier.backends.llm import degrade
from pier.contract import llm
from pier.contract.types import InferenceRequest, Tensor


def _request(*flags: str) -> InferenceRequest:
    inputs = [Tensor(llm.TEXT_INPUT, "BYTES", [1], np.array([b"hi"], dtype=object))]
    inputs += [Tensor(f, "BOOL", [1], np.array([True])) for f in flags]
    return InferenceRequest("m", "", inputs, [])


@pytest.mark.parametrize(("params", "message"), [
    ({"kv_cache_degrade_threshold": "1.5"}, "parameter kv_cache_degrade_threshold: '1.5' is not a fraction"),
    ({"kv_cache_degrade_threshold": "ninety"}, "parameter kv_cache_degrade_threshold: 'ninety' is not a fraction"),
    ({"kv_cache_degrade_threshold": "-0.2"}, "is not a fraction of the KV cache in"),
    ({"fallback_model": "spare"}, "parameter fallback_model needs kv_cache_degrade_threshold"),
    ({"kv_cache_degrade_threshold": "0.9", "fallback_model": "m"}, "'m' cannot be its own fallback"),
])
def test_bad_settings_are_refused_naming_the_parameter(params: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        degrade.Watermark(params, "m")


def test_off_by_default_and_at_or_above_the_threshold_when_on() -> None:
    assert degrade.Watermark({}, "m").check(1.0, _request(), 1) is None
    assert degrade.Watermark({"kv_cache_degrade_threshold": "off"}, "m").threshold is None
    mark = degrade.Watermark({"kv_cache_degrade_threshold": "0.9", "fallback_model": "small"}, "m")
    assert mark.check(0.89, _request(), 1) is None
    over = mark.check(0.9, _request(), 2.2)
    assert over is not None and (over.fallback, over.retry_after) == ("small", 3)
    assert "its KV cache is 90% full (kv_cache_degrade_threshold 0.9)" == over.reason
    assert mark.check(0.95, _request(llm.TOKENIZE), 1) is None  # takes no KV
    over.count("fallback")
    assert 'pier_llm_degraded_requests_total{model="m",action="fallback"} 1\n' in mark.render("m")
    assert 'pier_llm_degraded_requests_total{model="m",action="refused"} 0\n' in mark.render("m")


def test_the_server_wide_default_from_backend_config() -> None:
    with pytest.raises(ValueError, match="the llm backend takes only kv_cache_degrade_threshold"):
        degrade.configure({"max_num_seqs": "4"})
    with pytest.raises(ValueError, match="'2' is not a fraction"):
        degrade.configure({"kv_cache_degrade_threshold": "2"})
    try:
        assert degrade.configure({"kv_cache_degrade_threshold": "0.9"}) == ()
        assert degrade.Watermark({}, "m").threshold == 0.9
        assert degrade.Watermark({"kv_cache_degrade_threshold": "0"}, "m").threshold is None  # the model's wins
    finally:
        degrade._DEFAULTS.clear()
