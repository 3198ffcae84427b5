"""The building blocks models are composed of (vLLM's `model_executor/layers`, nano-vllm's `layers/`).

`linear.Linear` (a projection that owns its weight; the one place a quantization method or a LoRA
delta hooks in), `norm.RMSNorm`, `activation` (SiLU * up), `rotary.RotaryEmbedding` (with the
scaling kinds real checkpoints use), `attention.Attention` (RoPE, the K/V cache write and paged
attention for one layer), `vocab` (the token embedding and the LM head). Layers that have a compiled
CPU kernel (`kernels.py`) take it through `use_kernels(ops)` and otherwise run plain torch.
Layers are plain objects holding plain tensors (no nn.Module: no autograd, no hooks).
"""
