"""The per-token cost of structured output's grammar masks in Pier's LLM engine.

The same workload (a random-weight ~27 M-parameter Llama with a byte-level BPE tokenizer, so that
every JSON character is a token path; sampled, seeded, `ignore_eos` so both runs generate exactly
`max_tokens` per request and the batches match step for step) runs with no constraint and with a
JSON schema, in interleaved rounds; the report gives generated tokens/s per run, the ratio per
round, and the median and spread. After a schema's document is complete only EOS is allowed, so
the masked run keeps paying for the mask at every step (the worst case).

    .venv/bin/python -m bench.structured_output [--rounds 3] [--requests 16] [--tokens 96]

vLLM side by side (its guidance backend on the same weights) needs the reference vLLM
(PIER_REFERENCE_TOOLS); it is not run here: see the closing note of the run that added this.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, git_describe, machine

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                   "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["name", "ok", "color", "count", "tags"], "additionalProperties": False,
}
CORPUS = ["The quick brown fox jumps over the lazy dog.", '{"name": "x", "ok": true, "count": 3}',
          "Paged attention keeps keys and values in fixed-size blocks.", "Héllo wörld ☃ 日本語 🙂"]


def build_model(folder: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


_MASK_NS = [0]


def _timed_masks() -> None:
    """Time the mask work itself (the engine's bitmask fill, grammar_bitmask, and the sampler's
    apply_bitmask): a number the shared host's noise moves less."""
    from pier.backends.llm import engine, sampler

    def timed(inner: Any) -> Any:
        def run(*args: Any) -> Any:
            t = time.perf_counter_ns()
            result = inner(*args)
            _MASK_NS[0] += time.perf_counter_ns() - t
            return result
        return run

    engine.grammar_bitmask = timed(engine.grammar_bitmask)  # type: ignore[attr-defined]
    sampler.apply_bitmask = timed(sampler.apply_bitmask)  # type: ignore[assignment]


def run(engine: Any, prompts: list[list[int]], tokens: int, schema: dict | None) -> float:
    from pier.backends.llm.sampling_params import SamplingParams

    base = {"max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        extra = {"structured_outputs": {"json": schema}} if schema else {}
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, SamplingParams.from_json({**base, "seed": i, **extra}))
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine

    folder = build_model(Path(tempfile.mkdtemp()) / "model")
    engine = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=256 << 20))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 300) for _ in range(rng.randint(16, 64))] for _ in range(args.requests)]
    run(engine, prompts[:2], 4, SCHEMA)  # warm-up: kernels and llguidance's tokenizer
    _timed_masks()
    rows = []
    for r in range(args.rounds):
        plain = run(engine, prompts, args.tokens, None)
        _MASK_NS[0] = 0
        masked = run(engine, prompts, args.tokens, SCHEMA)
        mask_us = _MASK_NS[0] / 1000 / (len(prompts) * args.tokens)
        rows.append({"round": r + 1, "plain_tok_s": plain, "schema_tok_s": masked, "ratio": masked / plain,
                     "mask_us_per_token": mask_us})
        print(f"round {r + 1}: plain {plain:.0f} tok/s, schema {masked:.0f} tok/s, ratio {masked / plain:.3f}, "
              f"mask {mask_us:.1f} us/token")
    ratios = [x["ratio"] for x in rows]
    summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "median_mask_us_per_token": statistics.median(x["mask_us_per_token"] for x in rows),
               "requests": args.requests, "tokens": args.tokens, "machine": machine(), "revision": git_describe()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_output.json").write_text(json.dumps({"rounds": rows, **summary}, indent=2) + "\n")
    lines = ["# Structured output: the grammar mask's per-token cost (Pier's LLM engine)", "",
             f"{args.requests} requests x {args.tokens} tokens, sampled, `ignore_eos`; "
             f"{summary['machine']}; revision {summary['revision']}.", "",
             "| round | no constraint (tok/s) | JSON schema (tok/s) | ratio | mask (us per token) |",
             "|---|---|---|---|---|"]
    lines += [f"| {x['round']} | {x['plain_tok_s']:.0f} | {x['schema_tok_s']:.0f} | {x['ratio']:.3f} | "
              f"{x['mask_us_per_token']:.1f} |" for x in rows]
    lines += ["", f"Median ratio {summary['median_ratio']:.3f} (spread {summary['min_ratio']:.3f} to "
              f"{summary['max_ratio']:.3f}); the mask step itself: {summary['median_mask_us_per_token']:.1f} us "
              "per generated token (median). vLLM side by side: not run (see bench/structured_output.py)."]
    (RESULTS / "structured_output.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
