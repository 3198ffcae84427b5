"""vLLM's CPU build (0.32, the venv that `$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref`
makes) run on a model folder in its own process: greedy tokens and prompt logprobs for token-id
prompts, or offline decode tokens/s. For comparisons only (tests skip, benchmarks say so, where the
venv is absent); nothing of Pier imports it."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

VLLM_PYTHON = Path.home() / "vllm-ref" / "venv" / "bin" / "python"

# Run by vLLM's interpreter: {"folder", "dtype", "prompts", "max_tokens", "max_model_len"; "timed": batch
# sizes, "timed_prompts", "max_tokens_timed"} -> {"tokens", "prompt_logprobs"} (each prompt token's
# logprob from the second on) and "timed": [[batch, output tokens / generate() seconds], ...] in the
# order asked, each after a 1-token request of the same prompts (its prefill's first costs untimed).
RUNNER = '''
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():  # under the __main__ guard: vLLM starts its engine core with multiprocessing's spawn
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["folder"], dtype=job["dtype"], seed=0, block_size=32, max_model_len=job["max_model_len"],
              enforce_eager=job.get("enforce_eager", True))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "prompt_logprobs": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                                  for o, p in zip(outs, job["prompts"])], "timed": []}
    n = job.get("max_tokens_timed", job["max_tokens"])
    for batch in job.get("timed", []):
        plain = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        batch_prompts = [TokensPrompt(prompt_token_ids=p) for p in job["timed_prompts"][:batch]]
        llm.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        llm.generate(batch_prompts, plain, use_tqdm=False)
        result["timed"].append([batch, batch * n / (time.perf_counter() - start)])
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
'''


def run_vllm(folder: Path, prompts: list[list[int]], max_tokens: int, dtype: str = "bfloat16",
             max_model_len: int = 256, timeout: float = 900, **job: Any) -> dict[str, Any]:
    """vLLM's answers for `prompts` on `folder` (RUNNER's result). RuntimeError with vLLM's own root
    error line where it refuses the folder or fails."""
    with tempfile.TemporaryDirectory() as tmp:
        runner, job_file, out = Path(tmp) / "runner.py", Path(tmp) / "job.json", Path(tmp) / "out.json"
        runner.write_text(RUNNER)
        job_file.write_text(json.dumps({"folder": str(folder), "dtype": dtype, "prompts": prompts,
                                        "max_tokens": max_tokens, "max_model_len": max_model_len, **job}))
        proc = subprocess.run([str(VLLM_PYTHON), str(runner), str(job_file), str(out)], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(root_error(proc.stderr + proc.stdout) or f"vLLM exited {proc.returncode}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def root_error(output: str) -> str:
    """The line that says why vLLM failed (its config validation's 'Value error, ...', else the last
    'SomethingError: ...'), not the echoes of it."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    value = [ln for ln in lines if ln.startswith("Value error, ")]
    if value:
        return value[-1].split(" [type=")[0]
    causes = [ln for ln in lines if re.search(r"(Error|Exception): ", ln) and "Engine core initialization" not in ln]
    return causes[-1][:300] if causes else ""


def agreement(ours: list[list[int]], theirs: list[list[int]], ours_lp: list[list[float]],
              theirs_lp: list[list[float]]) -> dict[str, Any]:
    """The figures of one comparison: per prompt the greedy steps equal before the first difference,
    their share of all steps, and the prompt logprobs' mean and largest absolute difference."""
    firsts = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), len(o)) for o, t in zip(ours, theirs)]
    diffs = [abs(a - b) for o, t in zip(ours_lp, theirs_lp) for a, b in zip(o, t)]
    return {"steps_equal": firsts, "share_equal": sum(firsts) / sum(len(o) for o in ours),
            "identical": sum(o == t for o, t in zip(ours, theirs)), "prompts": len(ours),
            "logprob_mean_diff": sum(diffs) / len(diffs), "logprob_max_diff": max(diffs), "positions": len(diffs)}
