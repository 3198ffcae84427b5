"""Tiny random Llama (and Qwen2, Qwen3) models written as GGUF files with gguf-py's `GGUFWriter`, every
projection in one GGML type: quantized with gguf-py's own `gguf.quants.quantize` where it can (F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1), and for the K-quants (which gguf-py only de-quantizes) blocks of random bytes in
their layout, with sane float16 scales so that no weight is inf or NaN."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320  # K-quants need widths of 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE's base vocabulary)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """K-quant blocks of random bytes, their float16 d (and dmin) set to small positive values."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)

    def half(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)

    if kind == "Q6_K":
        blocks[:, 208:210] = half(1e-5, 3e-5)
    elif kind in ("Q4_K", "Q5_K"):  # d, dmin first
        top = 3e-4 if kind == "Q4_K" else 1.5e-4
        blocks[:, 0:2], blocks[:, 2:4] = half(top / 3, top), half(1e-4, 4e-4)
    return blocks.reshape(rows, cols // block * nbytes)


def _tensor(writer: object, name: str, w: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, w.astype(np.float32))  # type: ignore[attr-defined]
    elif kind == "F16":
        writer.add_tensor(name, w.astype(np.float16))  # type: ignore[attr-defined]
    elif kind.endswith("_K"):
        writer.add_tensor(name, _random_blocks(kind, *w.shape, rng), raw_dtype=qtype)  # type: ignore[attr-defined]
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)  # type: ignore[attr-defined]


def write_gguf(path: Path, kind: str, seed: int = 0, embedding: str = "F32", types: dict[str, str] | None = None,
               arch: str = "llama", pre: str = "default", merges: tuple[str, ...] = (),
               rope_freqs: np.ndarray | None = None, sentencepiece: tuple[str, ...] = ()) -> Path:
    """A 2-layer Llama (hidden 256) as one GGUF file at `path`, every projection in `kind` (or the type
    `types` gives its GGUF name), the token embedding in `embedding` (tied LM head), norms in F32; a
    byte-level BPE tokenizer (gpt2, pre-tokenizer `pre`; the byte alphabet, then one token per merge
    of `merges`) and a chat template in its metadata. `arch` "qwen2" adds q/k/v biases; "phi3" fuses
    q/k/v and gate/up; "qwen3" a norm
    over each head of q and of k and 2 heads of 128 (transformers reads no head size from a GGUF file
    and takes Qwen3's 128); `rope_freqs`: llama.cpp's per-frequency RoPE divisors (Llama 3.1's scaling).
    `sentencepiece`: a SentencePiece vocabulary instead (tokenizer "llama", as Llama 2's and Mistral's
    files: <unk> <s> </s>, the 256 byte tokens, then these pieces, best score first, and no merges)."""
    import gguf

    rng = np.random.default_rng(seed)
    heads, kv_heads = (2, 1) if arch == "qwen3" else (HEADS, KV_HEADS)
    head = HIDDEN // heads
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    if sentencepiece:
        tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *sentencepiece]
        kinds = [2, 3, 3] + [6] * 256 + [1] * len(sentencepiece)
        scores = [0.0] * 259 + [-float(i) for i in range(len(sentencepiece))]
        tokens += [f"<t{i}>" for i in range(VOCAB - len(tokens))]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(kinds + [1] * (len(tokens) - len(kinds)))
        w.add_token_scores(scores + [-1000.0] * (len(tokens) - len(scores)))
        w.add_unk_token_id(0)
    else:
        tokens = SPECIALS + _byte_chars() + ["".join(m.split(" ")) for m in merges]
        tokens += [f"<t{i}>" for i in range(VOCAB - len(tokens))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        w.add_token_merges(list(merges))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    def normal(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    _tensor(w, "token_embd.weight", normal(VOCAB, HIDDEN, scale=0.5), embedding, rng)
    w.add_tensor("output_norm.weight", 1 + normal(HIDDEN, scale=0.2))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + normal(HIDDEN, scale=0.2))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + normal(HIDDEN, scale=0.2))
        projections = (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv_heads * head, HIDDEN)),
                       ("attn_v", (kv_heads * head, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                       ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN)))
        if arch == "phi3":  # q/k/v and gate/up fused, as llama.cpp writes Phi-3
            projections = (("attn_qkv", (HIDDEN + 2 * kv_heads * head, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                           ("ffn_up", (2 * FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN)))
        for name, shape in projections:
            full = f"blk.{i}.{name}.weight"
            _tensor(w, full, normal(*shape), (types or {}).get(full, kind), rng)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", normal(shape[0], scale=0.2))
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", 1 + normal(head, scale=0.2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
