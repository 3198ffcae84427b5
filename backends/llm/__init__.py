"""The LLM engine: paged KV cache, continuous batching, prefix caching, sampling (see docs/llm.md).

Public API (what the server's llm backend uses):

    from pier.backends.llm.engine import LLMEngine, RequestOutput, EngineStats
    from pier.backends.llm.async_engine import AsyncLLMEngine
    from pier.backends.llm.sampling_params import SamplingParams
    from pier.backends.llm.config import EngineConfig

    engine = AsyncLLMEngine.from_parameters(model_dir, {"block_size": "16", ...})
    async for out in engine.generate("prompt" or [token ids], SamplingParams.from_json({...}), "req-1"):
        out.text, out.token_ids, out.finished, out.finish_reason ...
    engine.stats()          # gauges/counters for metrics
    engine.tokenizer.apply_chat_template(messages)
    engine.shutdown()

Module map: config (parameters), models/ (registry: config.json → a model file composed of layers/), kv_cache
(block pool + per-sequence tables), scheduler (+ scheduler_output: the per-step plain data),
model_runner + attention (paged attention), sampler, tokenizer (detokenization, chat template),
engine (sync step loop), async_engine (step thread + async streaming).
"""
