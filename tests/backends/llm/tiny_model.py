"""Build random-weight tiny models in Hugging Face format (transformers is a test-time reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps keys and values in fixed-size blocks.",
    "Continuous batching admits new requests at every step.",
    "Héllo wörld, ünïcode ☃ snowman and 日本語 text 🙂 emoji.",
    "Prefix caching reuses blocks of a shared system prompt.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer (every byte is a token, so any text encodes) with <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def build_model(folder: Path, arch: str = "llama", seed: int = 0, shard_size: str | None = None,
                random_norms: bool = False, **overrides: object) -> Path:
    """Save a random tiny model + tokenizer to `folder` and return it (`shard_size`: save it in
    shards of at most that size, e.g. "100KB", with model.safetensors.index.json; `random_norms`:
    norm weights drawn too, since transformers starts them all equal, which would hide a norm
    weight in the wrong layout)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    common.update(overrides)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    # Larger-than-default weights: sharper logits, so float rounding cannot flip a greedy argmax.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif random_norms and "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


# name -> (build_model arch, its settings): small windows so that the prompts pass them
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {"head_dim": 32, "random_norms": True}),
    "gemma2": ("gemma2", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                          "tie_word_embeddings": True, "random_norms": True}),
    "gemma3": ("gemma3_text", {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
                               "tie_word_embeddings": True, "random_norms": True,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 8, "pad_token_id": 0}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                "mlp_only_layers": [1], "norm_topk_prob": True}),
}


def truncated_copy(src: Path, dst: Path, num_layers: int) -> Path:
    """`src`'s first `num_layers` decoder layers (its embedding, final norm, LM head and tokenizer
    as they are) saved to `dst`: a draft model for speculative decoding that shares the tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    keep = {k: v.contiguous() for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def build_adapter(base: Path, folder: Path, seed: int, r: int = 8, alpha: float = 16,
                  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"), **config: object) -> Path:
    """A PEFT LoRA adapter of the model in `base`, saved to `folder`, with random A and B (B non-zero:
    a zero B, PEFT's default, would change nothing and prove nothing). `config`: more LoraConfig fields."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      init_lora_weights=False, **config))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    lora.save_pretrained(folder)
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """PEFT's PeftModel + transformers greedy generate (the base model alone for adapter None)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def engine_prompt_logprobs(eng: Any, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob after the tokens before it (from the second token on), from a
    Pier engine (`prompt_logprobs`, one decode step each)."""
    from pier.backends.llm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"plp{i}", prompt, params)
    got: dict[str, list[float]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = [lp for _, lp, _ in out.prompt_logprobs[1:]]
    return [got[f"plp{i}"] for i in range(len(prompts))]
