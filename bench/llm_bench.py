"""LLM engine benchmark (issue 6): Pier's engine vs transformers (sequential, static batches of 8) and vLLM.

One run, same model and requests, on this CPU: a random-weight Llama of ~27 M parameters (hidden
512, 8 layers, 8 heads, 4 KV heads, float32), 64 requests with prompt lengths 16-256 and output
lengths 8-256 (fixed seed), greedy with ignore_eos so every length is exact, all submitted at once.
Also: peak KV memory vs. a max-length reservation, and time to first token with a shared 512-token
system prompt, prefix caching on vs off.

    .venv/bin/python -m bench.llm_bench            # full run (~12 minutes), writes bench/results/llm_engine.*
    .venv/bin/python -m bench.llm_bench --quick    # 16 requests, no vLLM: a smoke run (llm_engine-quick.*)
    .venv/bin/python -m bench.llm_bench --threads 1  # every engine on one core (llm_engine-1thread.*): steadier
                                                     # when other work shares the machine

vLLM: needs PIER_REFERENCE_TOOLS (its vllm-reference/ holds offline_bench.py) and the venv that
`$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref` installs (or --vllm-dir); skipped with a
note when either is absent (--no-vllm skips it too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench.tools import reference_missing, reference_tool

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache" / "llm"
VLLM_REF = "vllm-reference"  # the folder in $PIER_REFERENCE_TOOLS with vLLM's scripts
VOCAB = 4096


def log(msg: str) -> None:
    print(f"[llm-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


W = TypeVar("W")


def interleaved_runs(contenders: Mapping[str, Callable[[W], dict[str, Any]]], workloads: Sequence[W],
                     label: str = "") -> dict[str, list[dict[str, Any]]]:
    """Each contender's result per round, one round per workload: in round r the contenders go in their
    order rotated by r, so each goes first in turn and a ratio within a round compares like with like."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    names = list(contenders)
    for r, work in enumerate(workloads):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            out = contenders[name](work)
            runs[name].append(out)
            ttft = f", TTFT p50 {out['ttft_p50_s']:.2f} s" if "ttft_p50_s" in out else ""
            log(f"{label}round {r}: {name}: {out['tok_s']:.1f} tok/s{ttft}")
    return runs


# -- model and workload ---------------------------------------------------------------------------

def build_model(folder: Path) -> Path:
    """The ~27 M-parameter random Llama, saved in HF format with a word-level tokenizer (ids w3..)."""
    if (folder / "config.json").is_file():
        return folder
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 256))], rng.randint(8, 256)) for _ in range(n)]


# -- Pier -----------------------------------------------------------------------------------------

def run_pier(folder: Path, reqs: list[tuple[list[int], int]], **cfg: Any) -> dict[str, Any]:
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.model_runner import kv_bytes_per_block
    from pier.backends.llm.sampling_params import SamplingParams

    eng = LLMEngine(folder, EngineConfig(**cfg))
    eng.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    eng._peak_blocks = 0
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    gen = 0
    ttft: list[float] = []
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            gen += len(out.token_ids)
            if out.finished and out.metrics and out.metrics.first_token_time:
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
        steps += 1
    wall = time.perf_counter() - t0
    stats = eng.stats()
    per_block = kv_bytes_per_block(eng.model, eng.runner.block_size)
    return {
        "generated_tokens": gen, "wall_s": wall, "tok_s": gen / wall, "steps": steps,
        "peak_kv_bytes": stats.peak_blocks_used * per_block,
        "kv_bytes_per_token": per_block // eng.runner.block_size,
        "preemptions": stats.num_preemptions, "ttft_mean_s": sum(ttft) / max(len(ttft), 1),
        "decode_attention": "compiled paged kernel" if eng.runner.decode_op is not None else "torch gather + SDPA",
    }


def pier_prefix_ttft(folder: Path, n: int, seed: int = 1) -> dict[str, dict[str, float]]:
    """Requests arriving one after another, each = a shared 512-token system prompt + its own 16-64 tokens.

    Two engines (prefix caching on / off) take turns request by request, so machine noise hits both
    alike; TTFT is the time from add_request to the first token out of step().
    """
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine
    from pier.backends.llm.sampling_params import SamplingParams

    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(512)]
    engines = {key: LLMEngine(folder, EngineConfig(enable_prefix_caching=key == "on", kv_cache_memory_bytes=256 << 20))
               for key in ("on", "off")}
    ttfts: dict[str, list[float]] = {"on": [], "off": []}
    for eng in engines.values():  # warm-up, no shared blocks
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    for i in range(n):
        prompt = system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 64))]
        for key, eng in engines.items():
            t0 = time.perf_counter()
            eng.add_request(f"p{i}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            first = None
            while eng.has_unfinished():
                outs = eng.step()
                if first is None and outs:
                    first = time.perf_counter() - t0
            ttfts[key].append(first or 0.0)
    res = {}
    for key, vals in ttfts.items():
        later = sorted(vals[1:])  # the first request fills the cache either way
        res[key] = {"ttft_mean_s": sum(later) / len(later), "ttft_p50_s": later[len(later) // 2],
                    "first_request_ttft_s": vals[0], "prefix_hits_tokens": engines[key].stats().prefix_cache_hits}
    return res


# -- transformers ---------------------------------------------------------------------------------

def _hf_model(folder: Path):  # noqa: ANN202
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def run_hf_sequential(folder: Path, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    model = _hf_model(folder)
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        gen = 0
        t0 = time.perf_counter()
        for prompt, out_len in reqs:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                 do_sample=False, pad_token_id=0)
            gen += out.shape[1] - len(prompt)
        wall = time.perf_counter() - t0
    return {"generated_tokens": gen, "wall_s": wall, "tok_s": gen / wall}


def run_hf_static(folder: Path, reqs: list[tuple[list[int], int]], batch: int = 8) -> dict[str, Any]:
    """Static batches in arrival order, left-padded; a batch runs until its longest output.

    Only each request's own output length counts as generated (a static server would cut the rest).
    """
    model = _hf_model(folder)
    useful = 0
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:16]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch):
            group = reqs[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for j, (p, _) in enumerate(group):
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group), do_sample=False,
                           pad_token_id=0)
            useful += sum(n for _, n in group)
        wall = time.perf_counter() - t0
    return {"generated_tokens": useful, "wall_s": wall, "tok_s": useful / wall}


# -- vLLM -----------------------------------------------------------------------------------------

def vllm_tools() -> Path | None:
    """$PIER_REFERENCE_TOOLS/vllm-reference (install.sh, offline_bench.py, serve.sh, stop.sh), or None."""
    return reference_tool(VLLM_REF)


def vllm_unavailable(vllm_dir: Path, *scripts: str) -> str | None:
    """Why the vLLM row is skipped (a note for the report), or None when the scripts and venv are there."""
    tools = vllm_tools()
    if tools is None:
        return reference_missing(VLLM_REF, "vLLM")
    missing = [s for s in scripts if not (tools / s).is_file()]
    if missing:
        return f"skipped: no {', '.join(missing)} in {tools}"
    if not (vllm_dir / "venv" / "bin" / "python").is_file():
        return f"skipped: no vLLM reference venv at {vllm_dir} (install with {tools}/install.sh {vllm_dir})"
    return None


def run_vllm(folder: Path, reqs: list[tuple[list[int], int]], vllm_dir: Path) -> dict[str, Any] | str:
    why = vllm_unavailable(vllm_dir, "offline_bench.py")
    if why is not None:
        return why
    tools = vllm_tools()
    assert tools is not None
    python = vllm_dir / "venv" / "bin" / "python"
    script = tools / "offline_bench.py"
    with tempfile.TemporaryDirectory() as tmp:
        req_file, out_file = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        req_file.write_text(json.dumps([{"prompt_token_ids": p, "max_tokens": n} for p, n in reqs]))
        cmd = [str(python), str(script), str(folder), str(req_file), str(out_file), "--block-size", "32"]
        log("vLLM: " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not out_file.is_file():
            return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}"
        res = json.loads(out_file.read_text())
    return {"generated_tokens": res["generated_tokens"], "wall_s": res["wall_s"], "tok_s": res["gen_tok_per_s"],
            "engine": res["engine"], "settings": res["settings"]}


# -- report ---------------------------------------------------------------------------------------

def write_report(res: dict[str, Any], name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    thr = res["throughput"]
    pier = thr["pier"]["tok_s"]
    lines = [f"# LLM engine: {res['workload']}", "", f"Machine: {res['machine']}. One run; noisy 2-core CPU. "
             "Every engine runs once per round, rounds alternate; each row is the median round (all listed); "
             "Pier ÷ this is the median of the per-round ratios.", "",
             "| engine | generated tokens | wall s | output tok/s | Pier ÷ this |", "|---|---|---|---|---|"]
    for key, label in (("pier", "Pier engine (continuous batching, paged KV)"),
                       ("hf_sequential", "transformers generate, one request at a time"),
                       ("hf_static8", "transformers generate, static batches of 8 (left-padded)"),
                       ("vllm", "vLLM (CPU build) offline, all at once")):
        r = thr.get(key)
        if isinstance(r, dict):
            each = f" (rounds: {' / '.join(str(x) for x in r['rounds_tok_s'])})" if "rounds_tok_s" in r else ""
            lines.append(f"| {label} | {r['generated_tokens']} | {r['wall_s']:.2f} | {r['tok_s']:.1f}{each} | "
                         f"{r.get('ratio') or pier / r['tok_s']:.2f}x |")
        elif r is not None:
            lines.append(f"| {label} | – | – | – | {r} |")
    kv = res["kv_memory"]
    pt = res["prefix_ttft"]
    lines += ["", "## KV memory", "",
              f"- peak KV memory used by Pier: {kv['peak_mib']:.1f} MiB",
              f"- max-length reservation ({kv['num_requests']} requests x {kv['max_model_len']} tokens): "
              f"{kv['reservation_mib']:.1f} MiB ({kv['reservation_mib'] / max(kv['peak_mib'], 1e-9):.1f}x more)",
              f"- exact per-request reservation (prompt + max_tokens each): {kv['exact_reservation_mib']:.1f} MiB",
              "", "## Time to first token, shared 512-token system prompt (requests one after another)", "",
              "| prefix caching | mean TTFT ms | p50 TTFT ms | first request ms |", "|---|---|---|---|"]
    for key in ("on", "off"):
        p = pt[key]
        lines.append(f"| {key} | {p['ttft_mean_s'] * 1e3:.1f} | {p['ttft_p50_s'] * 1e3:.1f} | "
                     f"{p['first_request_ttft_s'] * 1e3:.1f} |")
    targets = res["targets"]
    lines += ["", "## Targets", ""]
    for t in targets:
        verdict = "n/a" if t["value"] is None else ("MET" if t["value"] >= t["threshold"] else "MISSED")
        val = "–" if t["value"] is None else f"{t['value']:.2f}x"
        lines.append(f"- {t['text']}: {val} ({verdict})")
    lines += ["", "## Notes", "", *[f"- {n}" for n in res["notes"]]]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        labels, vals = [], []
        for key, label in (("pier", "Pier"), ("vllm", "vLLM"), ("hf_static8", "HF static x8"),
                           ("hf_sequential", "HF sequential")):
            r = thr.get(key)
            if isinstance(r, dict):
                labels.append(label)
                vals.append(r["tok_s"])
        a1.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:gray", "tab:gray"][: len(vals)])
        a1.set_ylabel("output tokens/s")
        a1.set_title("64 requests at once (greedy, exact lengths)")
        a2.bar(["caching on", "caching off"], [pt["on"]["ttft_mean_s"] * 1e3, pt["off"]["ttft_mean_s"] * 1e3],
               color=["tab:blue", "tab:gray"])
        a2.set_ylabel("mean TTFT ms")
        a2.set_title("512-token shared system prompt")
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=110)
    except ImportError:
        log("matplotlib missing: no PNG")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-dir", type=Path, default=Path(os.path.expanduser("~/vllm-ref")))
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every engine, alternating (median reported)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for Pier and transformers, and cores bound for vLLM (default: all)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{a.threads - 1}"
    load_start = os.getloadavg()[0]
    n = a.requests or (16 if a.quick else 64)
    name = "llm_engine-quick" if a.quick else "llm_engine"
    if a.threads:
        name += f"-{a.threads}thread"
    folder = build_model(CACHE / "llama27m")
    reqs = workload(n)
    total_out = sum(o for _, o in reqs)
    log(f"{n} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, {total_out} output tokens")
    max_model_len = 512
    pier_cfg = dict(kv_cache_memory_bytes=512 << 20, max_num_seqs=256, max_num_batched_tokens=2048,
                    max_model_len=max_model_len)
    thr: dict[str, Any] = {}
    notes = []
    # This machine's speed drifts by 20 % within minutes (other sessions share it), so every engine
    # runs once per round, the rounds alternate, and each engine reports its median round (every
    # round is kept in the JSON and listed in the table). Ratios are the median of the per-round
    # ratios: each compares engines that shared the same stretch of machine time.
    engines: list[tuple[str, Any]] = [
        ("pier", lambda: run_pier(folder, reqs, **pier_cfg)),
        ("vllm", lambda: run_vllm(folder, reqs, a.vllm_dir)),
        ("hf_static8", lambda: run_hf_static(folder, reqs)),
        ("hf_sequential", lambda: run_hf_sequential(folder, reqs)),
    ]
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key, _ in engines}
    if a.no_vllm or a.quick:
        thr["vllm"] = "skipped (--no-vllm / --quick)"
    for r in range(a.rounds):
        for key, run in engines:
            if key in thr:  # vLLM skipped or not installed
                continue
            log(f"round {r + 1}/{a.rounds}: {key} ...")
            res_r = run()
            if isinstance(res_r, str):
                thr[key] = res_r
                continue
            rounds[key].append(res_r)
            log(f"  {res_r['tok_s']:.1f} tok/s")
    per_round = [
        f"{key}: " + " / ".join(f"{p['tok_s'] / x['tok_s']:.2f}x" for p, x in zip(rounds["pier"], runs))
        for key, runs in rounds.items() if key != "pier" and runs
    ]
    if per_round:
        notes.append("Pier ÷ each engine within each round (same stretch of time): " + "; ".join(per_round) + ".")
    for key, runs in rounds.items():
        if runs:
            thr[key] = dict(sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2],
                            rounds_tok_s=[round(x["tok_s"], 1) for x in runs])
    log("prefix-caching TTFT ...")
    pt = pier_prefix_ttft(folder, 6 if a.quick else 16)
    per_tok = thr["pier"]["kv_bytes_per_token"]
    kv = {"peak_mib": thr["pier"]["peak_kv_bytes"] / 2**20, "num_requests": n, "max_model_len": max_model_len,
          "reservation_mib": n * max_model_len * per_tok / 2**20,
          "exact_reservation_mib": sum(len(p) + o for p, o in reqs) * per_tok / 2**20}
    pier = thr["pier"]["tok_s"]

    def ratio(key: str) -> float | None:
        """The median of Pier ÷ engine within each round (paired: the same stretch of machine
        time), as bench/report.py computes its ratios; else the ratio of the median rounds."""
        runs, r = rounds.get(key) or [], thr.get(key)
        if len(runs) >= 2 and len(runs) == len(rounds["pier"]):
            return statistics.median(p["tok_s"] / x["tok_s"] for p, x in zip(rounds["pier"], runs))
        return pier / r["tok_s"] if isinstance(r, dict) else None

    for key, r in thr.items():
        if isinstance(r, dict):
            r["ratio"] = ratio(key)

    targets = [
        {"text": "Pier ≥ 3x transformers static batches of 8", "value": ratio("hf_static8"), "threshold": 3.0},
        {"text": "Pier ≥ 10x transformers sequential", "value": ratio("hf_sequential"), "threshold": 10.0},
        {"text": "Pier ≥ 1.0x vLLM", "value": ratio("vllm"), "threshold": 1.0},
        {"text": "TTFT with prefix caching ≥ 3x faster than without",
         "value": pt["off"]["ttft_mean_s"] / pt["on"]["ttft_mean_s"], "threshold": 3.0},
    ]
    notes += [
        "Model: random-weight Llama, hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376, vocab 4096 "
        "(27.4 M parameters), float32; requests: token ids, greedy, ignore_eos (exact lengths).",
        f"Pier settings: {pier_cfg}, block_size 16, prefix caching on; torch threads {torch.get_num_threads()}; "
        f"decode attention: {thr['pier']['decode_attention']}.",
        "transformers: same weights, generate() with the KV cache, eos disabled; static batches take requests "
        "in arrival order and count only each request's own output length.",
        ("vLLM: $PIER_REFERENCE_TOOLS/vllm-reference/offline_bench.py (vllm-cpu, block size 32, all cores bound, "
         "prefix caching on); its wall time covers generate() only, after engine start and a warm-up."
         if isinstance(thr.get("vllm"), dict) else f"vLLM: {thr.get('vllm')}."),
        "TTFT: each request = the same 512 tokens + 16-64 own tokens, sent after the previous one finished, to "
        "two engines (caching on / off) in turn; mean/p50 over all but the first request (which fills the cache).",
        "The same workload through the OpenAI API at 32 concurrent streams: bench/llm_openai_bench.py "
        "(results/llm_openai.md).",
    ]
    res = {"workload": f"{n} requests, prompts 16-256, outputs 8-256 tokens ({total_out} in all), at once",
           "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads, "
                      f"1-min load average {load_start:.2f} at the start and {os.getloadavg()[0]:.2f} at the end "
                      "(other sessions share this machine)",
           "throughput": thr, "kv_memory": kv, "prefix_ttft": pt, "targets": targets, "notes": notes}
    write_report(res, name)
    log(f"wrote {RESULTS / name}.md")
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
