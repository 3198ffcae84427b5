"""GGUF checkpoints (issue 34, part 2): a .gguf file alone in the folder loads, its projections kept in
their blocks (PackedWeight: the blocks' codes and scales), and Pier's greedy output equals transformers
loading the same file (which de-quantizes it to float32), token for token, for every block type; the
de-quantized weights equal gguf-py's bit for bit; a corrupt file or an unsupported tensor type fails
the load naming the file and the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.layers.quantized import PackedWeight
from pier.backends.llm.sampling_params import SamplingParams

from .gguf_files import TEMPLATE, TYPES, write_gguf

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# type -> (bits of the kernel's container, group, offset form); None: kept as floats
LAYOUT = {"F32": None, "F16": None, "BF16": None, "Q8_0": (8, 32, False), "Q4_0": (4, 32, False),
          "Q4_1": (4, 32, True), "Q5_0": (8, 32, False), "Q5_1": (8, 32, True), "Q4_K": (4, 32, True),
          "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}


def _hf_greedy(folder: Path, prompts: list[list[int]], n: int, **config: object) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32,
                                                              **config)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("kind", TYPES)
def test_every_block_type_equals_transformers_on_the_same_file(tmp_path, prompts, kind):
    folder = tmp_path / kind
    write_gguf(folder / "model.gguf", kind, embedding="Q8_0" if kind == "Q4_1" else "F32")
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == _hf_greedy(folder, prompts, 12)
    packed = [lin.weight for layer in eng.model.layers for lin in layer.linears  # type: ignore[attr-defined]
              if isinstance(lin.weight, PackedWeight)]
    if LAYOUT[kind] is None:
        assert packed == []
    else:  # 2 layers x (qkv, o, gate_up, down), every one in its blocks' codes
        assert len(packed) == 8 and {(p.bits, p.group, p.offset) for p in packed} == {LAYOUT[kind]}
    info = eng.cache_config_info()
    assert info["quantization"] == "gguf" and f"{kind} x" in info["weight_types"]


@pytest.mark.parametrize("kind", [k for k in TYPES if LAYOUT[k] is not None])
def test_packed_blocks_dequantize_to_gguf_py_bit_for_bit(tmp_path, kind):
    """The kernel's weight (codes, scales and mins as packed) is gguf-py's de-quantized float, exactly;
    and the kernel's product is a float matmul on it up to summation order."""
    from pier.backends.llm import kernels
    from pier.backends.llm.models.gguf_blocks import pack

    path = write_gguf(tmp_path / "model.gguf", kind, seed=3)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    cols, rows = (int(v) for v in t.shape)
    p = pack(kind, t.data, rows, cols)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    assert torch.equal(p.dequantize(), want)
    ops = kernels.load()
    if ops is not None:  # 5 rows (a partial tile of x) and 40 (whole tiles): each row's sums alike
        x = torch.randn(40, cols)
        few, many = torch.empty(5, rows), torch.empty(40, rows)
        ops.quant_linear(few, x[:5].contiguous(), p.q, p.scales, p.zeros, p.bits, p.group, p.offset)
        ops.quant_linear(many, x, p.q, p.scales, p.zeros, p.bits, p.group, p.offset)
        torch.testing.assert_close(many, x @ want.t(), rtol=1e-4, atol=1e-4)
        assert torch.equal(many[:5], few)  # the same sums in the same order whatever the row count


def test_the_metadata_carries_tokenizer_and_chat_template(tmp_path):
    folder = tmp_path / "m"
    write_gguf(folder / "model.gguf", "Q8_0")
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    tok = eng.tokenizer
    assert tok.chat_template == TEMPLATE and (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids and tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi there\nassistant\n"  # the control tokens are special


def test_a_corrupt_file_or_an_unsupported_type_names_file_and_tensor(tmp_path):
    folder = tmp_path / "m"
    path = write_gguf(folder / "model.gguf", "Q4_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"GGUF file model\.gguf: cannot be read"):
        LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    write_gguf(path, "Q4_0", types={"blk.1.ffn_up.weight": "Q2_K"})
    with pytest.raises(ValueError, match=r"GGUF file model\.gguf, tensor blk\.1\.ffn_up\.weight: type Q2_K is not "
                                         r"supported"):
        LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))


def test_mixed_types_in_one_projection_stay_in_their_blocks(tmp_path, prompts):
    """A K-quant "mix" file keeps v (or down) in a wider type than q and k: the fused q/k/v holds each
    slice packed as it came (PackedSlices), none de-quantized, and the outputs still equal transformers."""
    from pier.backends.llm.layers.quantized import PackedSlices

    folder = tmp_path / "mix"
    write_gguf(folder / "model.gguf", "Q4_K", types={"blk.0.attn_k.weight": "Q5_0", "blk.0.attn_v.weight": "Q6_K",
                                                     "blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_up.weight": "Q8_0"})
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == _hf_greedy(folder, prompts, 12)
    layers = eng.model.layers  # type: ignore[attr-defined]
    qkv, gate_up = layers[0].linears[0].weight, layers[1].linears[2].weight
    assert isinstance(qkv, PackedSlices) and [(p.bits, p.group) for p in qkv.parts] == [(4, 32), (8, 32), (8, 16)]
    assert isinstance(gate_up, PackedSlices) and [(p.bits, p.offset) for p in gate_up.parts] == [(4, True), (8, False)]
    assert isinstance(layers[1].linears[0].weight, PackedWeight)  # layer 1's q/k/v: all Q4_K, one packed weight


@pytest.mark.parametrize("arch, kind", [("qwen2", "Q8_0"), ("qwen2", "Q4_K"), ("qwen3", "Q4_1"), ("qwen3", "F16")])
def test_qwen_files_equal_transformers_on_the_same_file(tmp_path, prompts, arch, kind):
    """Qwen2 (q/k/v biases) and Qwen3 (a norm over each head of q and k): llama.cpp keeps their q/k
    rows in Hugging Face's order (rotate-half RoPE), unlike Llama's."""
    folder = tmp_path / arch
    write_gguf(folder / "model.gguf", kind, arch=arch, pre="qwen2")
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    assert type(eng.model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == _hf_greedy(folder, prompts, 12)


def test_rope_freqs_scale_rope_as_llama_3_1(tmp_path, prompts):
    """llama.cpp's converter writes Llama 3.1's RoPE scaling as `rope_freqs` (one divisor per
    frequency, its formula below); the outputs equal transformers running rope_type llama3 with the
    parameters the divisors came from (transformers' GGUF loader itself ignores the tensor)."""
    import math

    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    head = 256 // 4
    divisors = []
    for freq in 1.0 / (10000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head)):
        wavelen = 2 * math.pi / freq
        if wavelen < 64 / 4.0:
            divisors.append(1.0)
        elif wavelen > 64 / 1.0:
            divisors.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            divisors.append(float(1 / ((1 - smooth) / 8.0 + smooth)))
    assert 1.0 in divisors and 8.0 in divisors and len(set(divisors)) > 2  # all three bands
    folder = tmp_path / "llama31"
    write_gguf(folder / "model.gguf", "Q8_0", rope_freqs=np.array(divisors))
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    got = [o[0] for o in eng.generate(prompts, GREEDY)]
    assert got == _hf_greedy(folder, prompts, 12, rope_parameters=llama3)
    assert got != _hf_greedy(folder, prompts, 12)  # the scaling shows in these outputs


# merges: "3 4" before "1 2", so how the digits of " 12345" are split decides the tokens
_TEXTS = ("I'll pay 12345 dollars", "He'S 3.14159\n\n  ok  ", "x=1234;y=56")


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2"])
def test_the_pre_tokenizer_splits_as_the_file_says(tmp_path, pre):
    """Each `tokenizer.ggml.pre` kind splits the text as llama.cpp does before the merges (GPT-2's
    expression, Llama 3's digits in threes, Qwen2's one by one); the ids equal transformers'
    tokenizer read from the same file."""
    import transformers

    folder = tmp_path / pre
    write_gguf(folder / "model.gguf", "Q8_0", pre=pre, merges=("3 4", "1 2", "Ġ d"))
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    for text in _TEXTS:
        assert eng.tokenizer.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    vocab = theirs.get_vocab()
    pieces = [theirs.convert_ids_to_tokens(i) for i in eng.tokenizer.encode(" 12345", add_special_tokens=False)]
    assert pieces == {"default": ["Ġ", "12", "34", "5"], "gpt-2": ["Ġ", "12", "34", "5"],
                      "llama-bpe": ["Ġ", "12", "3", "4", "5"], "qwen2": ["Ġ", "1", "2", "3", "4", "5"]}[pre], vocab


def test_an_unknown_pre_tokenizer_or_tensor_is_refused_by_name(tmp_path):
    folder = tmp_path / "m"
    write_gguf(folder / "model.gguf", "Q8_0", pre="deepseek-llm")
    with pytest.raises(ValueError, match=r"GGUF file model\.gguf: tokenizer\.ggml\.pre 'deepseek-llm' is not "
                                         r"supported; supported: .*llama-bpe.*qwen2"):
        LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    write_gguf(folder / "model.gguf", "Q8_0", arch="qwen2")  # Qwen's biases in a Llama file: not Llama's
    data = (folder / "model.gguf").read_bytes().replace(b"qwen2", b"llama")
    (folder / "model.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=r"GGUF file model\.gguf, tensor blk\.0\.attn_q\.bias: no llama layer has "
                                         r"this tensor"):
        LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))


_PIECES = ("▁", "h", "e", "l", "o", "w", "r", "d", "ll", "▁h", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld",
           "▁world", "▁▁", "▁l")
_SPM_TEXTS = ("hello world", "  hello  world ", "Hello wörld ✓\nhello", "lol", "")


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers(tmp_path, prompts):
    """tokenizer.ggml.model "llama" (Llama 2's, Mistral's files): pieces merged by score (the file has
    no merges), "▁" for spaces and one before the text, bytes outside the vocabulary as <0xNN>; the
    ids and the decoded text equal transformers' tokenizer from the same file, and BOS comes first."""
    import transformers

    folder = tmp_path / "spm"
    write_gguf(folder / "model.gguf", "Q8_0", sentencepiece=_PIECES)
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    tok = eng.tokenizer
    for text in _SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == theirs.encode(text), text
        assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert text.startswith(" ") or tok.decode(ids) == text  # the decoder strips the one "▁" it prepends
    pieces = theirs.convert_ids_to_tokens(tok.encode("hello world", add_special_tokens=False))
    assert pieces == ["▁hello", "▁world"]
    assert tok.encode("é", add_special_tokens=False) == [259, 3 + 0xC3, 3 + 0xA9]  # "▁", then its UTF-8 bytes
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == _hf_greedy(folder, prompts, 12)


@pytest.mark.parametrize("kind", ["F32", "Q4_K"])
def test_a_phi3_file_equals_transformers(tmp_path, prompts, kind):
    """Phi-3 (llama.cpp writes q/k/v and gate/up fused, and a SentencePiece vocabulary): the fused
    projections are split still packed, and, as transformers builds Phi-3's GGUF tokenizer, every text
    gets a "▁" before it, one that starts with a space too."""
    import transformers

    folder = tmp_path / kind
    write_gguf(folder / "model.gguf", kind, arch="phi3", sentencepiece=_PIECES)
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
    assert type(eng.model).__name__ == "Phi3ForCausalLM"
    if kind != "F32":
        assert all(isinstance(lin.weight, PackedWeight) for layer in eng.model.layers  # type: ignore[attr-defined]
                   for lin in layer.linears)
    # transformers' Phi3Config pads with id 32000 unless told (the file's vocabulary has 320)
    assert [o[0] for o in eng.generate(prompts, GREEDY)] == _hf_greedy(folder, prompts, 12, pad_token_id=0)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    for text in _SPM_TEXTS:
        assert eng.tokenizer.encode(text) == theirs.encode(text), text
    leading = eng.tokenizer.encode("  hello", add_special_tokens=False)
    assert theirs.convert_ids_to_tokens(leading)[:2] == ["▁▁", "▁hello"]
