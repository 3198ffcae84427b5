"""A GGUF checkpoint (llama.cpp's one-file format, read with gguf-py, the `gguf` package llama.cpp
publishes): a `.gguf` file in the model folder is the whole model, no config.json or tokenizer.json
beside it.

- `config`: the file's metadata (`{arch}.block_count`, `.embedding_length`, ...) as the config.json
  fields models/hf_config.py reads, as transformers' GGUF loader maps them (architectures `llama`,
  `qwen2`, `qwen3`); a `rope_freqs` tensor (llama.cpp's converter writes Llama 3.1's RoPE scaling as
  one divisor per frequency) as RoPE's per-frequency factors;
- `tokenizer`: `tokenizer.ggml.*` as a `tokenizers.Tokenizer`: a byte-level BPE vocabulary and merges
  (`tokenizer.ggml.model` "gpt2") with the pre-tokenizer llama.cpp picks for `tokenizer.ggml.pre` (a
  kind it does not list here is refused: another split would give other tokens), or SentencePiece's
  BPE ("llama": Llama 2, Mistral; merges from the scores where the file lists none), and the chat
  template and BOS/EOS the metadata carries;
- `iter_weights`: the tensors under the Hugging Face names the model files load (`blk.0.attn_q` ->
  `model.layers.0.self_attn.q_proj`), Llama's q/k rows back in Hugging Face's RoPE order (llama.cpp's
  converter interleaves them for `llama`, not for Qwen's rotate-half RoPE); a tensor no model file
  loads fails the load; projections in a quantized block type as `PackedWeight`s
  (models/gguf_blocks.py: the blocks' codes and scales, not de-quantized), float types and the
  token embedding as float32 (gguf-py's de-quantization: the embedding is looked up by row, and a
  tied LM head multiplies it).

A file that cannot be read, a tensor of a type not listed in gguf_blocks, or a malformed one fails
the load with a ValueError naming the file and the tensor.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_blocks import BLOCK_TYPES, FLOAT_TYPES, pack
from .quantization import QuantConfig

log = logging.getLogger(__name__)

# GGUF's general.architecture -> the Hugging Face architecture that serves it
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_PERMUTED = {"llama"}  # whose q/k rows llama.cpp's converter interleaves (the others rotate halves, as HF)
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# a block's tensors (name.leaf) each architecture has; the others load no tensor it does not have
_LAYER = {f"{n}.weight" for n in _BLOCK} - {"attn_q_norm.weight", "attn_k_norm.weight"}
_LAYERS = {"llama": _LAYER, "qwen2": _LAYER | {"attn_q.bias", "attn_k.bias", "attn_v.bias"},
           "qwen3": _LAYER | {"attn_q_norm.weight", "attn_k_norm.weight"},
           "phi3": {"attn_norm.weight", "ffn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                    "ffn_down.weight"}}
# Phi-3's q/k/v and gate/up come fused, as in its Hugging Face checkpoints (models/phi3.py splits them)
_FUSED = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_ROPE_FREQS = "rope_freqs.weight"  # read into the config, not a weight
# tokenizer.ggml.pre -> the expression llama.cpp (llama-vocab.cpp) splits the text with before the
# byte-level BPE, in the form Hugging Face's tokenizer.json writes it; None: GPT-2's own expression.
_GPT2 = None
_DIGITS_FIRST = "digits"  # each digit alone, then GPT-2's (SMOLLM, STARCODER, REFACT, COMMAND_R, ...)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE: dict[str, str | None] = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "exaone4"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    _DIGITS_FIRST),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2),
}
_WHOLE_WORDS = {_LLAMA3}  # llama.cpp's ignore_merges: a piece that is a token is that token
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type


def find(folder: Path) -> Path | None:
    """The folder's GGUF file when it holds one and no safetensors weights; ValueError for several."""
    files = sorted(folder.glob("*.gguf"))
    if not files or any(folder.glob("*.safetensors")):
        return None
    if len(files) > 1:
        raise ValueError(f"{folder}: several GGUF files ({', '.join(f.name for f in files)}); keep one per version "
                         "folder")
    return files[0]


def open_file(path: Path) -> Any:
    """gguf-py's reader (memory-mapped); ValueError naming the file when it cannot be read."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - gguf-py raises ValueError, struct.error, IndexError...
        raise ValueError(f"GGUF file {path.name}: cannot be read ({type(exc).__name__}: {exc})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config(path: Path) -> dict[str, Any]:
    """config.json's fields from the file's metadata (transformers' GGUF mapping)."""
    r = open_file(path)
    arch = _field(r, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF file {path.name}: architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF file {path.name}: {arch}.rope.scaling.type {scaling!r} is not supported")

    def need(key: str) -> Any:
        value = _field(r, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {path.name}: metadata {arch}.{key} missing")
        return value

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    tokens = _field(r, "tokenizer.ggml.tokens") or []
    names = {t.name for t in r.tensors}
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(_field(r, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    window = _field(r, f"{arch}.attention.sliding_window")
    if window:
        raw["sliding_window"] = int(window)
    rotary = _field(r, f"{arch}.rope.dimension_count")
    if rotary and int(rotary) != raw["head_dim"]:  # a part of each head rotates (Phi-4-mini: 3/4)
        raw["partial_rotary_factor"] = int(rotary) / raw["head_dim"]
    freqs = next((t for t in r.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:  # one divisor per frequency: LongRoPE's factors, the same at every position
        try:
            factors = [float(v) for v in _float(freqs).flatten()]
        except (ValueError, RuntimeError, IndexError, KeyError) as exc:
            raise ValueError(f"GGUF file {path.name}, tensor {_ROPE_FREQS}: {exc}") from None
        raw["rope_scaling"] = {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
                               "factor": 1.0, "attention_factor": 1.0,
                               "original_max_position_embeddings": raw["max_position_embeddings"]}
    return raw


def tensor_types(path: Path) -> Counter[str]:
    """How many tensors of each GGML type the file holds."""
    return Counter(t.tensor_type.name for t in open_file(path).tensors)


def tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """(a `tokenizers.Tokenizer`, tokenizer_config.json's fields: bos/eos tokens, add_bos_token,
    chat_template) from the metadata."""
    from tokenizers import AddedToken

    r = open_file(path)
    kind = _field(r, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"GGUF file {path.name}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE, and 'llama', SentencePiece's BPE)")
    tokens: list[str] = list(_field(r, "tokenizer.ggml.tokens") or [])
    types: list[int] = list(_field(r, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [_pair(m) for m in _field(r, "tokenizer.ggml.merges") or []]

    def text(key: str) -> str | None:
        i = _field(r, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    unk = text("tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        tok = _byte_level(path, r, tokens, merges)
    else:
        scores = list(_field(r, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        tok = _sentencepiece(tokens, merges or _merges_from_scores(tokens, scores), unk,
                             bool(_field(r, "tokenizer.ggml.add_space_prefix", True)),
                             _field(r, "general.architecture") == "phi3")
    special = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL or (t == unk and kind == "llama")]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED])
    # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary whose file does not say otherwise
    cfg = {"bos_token": text("tokenizer.ggml.bos_token_id"), "eos_token": text("tokenizer.ggml.eos_token_id"),
           "unk_token": unk, "pad_token": text("tokenizer.ggml.padding_token_id"),
           "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token", kind == "llama")),
           "chat_template": _field(r, "tokenizer.chat_template")}
    return tok, cfg


def _byte_level(path: Path, r: Any, tokens: list[str], merges: list[tuple[str, str]]) -> Any:
    """GPT-2's byte-level BPE, split first as llama.cpp splits for the file's `tokenizer.ggml.pre`."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    pre = _field(r, "tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise ValueError(f"GGUF file {path.name}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{', '.join(sorted(_PRE))}")
    split = _PRE[pre]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False,
                                 ignore_merges=split in _WHOLE_WORDS))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is _GPT2 or split == _DIGITS_FIRST)
    if split is _GPT2:
        tok.pre_tokenizer = byte_level
    else:
        first = Regex(r"\p{N}" if split == _DIGITS_FIRST else split)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(first, "isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(tokens: list[str], merges: list[tuple[str, str]], unk: str | None, prefix_space: bool,
                   always_prefix: bool) -> Any:
    """SentencePiece's BPE (Llama 2, Mistral, Phi-3): spaces as "▁", one "▁" before the text where
    `tokenizer.ggml.add_space_prefix` (the default), bytes outside the vocabulary as its <0xNN> tokens;
    as transformers' LlamaTokenizer builds it, or (`always_prefix`: Phi-3, as transformers builds its
    GGUF tokenizer) with the "▁" put before every text, one that starts with a space too."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    if always_prefix:
        steps_in = [normalizers.Prepend("\u2581")] if prefix_space else []
        tok.normalizer = normalizers.Sequence([*steps_in, normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix_space
                                                     else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix_space else []))
    return tok


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (its file lists none): every split of a token into
    two tokens, the best-scored token's first, as transformers' `generate_merges` orders them."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=False):
        pairs = [(token[:k], token[k:], float(score)) for k in range(1, len(token))
                 if token[:k] in ids and token[k:] in ids]
        found += sorted(pairs, key=lambda m: (ids[m[0]], ids[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of a tensor `arch` has; None for one it does not have."""
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP and leaf == "weight":
        return f"{_TOP[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and f"{parts[2]}.{leaf}" in _LAYERS[arch]:
        return f"model.layers.{parts[1]}.{_FUSED.get(arch, {}).get(parts[2]) or _BLOCK[parts[2]]}.{leaf}"
    return None


def _rope_rows(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """llama.cpp's converter interleaves each head's q/k rows (permute); this undoes it, as
    transformers' reverse_permute_weights does, on any row-wise tensor [N, ...]."""
    def undo(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    return undo


def _float(t: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    shape = [int(v) for v in reversed(t.shape)]
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)


def iter_weights(path: Path, raw: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 tensor or PackedWeight) for every tensor the model files load."""
    r = open_file(path)
    heads = ({"q_proj": int(raw["num_attention_heads"]), "k_proj": int(raw["num_key_value_heads"])}
             if raw["model_type"] in _PERMUTED else {})
    for t in r.tensors:
        if t.name == _ROPE_FREQS:
            continue  # config() read it
        name = _hf_name(t.name, raw["model_type"])
        kind = t.tensor_type.name
        try:
            if name is None:
                raise ValueError(f"no {raw['model_type']} layer has this tensor (an architecture or a variant "
                                 "not served from GGUF here)")
            if kind not in FLOAT_TYPES and kind not in BLOCK_TYPES:
                raise ValueError(f"type {kind} is not supported; supported: {', '.join((*FLOAT_TYPES, *BLOCK_TYPES))}")
            projection = name.endswith("_proj.weight")
            if kind in FLOAT_TYPES or not projection:
                value: Any = _float(t)
            else:
                cols, rows = (int(v) for v in t.shape)
                value = pack(kind, t.data, rows, cols)
            proj = name.rsplit(".", 2)[-2]
            if proj in heads:
                undo = _rope_rows(heads[proj])
                value = undo(value) if isinstance(value, torch.Tensor) else value.map_rows(undo)
        except (ValueError, RuntimeError, IndexError, KeyError) as exc:
            raise ValueError(f"GGUF file {path.name}, tensor {t.name}: {exc}") from None
        yield name, value


_CODE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
              "F16": 16, "BF16": 16, "F32": 32}


def quant_config(path: Path) -> QuantConfig:
    """What runs: method gguf, the narrowest code width among the tensors, and the tensor types with
    their counts for the startup log and vllm:cache_config_info ("Q4_1 x210, F32 x61, Q8_0 x1")."""
    types = tensor_types(path)
    bits = min((_CODE_BITS.get(k, 32) for k in types), default=32)
    return QuantConfig("gguf", bits, 32, ", ".join(f"{k} x{n}" for k, n in types.most_common()))
