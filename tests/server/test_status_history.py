"""The status page's history: quantiles of recent requests and of histogram buckets, and the LLM
figures read back from the vllm:* text the LLM backend writes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from pier.frontends.status.history import INTERVAL_S, History, LlmCounters, bucket_quantile, quantile
from pier.observability.statistics import ModelStatistics


def test_history_quantiles() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile(list(map(float, range(1, 101))), 0.99) == 99.0
    assert bucket_quantile([1.0, 2.0], [0, 0, 0], 0.5) is None
    assert bucket_quantile([1.0, 2.0], [0, 4, 0], 0.5) == 1.5  # interpolated inside (1, 2]
    assert bucket_quantile([1.0, 2.0], [0, 0, 3], 0.5) == 2.0  # above the top bound: the bound
    assert np.isclose(bucket_quantile([0.1, 0.2], [10, 10, 0], 0.25), 0.05)


def test_llm_counters_read_the_vllm_families() -> None:
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 40
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 10
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 4
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 3
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.6
vllm:time_to_first_token_seconds_count{model_name="m"} 3
"""
    c = LlmCounters.parse(text)
    assert c is not None
    assert c.gauges == {"num_requests_running": 2.0, "kv_cache_usage_perc": 0.25}
    assert (c.generation_tokens, c.prefix_queries, c.prefix_hits) == (40, 10, 4)
    assert c.histograms["vllm:time_to_first_token_seconds"] == ([0.1, 0.5], [1, 2, 0])
    assert c.quantile(c.zero(), "vllm:time_to_first_token_seconds", 0.5) == 200.0  # rank 1.5 of 3: in (0.1, 0.5]
    assert LlmCounters.parse("# TYPE nv_x counter\nnv_x 1\n") is None


class _Instance:
    def __init__(self) -> None:
        self.tokens = 0

    def prometheus(self, model: str, version: str) -> str:
        return (f'# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{{model_name="{model}"}} '
                f'{self.tokens}\n')


def test_the_first_sample_counts_what_a_new_load_served_before_it() -> None:
    """Requests served between a load and the sampler's next tick are not lost in the baseline."""
    instance = _Instance()
    model = SimpleNamespace(load_id=7, stats=ModelStatistics.create(True), instances=[instance],
                            spec=SimpleNamespace(name="m"), version_str="1")
    history = History(lambda: [model])  # type: ignore[list-item]
    for _ in range(4):
        model.stats.record_request(True, 2_000_000)
    instance.tokens = 40
    now = time.monotonic()
    history.sample(now)
    series, llm = history.series(model)  # type: ignore[arg-type]
    assert series["requests_per_s"] == [2.0] and series["p50_ms"] == [2.0]
    assert series["tokens_per_s"] == [20.0] and llm is not None
    instance.tokens = 50
    history.sample(now + INTERVAL_S)
    series, _ = history.series(model)  # type: ignore[arg-type]
    assert series["requests_per_s"] == [2.0, 0.0] and series["p99_ms"] == [2.0, None]
    assert series["tokens_per_s"] == [20.0, 5.0]
