"""Multi-LoRA throughput: output tokens/s of one mixed batch whose requests spread over 1, 4 or 16
PEFT adapters (rank 16 on every attention and MLP projection, random non-zero A and B), against the
base model alone (LoRA off) and the same base-only batch with LoRA on; Pier beside vLLM's CPU build
with the same adapters, when it is installed (~/vllm-ref).

SmolLM2-135M-Instruct in float32 (pass its safetensors folder, /work/scratch/smollm2). Each engine
is loaded once (LoRA on: max_loras 16) and runs every workload in turn, for --rounds interleaved
rounds: --requests requests of --prompt random token ids, --max-tokens greedy tokens each
(ignore_eos), all submitted at once; request i runs adapter i mod n.

    .venv/bin/python -m bench.lora /work/scratch/smollm2      # writes bench/results/lora.{json,md}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORKLOADS = ("base", "lora-on base", "1 adapter", "4 adapters", "16 adapters")


def write_adapters(model: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of `model` (random A and B, B non-zero), written as PEFT saves them."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    shapes = {"q_proj": (hidden, cfg["num_attention_heads"] * hd), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (cfg["num_attention_heads"] * hd, hidden), "gate_proj": (hidden, inter),
              "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    paths = []
    for k in range(count):
        gen = torch.Generator().manual_seed(k)
        tensors = {}
        for i in range(layers):
            for name, (d_in, d_out) in shapes.items():
                part = "self_attn" if name in TARGETS[:4] else "mlp"
                key = f"base_model.model.model.layers.{i}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        folder = out / f"adapter{k}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
            "bias": "none", "base_model_name_or_path": str(model), "task_type": "CAUSAL_LM"}))
        paths.append(folder)
    return paths


def adapters_of(workload: str, requests: int) -> list[int | None]:
    """Each request's adapter index (None: the base model)."""
    n = {"1 adapter": 1, "4 adapters": 4, "16 adapters": 16}.get(workload, 0)
    return [i % n if n else None for i in range(requests)]


def run_pier(model: Path, adapters: list[Path], prompts: list[list[int]], max_tokens: int, rounds: int
             ) -> dict[str, list[float]]:
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams

    plain = LLMEngine(model, EngineConfig(kv_cache_memory_bytes=1 << 30))
    lora = LLMEngine(model, EngineConfig(kv_cache_memory_bytes=1 << 30, enable_lora=True, max_loras=16,
                                         max_cpu_loras=16))
    for k, path in enumerate(adapters):
        lora.load_lora(f"adapter{k}", path)
    for eng in (plain, lora):  # first calls (kernels, oneDNN's primitives) are not timed
        eng.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    lora.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, lora_name="adapter0"))
    out: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    for _ in range(rounds):
        for w in WORKLOADS:
            eng = plain if w == "base" else lora
            params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                     lora_name=None if a is None else f"adapter{a}")
                      for a in adapters_of(w, len(prompts))]
            t = time.perf_counter()
            got = eng.generate(prompts, params)
            out[w].append(sum(len(o[0]) for o in got) / (time.perf_counter() - t))
    return out


VLLM_SCRIPT = r'''
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

def main():
    model, work = sys.argv[1], json.load(open(sys.argv[2]))
    lora = sys.argv[3] == "lora"
    kw = dict(model=model, dtype="float32", block_size=32, max_model_len=1024, seed=0)
    if lora:
        kw.update(enable_lora=True, max_loras=16, max_lora_rank=16, max_cpu_loras=16)
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    reqs = [LoRARequest(f"adapter{k}", k + 1, p) for k, p in enumerate(work["adapters"])]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    out = {}
    for _ in range(work["rounds"]):
        for name, assign in work["workloads"].items():
            if (name == "base") == lora:
                continue
            lr = [None if a is None else reqs[a] for a in assign]
            t = time.perf_counter()
            got = llm.generate(prompts, sp, lora_request=lr if lora else None, use_tqdm=False)
            out.setdefault(name, []).append(sum(len(o.outputs[0].token_ids) for o in got) / (time.perf_counter() - t))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the main module must not run again
    main()
'''


def run_vllm(model: Path, adapters: list[Path], prompts: list[list[int]], max_tokens: int, rounds: int
             ) -> dict[str, list[float]] | str:
    py = Path.home() / "vllm-ref" / "venv" / "bin" / "python"
    if not py.is_file():
        return "vLLM's CPU build is not installed (~/vllm-ref)"
    work = {"adapters": [str(p) for p in adapters], "prompts": prompts, "max_tokens": max_tokens, "rounds": rounds,
            "workloads": {w: adapters_of(w, len(prompts)) for w in WORKLOADS}}
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "work.json").write_text(json.dumps(work))
        (Path(tmp) / "run.py").write_text(VLLM_SCRIPT)
        for mode in ("base", "lora"):
            try:
                p = subprocess.run([str(py), str(Path(tmp) / "run.py"), str(model), str(Path(tmp) / "work.json"), mode],
                                   capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                return f"vLLM ({mode}) timed out"
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
                return f"vLLM ({mode}) failed: {tail[:300]}"
            out.update(json.loads(line[len("RESULT "):]))
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-vllm", action="store_true")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.prompt)] for _ in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(a.model, Path(tmp), 16, a.rank)
        pier = run_pier(a.model, adapters, prompts, a.max_tokens, a.rounds)
        vllm = "not run (--no-vllm)" if a.no_vllm else run_vllm(a.model, adapters, prompts, a.max_tokens, a.rounds)
    doc = {"model": str(a.model), "requests": a.requests, "prompt_tokens": a.prompt, "max_tokens": a.max_tokens,
           "rounds": a.rounds, "rank": a.rank, "pier": pier, "vllm": vllm}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Multi-LoRA throughput ({a.model.name}, float32)", "",
             f"{a.requests} requests at once, {a.prompt} prompt tokens, {a.max_tokens} greedy tokens each; adapters "
             f"rank {a.rank} on all 7 projections; {a.rounds} interleaved rounds, median (min-max) output tokens/s. "
             "2 CPU cores shared by the engine and everything else on the machine.", "",
             "| workload | Pier tok/s | vs Pier base | vLLM tok/s | vs vLLM base | Pier / vLLM |",
             "|---|---|---|---|---|---|"]
    pb = statistics.median(pier["base"])
    for w in WORKLOADS:
        p = statistics.median(pier[w])
        if isinstance(vllm, dict) and w in vllm:
            v, vb = statistics.median(vllm[w]), statistics.median(vllm["base"])
            vcols = f"{spread(vllm[w])} | {v / vb:.2f}x | {p / v:.2f}x"
        else:
            vcols = "- | - | -"
        lines.append(f"| {w} | {spread(pier[w])} | {p / pb:.2f}x | {vcols} |")
    if isinstance(vllm, str):
        lines += ["", f"vLLM: {vllm}"]
    (RESULTS / "lora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
