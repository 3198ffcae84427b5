"""Engine parameters from a config.pbtxt `parameters` map (strings)."""

from __future__ import annotations

import pytest

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine


def test_parameters_parse():
    cfg = EngineConfig.from_parameters({
        "block_size": "8", "kv_cache_memory_bytes": "1048576", "max_num_seqs": "4", "max_num_batched_tokens": "64",
        "enable_prefix_caching": "false", "preemption_mode": "swap", "swap_space_bytes": "2e6", "dtype": "bfloat16",
        "max_model_len": "128", "gpu_memory_utilization": "0.5", "unrelated": "x",
    })
    assert (cfg.block_size, cfg.kv_cache_memory_bytes, cfg.max_num_seqs) == (8, 1 << 20, 4)
    assert cfg.max_num_batched_tokens == 64
    assert not cfg.enable_prefix_caching and cfg.preemption_mode == "swap" and cfg.swap_space_bytes == 2_000_000
    assert cfg.dtype == "bfloat16" and cfg.max_model_len == 128 and cfg.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("params,word", [
    ({"block_size": "big"}, "block_size"), ({"dtype": "int8"}, "dtype"), ({"preemption_mode": "drop"}, "preemption"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"), ({"max_num_seqs": "0"}, "max_num_seqs"),
])
def test_bad_parameters(params, word):
    with pytest.raises(ValueError, match=word):
        EngineConfig.from_parameters(params)


def test_kv_cache_dtype_takes_vllms_values():
    """vLLM's kv_cache_dtype: `auto` (the model's dtype), `fp8` (= E4M3), `fp8_e4m3`, `fp8_e5m2`, any
    case; anything else names the allowed values (the FP8 cache itself: test_kv_fp8.py)."""
    for value in ("AUTO", "fp8", "FP8_E4M3", "fp8_e5m2"):
        assert EngineConfig.from_parameters({"kv_cache_dtype": value}).kv_cache_dtype == value.lower()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        EngineConfig.from_parameters({"kv_cache_dtype": "int4"})


def test_engine_from_parameters_and_limits(llama_dir):
    eng = LLMEngine.from_parameters(llama_dir, {"kv_cache_memory_bytes": str(64 * 2048), "block_size": "4",
                                                "max_model_len": "200", "device": "cpu"})
    assert eng.kv.pool.num_blocks == 64
    assert eng.cache_config_info()["cache_dtype"] == "auto"  # the setting's name, as vLLM's label
    assert eng.max_model_len == 200
    with pytest.raises(ValueError, match="maximum context length is 200"):
        eng.add_request("x", list(range(2, 202)))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("y", [100000])
    eng.add_request("z", "hello there")
    with pytest.raises(ValueError, match="already"):
        eng.add_request("z", "again")
    assert eng.tokenizer.decode(eng._requests["z"][0].prompt_ids) == "hello there"


def test_settings_are_grouped_as_vllm_groups_them(llama_dir):
    from pier.backends.llm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig

    cfg = EngineConfig.from_parameters({"block_size": "8", "max_num_seqs": "4", "dtype": "float32",
                                        "engine_core": "thread", "device": "cpu"})
    assert cfg.cache == CacheConfig(block_size=8) and cfg.scheduler == SchedulerConfig(max_num_seqs=4)
    assert cfg.model == ModelConfig() and cfg.parallel == ParallelConfig(device="cpu", engine_core="thread")
    assert cfg == EngineConfig(cache=CacheConfig(block_size=8), scheduler=SchedulerConfig(max_num_seqs=4),
                               parallel=ParallelConfig(device="cpu", engine_core="thread"))
    with pytest.raises(TypeError, match="unknown engine settings: blocksize"):
        EngineConfig(blocksize=8)
    with pytest.raises(TypeError, match="block_size given both flat and in cache"):
        EngineConfig(cache=CacheConfig(), block_size=8)
    with pytest.raises(AttributeError):
        cfg.block_size = 4  # type: ignore[misc]
    eng = LLMEngine(llama_dir, EngineConfig(kv_cache_memory_bytes=64 * 2048, block_size=4, max_num_seqs=3))
    assert eng.scheduler.config == SchedulerConfig(max_num_seqs=3) and eng.runner.block_size == 4
