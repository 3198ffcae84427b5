"""LLM serving through the OpenAI API (issue 6): Pier's `pier serve` vs vLLM's OpenAI server, one
run, same model and requests, on this CPU. The workload of bench/llm_bench.py (the ~27 M-parameter
random Llama; 64 requests, prompts 16-256 tokens given as token ids, outputs 8-256 tokens, greedy,
ignore_eos so lengths are exact), sent by the official `openai` SDK as 32 concurrent streams
(`stream: true`, usage included). Reported per server: output tokens/s over the whole run, time to
first token p50/p99 and end-to-end latency p50/p99 per request.

    .venv/bin/python -m bench.llm_openai_bench            # writes bench/results/llm_openai.{md,json,png}
    .venv/bin/python -m bench.llm_openai_bench --quick    # 16 requests, 8 streams, no vLLM

vLLM: needs PIER_REFERENCE_TOOLS (its vllm-reference/ holds serve.sh / stop.sh) and the venv that
`$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref` installs (or --vllm-dir); skipped with a
note when either is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import free_port
from bench.llm_bench import CACHE, RESULTS, ROOT, build_model, log, vllm_tools, vllm_unavailable, workload

MODEL = "llama27m"


def _wait_models(base: str, timeout: float, proc: subprocess.Popen) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                if MODEL in r.read().decode():
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no /v1/models answer from {base} after {timeout}s")


async def _drive(base: str, reqs: list[tuple[list[int], int]], streams: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(streams)
    ttft: list[float] = []
    e2e: list[float] = []
    tokens = 0
    errors: list[str] = []

    async def one(prompt: list[int], out_len: int) -> None:
        nonlocal tokens
        async with gate:
            start = time.perf_counter()
            first = None
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=out_len, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - start
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            except Exception as exc:  # a failed request is reported, not hidden
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            e2e.append(time.perf_counter() - start)
            if first is not None:
                ttft.append(first)

    await one(reqs[0][0][:16], 4)  # warm-up, not measured
    ttft.clear()
    e2e.clear()
    tokens = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in reqs))
    wall = time.perf_counter() - t0
    await client.close()

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")

    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "requests": len(e2e), "errors": errors[:5],
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "e2e_p50_s": pct(e2e, 0.5),
            "e2e_p99_s": pct(e2e, 0.99)}


Workloads = list[list[tuple[list[int], int]]]


def _drive_rounds(base: str, workloads: Workloads, streams: int) -> dict[str, Any]:
    """One round per workload against the running server; the median round, with every round's tok/s.

    The machine's speed drifts by 20 % within minutes: a median of three ~15 s rounds damps that."""
    runs = [asyncio.run(_drive(base, reqs, streams)) for reqs in workloads]
    for r in runs:
        log(f"    round: {r['tok_s']:.1f} tok/s")
    median = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])
    median["rounds_tok_s"] = [round(r["tok_s"], 1) for r in runs]
    return median


def write_repo(repo: Path, folder: Path) -> Path:
    """A model repository `repo` that serves the model `folder` as MODEL (backend "llm", 1 GiB of KV cache)."""
    (repo / MODEL).mkdir(parents=True)
    os.symlink(folder, repo / MODEL / "1")
    (repo / MODEL / "config.pbtxt").write_text(
        'backend: "llm"\nparameters { key: "kv_cache_memory_bytes" value { string_value: "1073741824" } }\n')
    return repo


def run_pier(folder: Path, workloads: Workloads, streams: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        repo = write_repo(Path(tmp) / "repo", folder)
        http, grpc_, metrics = free_port(), free_port(), free_port()
        log_file = open(Path(tmp) / "pier.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pier", "serve", f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc_}", f"--metrics-port={metrics}", "--http-address=127.0.0.1",
             "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{http}"
        try:
            _wait_models(base, 180, proc)
            return _drive_rounds(base, workloads, streams)
        finally:
            proc.terminate()
            proc.wait(60)


class VllmServer:
    def __init__(self, folder: Path, vllm_dir: Path, extra: tuple[str, ...] = ()) -> None:
        """`extra`: more vLLM server arguments (serve.sh passes them last, e.g. `--dtype bfloat16`)."""
        tools = vllm_tools()
        assert tools is not None
        self.tools, self.vllm_dir = tools, vllm_dir
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["WAIT_S"] = "600"
        started = subprocess.run(["bash", str(tools / "serve.sh"), str(vllm_dir), str(folder), str(port),
                                  "--served-model-name", MODEL, "--block-size", "32", *extra],
                                 capture_output=True, text=True, env=env, timeout=900, check=False)
        if started.returncode != 0:
            self.stop()
            raise RuntimeError(f"vLLM failed to start: {(started.stderr or started.stdout).strip()[-300:]}")
        self.base = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        subprocess.run(["bash", str(self.tools / "stop.sh"), str(self.vllm_dir)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)


def run_vllm(folder: Path, workloads: Workloads, streams: int, vllm_dir: Path) -> dict[str, Any] | str:
    why = vllm_unavailable(vllm_dir, "serve.sh", "stop.sh")
    if why is not None:
        return why
    try:
        server = VllmServer(folder, vllm_dir)
    except RuntimeError as exc:
        return str(exc)
    try:
        return _drive_rounds(server.base, workloads, streams)
    finally:
        server.stop()


def write_report(res: dict[str, Any], name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    rows = ["| server | output tok/s (each round) | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | requests |",
            "|---|---|---|---|---|---|---|"]
    for key, label in (("pier", "Pier (`pier serve`, OpenAI API)"), ("vllm", "vLLM OpenAI server (CPU build)")):
        r = res[key]
        if isinstance(r, str):
            rows.append(f"| {label} | {r} | | | | | |")
            continue
        each = f" ({' / '.join(str(x) for x in r['rounds_tok_s'])})" if "rounds_tok_s" in r else ""
        rows.append(f"| {label} | {r['tok_s']:.1f}{each} | {r['ttft_p50_s']:.3f} s | {r['ttft_p99_s']:.3f} s | "
                    f"{r['e2e_p50_s']:.2f} s | {r['e2e_p99_s']:.2f} s | {r['requests']} |")
    ratio = ""
    if isinstance(res["vllm"], dict):
        p, v = res["pier"], res["vllm"]
        ratio = (f"\nPier / vLLM: throughput {p['tok_s'] / v['tok_s']:.2f}x, TTFT p50 "
                 f"{v['ttft_p50_s'] / p['ttft_p50_s']:.2f}x as fast, TTFT p99 {v['ttft_p99_s'] / p['ttft_p99_s']:.2f}x "
                 "as fast.\n")
    text = (f"# LLM serving through the OpenAI API ({res['requests']} requests, {res['streams']} concurrent "
            f"streams)\n\n{res['workload']}\n\n" + "\n".join(rows) + "\n" + ratio +
            "\nMeasured with `python -m bench.llm_openai_bench` (one run, both servers on the same machine, "
            "one after the other). Ratios only: absolute figures depend on the machine and its load.\n")
    (RESULTS / f"{name}.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        servers = [(k, res[k]) for k in ("pier", "vllm") if isinstance(res[k], dict)]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].bar([k for k, _ in servers], [r["tok_s"] for _, r in servers], color=["#2a6", "#888"][:len(servers)])
        axes[0].set_title("output tokens/s")
        for i, (_, r) in enumerate(servers):
            axes[1].bar([i - 0.2, i + 0.2], [r["ttft_p50_s"], r["ttft_p99_s"]], width=0.4,
                        color=["#2a6", "#a62"], label=["p50", "p99"] if i == 0 else None)
        axes[1].set_xticks(range(len(servers)), [k for k, _ in servers])
        axes[1].set_title("time to first token (s)")
        axes[1].legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=100)
    except ImportError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-dir", type=Path, default=Path(os.path.expanduser("~/vllm-ref")))
    ap.add_argument("--rounds", type=int, default=3, help="workloads (seeds 0..N-1) per server; median reported")
    a = ap.parse_args()
    n, streams = (16, 8) if a.quick else (64, 32)
    folder = build_model(CACHE / "llama27m")
    workloads = [workload(n, seed) for seed in range(a.rounds)]
    res: dict[str, Any] = {"requests": n, "streams": streams,
                           "workload": f"Prompts 16-256 tokens (sent as token ids), outputs 8-256 tokens "
                                       f"(seed 0: {sum(o for _, o in workloads[0])} in all), greedy, ignore_eos; "
                                       f"{a.rounds} rounds with seeds 0-{a.rounds - 1}, the same for both servers, "
                                       "median round shown."}
    log(f"Pier: {n} requests, {streams} streams")
    res["pier"] = run_pier(folder, workloads, streams)
    log(f"  {res['pier']['tok_s']:.1f} tok/s")
    if a.no_vllm or a.quick:
        res["vllm"] = "skipped (--no-vllm / --quick)"
    else:
        log("vLLM OpenAI server (engine start takes about a minute)")
        res["vllm"] = run_vllm(folder, workloads, streams, a.vllm_dir)
        log(f"  {res['vllm'] if isinstance(res['vllm'], str) else round(res['vllm']['tok_s'], 1)}")
    write_report(res, "llm_openai-quick" if a.quick else "llm_openai")
    print((RESULTS / ("llm_openai-quick.md" if a.quick else "llm_openai.md")).read_text())


if __name__ == "__main__":
    main()
