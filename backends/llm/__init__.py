"""The LLM engine: paged KV cache, continuous batching, sampling (see ARCHITECTURE.md)."""
