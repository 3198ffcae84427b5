"""vLLM's CPU build on the architecture test folders: does it run them, and does its greedy output
equal transformers' (as Pier's does)? (issue 35, part 2)

The tiny random-weight models of tests/e2e/test_llm_architectures.py (Qwen3, Gemma 2, Gemma 3, Phi-3,
Mixtral, Qwen3-MoE; sliding windows of 8-12 with prompts of 4-41 tokens), 32 greedy tokens on three
prompts each: transformers' generate, Pier's engine and vLLM (float32, offline `LLM.generate` with
token-id prompts, block size 32 as its CPU build needs, run with the venv that
`$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref` installs). A correctness comparison,
not a timing.

    .venv/bin/python -m bench.vllm_archs [--vllm-dir ~/vllm-ref]

Writes bench/results/llm_archs_vllm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.llm_bench import CACHE, RESULTS, log
from tests.backends.llm.tiny_model import ARCHITECTURES

# The e2e test's models, each with head_dim 32 (the size vLLM's CPU attention takes).
MODELS: dict[str, tuple[str, dict]] = {name: (arch, {**settings, "head_dim": 32})
                                       for name, (arch, settings) in ARCHITECTURES.items()}

RUNNER = '''
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():  # under the __main__ guard: vLLM starts its engine core with multiprocessing's spawn
    folder, prompts_file, out_file = sys.argv[1:4]
    prompts = json.load(open(prompts_file))
    llm = LLM(model=folder, dtype="float32", seed=0, block_size=32, max_model_len=128, enforce_eager=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    json.dump([list(o.outputs[0].token_ids) for o in outs], open(out_file, "w"))


if __name__ == "__main__":
    main()
'''


def run_vllm(python: Path, folder: Path, prompts: list[list[int]]) -> list[list[int]] | str:
    with tempfile.TemporaryDirectory() as tmp:
        runner, pf, out = Path(tmp) / "runner.py", Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        runner.write_text(RUNNER)
        pf.write_text(json.dumps(prompts))
        proc = subprocess.run([str(python), str(runner), str(folder), str(pf), str(out)], capture_output=True,
                              text=True, timeout=900)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            causes = [ln for ln in lines if re.search(r"(Error|Exception): ", ln)
                      and "Engine core initialization failed" not in ln]  # the root cause, not its echo
            return f"does not run: {(causes or lines or ['exit ' + str(proc.returncode)])[-1][:300]}"
        return json.loads(out.read_text())


def compare(got: list[list[int]] | str, ref: list[list[int]]) -> str:
    if isinstance(got, str):
        return got
    if got == ref:
        return "equal"
    firsts = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(got, ref)]
    return "differs: first differing token per prompt " + ", ".join(map(str, firsts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-dir", type=Path, default=Path("~/vllm-ref").expanduser())
    args = ap.parse_args()
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams
    from tests.backends.llm.tiny_model import build_model, hf_greedy

    python = args.vllm_dir / "venv" / "bin" / "python"
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (4, 19, 41)]
    rows = []
    for i, (name, (arch, settings)) in enumerate(MODELS.items()):
        folder = CACHE / "vllm-archs" / name
        if not (folder / "config.json").is_file():
            build_model(folder, arch, seed=30 + i, **settings)
        ref = hf_greedy(folder, prompts, 32)
        eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=4 << 20))
        pier = [o[0] for o in eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))]
        vllm = run_vllm(python, folder, prompts) if python.is_file() else f"skipped: no vLLM venv at {args.vllm_dir}"
        rows.append({"model": name, "pier": compare(pier, ref), "vllm": compare(vllm, ref)})
        log(f"{name}: Pier {rows[-1]['pier']}; vLLM {rows[-1]['vllm']}")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "all cores")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llm_archs_vllm.json").write_text(json.dumps({"when": when, "prompts": prompts, "rows": rows},
                                                            indent=1))
    lines = ["# The architecture test folders on Pier and on vLLM's CPU build", "",
             f"`python -m bench.vllm_archs` ({when}; vLLM-cpu 0.32 from {args.vllm_dir}, float32, "
             f"enforce_eager, block size 32, VLLM_CPU_OMP_THREADS_BIND={bind}): 32 "
             "greedy tokens on prompts of 4, 19 and 41 tokens, each engine against transformers' generate. "
             "Models: bench/vllm_archs.py (the e2e test's settings, head_dim 32 throughout).", "",
             "| model | Pier vs transformers | vLLM vs transformers |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['pier']} | {r['vllm']} |" for r in rows]
    (RESULTS / "llm_archs_vllm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
