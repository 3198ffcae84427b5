"""Where a step's time goes on a real model (issue 33): SmolLM2-135M-Instruct, 64 chat requests at once,
greedy, 128 tokens each (bench/llm_real_model.py's workload). Two views, written to
bench/results/llm_profile[-NAME].md:

1. the offline engine in this process, every part of `LLMEngine.step` timed (scheduling, preparing the
   step's inputs, the model forward, the LM head, sampling, output processing), and the forward split
   by operator kind with torch.profiler over a few decode steps (the projections' GEMMs, attention,
   RMSNorm, RoPE + KV write, SiLU, the rest);
2. `pier serve` under the same load through the OpenAI API, py-spy sampling the server process and
   the engine-core process separately: the share of samples in each part of the code (by the
   innermost Pier or library frame that names it).

    .venv/bin/python -m bench.llm_profile [--dtype bfloat16] [--name NAME] [--no-served]

Needs py-spy (pip install py-spy) for part 2; `make smollm2` builds the model (the set-up runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, log
from bench.llm_process import PierServer, _children
from bench.llm_real_model import TOKENS, _drive_chat, build_model, chats

# Engine-core and server samples, by the first frame (innermost first) whose file or function matches.
PARTS = [
    ("LM head (logits)", ("compute_logits", "vocab.py")),
    ("sampling", ("sampler.py",)),
    ("model forward: attention", ("attention.py", "paged_decode")),
    ("model forward: linear (GEMMs)", ("linear.py",)),
    ("model forward: norm / rotary / activation", ("norm.py", "rotary.py", "activation.py")),
    ("model forward: other", ("llama.py",)),
    ("step inputs (runner)", ("model_runner.py",)),
    ("scheduling + KV blocks", ("scheduler.py", "kv_cache.py", "block_pool", "request.py")),
    ("output processing + detokenization", ("output_processor.py", "tokenizer.py", "detok", "tokenizers")),
    ("IPC (msgspec / zmq)", ("core_messages.py", "core_client.py", "engine_core.py", "zmq", "msgspec", "ipc/")),
    ("OpenAI frontend (SSE, JSON)", ("frontends/http/openai", "json")),
    ("HTTP server (aiohttp)", ("aiohttp", "web_protocol", "http_writer")),
    ("asyncio event loop", ("asyncio", "selectors", "uvloop")),
]


def offline(folder: Path, dtype: str, n: int) -> dict[str, Any]:
    import torch
    import transformers

    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for c in chats(n)]
    eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=1 << 30, dtype=dtype))
    eng.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] += time.perf_counter() - t
        setattr(obj, attr, wrapper)

    import pier.backends.llm.model_runner as mr
    timed(eng.scheduler, "schedule", "scheduling + KV blocks")
    timed(eng.runner, "_forward", "step inputs + model forward")
    timed(eng.model, "forward", "model forward")
    timed(eng.model, "compute_logits", "LM head (logits)")
    timed(mr, "sample", "sampling")
    timed(eng.outputs, "process", "output processing + detokenization")
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    t0, steps, gen, ops = time.perf_counter(), 0, 0, None
    while eng.has_unfinished():
        if steps == 40:  # decode only by now: every prompt is in
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    gen += sum(len(o.token_ids) for o in eng.step())
                    steps += 1
            ops = prof.key_averages()
            continue
        gen += sum(len(o.token_ids) for o in eng.step())
        steps += 1
    wall = time.perf_counter() - t0
    spent["step inputs (runner)"] = spent.pop("step inputs + model forward") - spent["model forward"]
    spent["other (engine step, runner bookkeeping)"] = wall - sum(spent.values())
    kinds: dict[str, float] = collections.defaultdict(float)
    if ops is not None:
        for e in ops:
            name = e.key
            if name.startswith("ProfilerStep") or e.self_cpu_time_total <= 0:
                continue
            kind = ("GEMM (linear projections, LM head)" if any(k in name for k in ("mm", "linear", "mkldnn")) else
                    "attention" if "attention" in name or "sdpa" in name else
                    "RMSNorm" if "rms" in name else "RoPE + KV write" if "rope" in name or "rotary" in name else
                    "SiLU * up" if "silu" in name else "argmax / sampling" if "argmax" in name or "max" in name else
                    "copies, indexing, tensor creation" if any(k in name for k in ("copy", "index", "tensor", "empty",
                                                                                   "cat", "select", "slice", "to"))
                    else f"other ({name})")
            kinds[kind] += e.self_cpu_time_total / 1e6
    return {"wall_s": wall, "steps": steps, "tokens": gen, "tok_s": gen / wall, "parts_s": dict(spent),
            "ops_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:12])}


def _classify(stack: list[str]) -> str:
    for frame in stack:  # innermost first
        for label, keys in PARTS:
            if any(k in frame for k in keys):
                return label
    return "other"


def _py_spy(pid: int, out: Path, seconds: int) -> subprocess.Popen:
    spy = str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "50", "--format", "raw",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _summarise(raw: Path) -> dict[str, float]:
    counts: dict[str, int] = collections.defaultdict(int)
    idle = ("select", "epoll", "poll (", "wait (", "_recv", "recv_multipart", "sleep")
    for line in raw.read_text().splitlines() if raw.is_file() else []:
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")[::-1]
        label = "idle (waiting for work)" if frames and any(k in frames[0] for k in idle) else _classify(frames)
        counts[label] += int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def served(folder: Path, dtype: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        s = PierServer(folder, "process", Path(tmp), "profile", params={"dtype": dtype})
        try:
            asyncio.run(_drive_chat(s.base, chats(4)))  # warm-up
            core = _children(s.proc.pid)[0]
            t = time.perf_counter()
            spies = [_py_spy(s.proc.pid, Path(tmp) / "server.txt", 600), _py_spy(core, Path(tmp) / "core.txt", 600)]
            r = asyncio.run(_drive_chat(s.base, chats(n)))
            for p in spies:
                p.send_signal(2)  # py-spy writes what it has on SIGINT
                p.wait(60)
            r.pop("texts")
            r["profiled_s"] = time.perf_counter() - t
            r["server"] = _summarise(Path(tmp) / "server.txt")
            r["engine core"] = _summarise(Path(tmp) / "core.txt")
            return r
        finally:
            s.stop()


def write(res: dict[str, Any], name: str) -> Path:
    off = res["offline"]
    lines = [f"# Where the time goes: SmolLM2-135M-Instruct, {res['requests']} chat requests at once, {TOKENS} "
             f"tokens each, {res['dtype']}", "", f"Machine: {res['machine']} — the 2 cores are shared by the server, "
             f"the load generator and the model (and, during this run, other work: load average {res['load']}).", "",
             f"## 1. The offline engine, one process ({off['tok_s']:.1f} tok/s, {off['steps']} steps, "
             f"{off['wall_s']:.1f} s)", "", "| part of `LLMEngine.step` | s | share |", "|---|---|---|"]
    parts = sorted(off["parts_s"].items(), key=lambda kv: -kv[1])
    lines += [f"| {k} | {v:.2f} | {v / off['wall_s']:.0%} |" for k, v in parts]
    total = sum(off["ops_s"].values()) or 1
    lines += ["", "The forward and the rest of 5 decode steps (64 sequences) by operator (torch.profiler, self CPU "
              "time):", "", "| operator kind | share |", "|---|---|"]
    lines += [f"| {k} | {v / total:.0%} |" for k, v in off["ops_s"].items()]
    if "served" in res:
        sv = res["served"]
        lines += ["", f"## 2. `pier serve` through the OpenAI API ({sv['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{sv['ttft_p50_s']:.2f} s), py-spy at 50 Hz on each process", ""]
        for proc in ("engine core", "server"):
            lines += [f"**{proc}** (share of samples, innermost named frame):", "", "| part | share |", "|---|---|"]
            lines += [f"| {k} | {v:.0%} |" for k, v in sv[proc].items() if v >= 0.005]
            lines.append("")
    lines += ["", "Measured with `python -m bench.llm_profile`.", ""]
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--name", default="llm_profile")
    a = ap.parse_args()
    folder = build_model()
    if isinstance(folder, str):
        log(folder)
        return
    res: dict[str, Any] = {"requests": a.requests, "dtype": a.dtype, "machine": machine(), "load": loadavg()}
    log("offline engine")
    res["offline"] = offline(folder, a.dtype, a.requests)
    if not a.no_served:
        log("pier serve + py-spy")
        res["served"] = served(folder, a.dtype, a.requests)
    print(write(res, a.name).read_text())


if __name__ == "__main__":
    main()
