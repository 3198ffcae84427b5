"""The LLM engine in its own process (issue 22): the mixed workload through the OpenAI API against
the same engine offline, in one run.

The workload of bench/llm_bench.py (the ~27 M-parameter random Llama; 64 requests, prompts 16-256
tokens as token ids, outputs 8-256 tokens, greedy, ignore_eos), all 64 sent at once as OpenAI
streams (`stream: true`, usage included) by the official SDK. Contenders, interleaved round by round
(every contender runs each round's workload before the next round starts; the first to run rotates):

- offline: Pier's LLMEngine driven step by step in this process (no server) — the ceiling (with
  `--baseline`, in a process of its own, beside the same for the baseline revision's engine);
- pier (process): `pier serve`, engine_core "process" (the default): the engine in its own process;
- pier (thread): `pier serve`, engine_core "thread": the engine on a thread of the server process;
- vLLM: vLLM's OpenAI server (CPU build) on the same folder, when the reference tools are here.

Reported: output tok/s and TTFT p50/p99 (median round, every round listed), and per-round ratios
(median, min-max): pier/offline, pier/vLLM, TTFT p99 vLLM/pier.

    .venv/bin/python -m bench.llm_process              # writes bench/results/llm_process.{md,json,png}
    .venv/bin/python -m bench.llm_process --quick      # 16 requests, 2 rounds, no vLLM
    .venv/bin/python -m bench.llm_process --baseline REV --no-vllm --no-thread --name NAME
                                                       # this checkout against revision REV, interleaved
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import free_port, loadavg, machine
from bench.llm_bench import CACHE, RESULTS, ROOT, build_model, interleaved_runs, log, vllm_unavailable, workload
from bench.llm_bench import run_pier as run_offline
from bench.llm_openai_bench import MODEL, VllmServer, _drive, _wait_models
from bench.revisions import old_pier_path, worktree

Workload = list[tuple[list[int], int]]


class PierServer:
    def __init__(self, folder: Path, engine_core: str, tmp: Path, label: str = "", pythonpath: Path | None = None,
                 params: dict[str, str] | None = None) -> None:
        """`params`: more config.pbtxt parameters (e.g. {"dtype": "bfloat16"})."""
        label = label or engine_core
        repo = tmp / f"repo-{label}"
        (repo / MODEL).mkdir(parents=True)
        os.symlink(folder, repo / MODEL / "1")
        (repo / MODEL / "config.pbtxt").write_text(
            'backend: "llm"\n'
            'parameters { key: "kv_cache_memory_bytes" value { string_value: "1073741824" } }\n'
            f'parameters {{ key: "engine_core" value {{ string_value: "{engine_core}" }} }}\n' +
            "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
                    for k, v in (params or {}).items()))
        http, grpc_, metrics = free_port(), free_port(), free_port()
        self.log = open(tmp / f"pier-{label}.log", "wb")
        env = dict(os.environ)
        if pythonpath is not None:  # another revision's code; its compiled kernels kept apart
            env.update(PYTHONPATH=str(pythonpath), TORCH_EXTENSIONS_DIR=str(tmp / f"ext-{label}"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pier", "serve", f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc_}", f"--metrics-port={metrics}", "--http-address=127.0.0.1",
             "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{http}"
        _wait_models(self.base, 300, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _client_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _served(base: str, streams: int, pid: int | None = None) -> Callable[[Workload], dict[str, Any]]:
    """`pid`: the server's, to count where the CPU went (the server, its engine core, this client)."""
    def run(reqs: Workload) -> dict[str, Any]:
        procs = [] if pid is None else [pid, *_children(pid)]
        before, client = [_cpu_s(p) for p in procs], _client_cpu_s()
        r = asyncio.run(_drive(base, reqs, streams))
        if r["errors"]:
            raise RuntimeError(f"{base}: {r['errors']}")
        r["cpu_client_s"] = _client_cpu_s() - client
        if procs:
            used = [_cpu_s(p) - b for p, b in zip(procs, before)]
            r["cpu_server_s"], r["cpu_children_s"] = used[0], sum(used[1:])
        return r
    return run


def _offline(folder: Path) -> Callable[[Workload], dict[str, Any]]:
    def run(reqs: Workload) -> dict[str, Any]:
        client = _client_cpu_s()
        r = run_offline(folder, reqs, kv_cache_memory_bytes=1 << 30)
        return {"tok_s": r["tok_s"], "wall_s": r["wall_s"], "tokens": r["generated_tokens"],
                "ttft_p50_s": float("nan"), "ttft_p99_s": float("nan"), "requests": len(reqs),
                "cpu_client_s": _client_cpu_s() - client}
    return run


_OFFLINE_CHILD = """
import json, sys, time
from pier.backends.llm.config import EngineConfig
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.sampling_params import SamplingParams
folder, kv, extra = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
eng = LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=kv, **extra))
eng.generate([list(range(1, 17))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
print("ready", flush=True)
for line in sys.stdin:
    reqs = json.loads(line)
    t0, gen = time.perf_counter(), 0
    for i, (prompt, out_len) in enumerate(reqs):
        eng.add_request(f"r{t0}-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        gen += sum(len(o.token_ids) for o in eng.step())
    print(json.dumps({"tokens": gen, "wall_s": time.perf_counter() - t0}), flush=True)
"""


class OfflineProcess:
    """The offline engine of a revision (`pythonpath`: another revision's code; None: this
    checkout's) in a process of its own, driven with only the engine API every revision has
    (LLMEngine, EngineConfig, SamplingParams, add_request / step / has_unfinished), so that two
    revisions' engines run under the same conditions."""

    def __init__(self, folder: Path, tmp: Path, label: str, pythonpath: Path | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """`config`: more EngineConfig settings (e.g. {"dtype": "bfloat16"})."""
        env = dict(os.environ)
        if pythonpath is not None:
            env.update(PYTHONPATH=str(pythonpath), TORCH_EXTENSIONS_DIR=str(tmp / f"ext-offline-{label}"))
        self.proc = subprocess.Popen([sys.executable, "-c", _OFFLINE_CHILD, str(folder), str(1 << 30),
                                      json.dumps(config or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the offline engine ({label}) did not start")

    def __call__(self, reqs: Workload) -> dict[str, Any]:
        assert self.proc.stdout is not None and self.proc.stdin is not None
        before = _cpu_s(self.proc.pid)
        self.proc.stdin.write(json.dumps(reqs) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return {"tok_s": r["tokens"] / r["wall_s"], "wall_s": r["wall_s"], "tokens": r["tokens"],
                "ttft_p50_s": float("nan"), "ttft_p99_s": float("nan"), "requests": len(reqs),
                "cpu_children_s": _cpu_s(self.proc.pid) - before}

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f}x (rounds {min(values):.2f}-{max(values):.2f})"


def write_report(res: dict[str, Any], name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    rows = ["| contender | output tok/s, median (each round) | TTFT p50 | TTFT p99 | CPU s: server / engine process / "
            "load generator (median round) |", "|---|---|---|---|---|"]
    for label, runs in res["runs"].items():
        if isinstance(runs, str):
            rows.append(f"| {label} | {runs} | | | |")
            continue
        med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
        each = " / ".join(f"{r['tok_s']:.0f}" for r in runs)
        ttft = ("—", "—") if med["ttft_p50_s"] != med["ttft_p50_s"] else (
            f"{med['ttft_p50_s']:.3f} s", f"{med['ttft_p99_s']:.3f} s")
        cpu = " / ".join("—" if k not in med else f"{med[k]:.1f}"
                         for k in ("cpu_server_s", "cpu_children_s", "cpu_client_s"))
        rows.append(f"| {label} | {med['tok_s']:.1f} ({each}) | {ttft[0]} | {ttft[1]} | {cpu} |")
    lines = [f"# LLM serving with the engine in its own process ({res['requests']} requests, all at once)", "",
             res["workload"], "", f"Machine: {res['machine']}; load average {res['load_start']} at the start, "
             f"{res['load_end']} at the end.", "", *rows, "", "Per-round ratios (median, min-max over rounds):", ""]
    for text, values in res["ratios"].items():
        lines.append(f"- {text}: {_spread(values)}")
    lines += ["", "CPU seconds are per round, from /proc (server: the `pier serve` process; engine process: its "
              "children, i.e. the engine core in `process` mode; load generator: this bench's own process, the "
              "openai SDK parsing every streamed chunk, or the offline engine itself). On a 2-core machine the "
              "three share two cores: what the load generator and the server take is what the engine loses.",
              "", "Measured with `python -m bench.llm_process` (one run; contenders interleaved round by round). "
              "Ratios only: absolute figures depend on the machine and its load.", ""]
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        served = [(k, v) for k, v in res["runs"].items() if not isinstance(v, str)]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, (k, runs) in enumerate(served):
            ax.scatter([i] * len(runs), [r["tok_s"] for r in runs], color="#888", s=12)
            ax.bar(i, statistics.median(r["tok_s"] for r in runs), color="#2a6" if "pier" in k else "#999")
        ax.set_xticks(range(len(served)), [k for k, _ in served], fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{res['requests']} requests at once (bars: median round; dots: rounds)")
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=100)
    except ImportError:
        pass
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-thread", action="store_true", help="leave out the engine-on-a-thread server")
    ap.add_argument("--vllm-dir", type=Path, default=Path(os.path.expanduser("~/vllm-ref")))
    ap.add_argument("--rounds", type=int, default=0, help="default 3 (2 with --quick)")
    ap.add_argument("--baseline", metavar="REV", help="also serve revision REV (engine_core process), interleaved: "
                    "the before/after of a change")
    ap.add_argument("--name", help="results file name (default llm_process[-quick])")
    a = ap.parse_args()
    n = 16 if a.quick else 64
    rounds = a.rounds or (2 if a.quick else 3)
    folder = build_model(CACHE / "llama27m")
    workloads = [workload(n, seed) for seed in range(rounds)]
    res: dict[str, Any] = {
        "requests": n, "machine": machine(), "load_start": loadavg(),
        "workload": (f"Prompts 16-256 tokens (token ids), outputs 8-256 tokens (seed 0: "
                     f"{sum(o for _, o in workloads[0])} in all), greedy, ignore_eos; all {n} streams at once; "
                     f"{rounds} rounds with seeds 0-{rounds - 1}, the same for every contender."),
        "runs": {}}
    contenders: dict[str, Callable[[Workload], dict[str, Any]]] = {"offline engine": _offline(folder)}
    servers: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        try:
            for mode in ("process",) + (() if a.no_thread else ("thread",)):
                log(f"starting pier serve (engine_core {mode})")
                s = PierServer(folder, mode, Path(tmp))
                servers.append(s)
                contenders[f"pier ({mode})"] = _served(s.base, n, s.proc.pid)
            if a.baseline:
                tree = stack.enter_context(worktree(a.baseline))
                old_path = old_pier_path(tree, Path(tmp) / "old")
                label = f"pier {a.baseline} (process)"
                log(f"starting {label}")
                s = PierServer(folder, "process", Path(tmp), "baseline", old_path)
                servers.append(s)
                contenders[label] = _served(s.base, n, s.proc.pid)
                res["baseline"] = a.baseline
                log("starting the two offline engines, each in a process of its own")
                del contenders["offline engine"]
                for key, path in (("offline engine", None), (f"offline engine {a.baseline}", old_path)):
                    o = OfflineProcess(folder, Path(tmp), key.replace(" ", "-"), path)
                    servers.append(o)
                    contenders[key] = o
            why = "skipped (--quick / --no-vllm)" if a.quick or a.no_vllm else vllm_unavailable(
                a.vllm_dir, "serve.sh", "stop.sh")
            if why is None:
                log("starting vLLM's OpenAI server (about a minute)")
                try:
                    v = VllmServer(folder, a.vllm_dir)
                    servers.append(v)
                    contenders["vLLM OpenAI server"] = _served(v.base, n)
                except RuntimeError as exc:
                    why = str(exc)
            if why is not None:
                res["runs"]["vLLM OpenAI server"] = why
            for run in contenders.values():  # warm-up: first requests compile kernels, fill caches
                run(workload(4, 99))
            runs = interleaved_runs(contenders, workloads)
        finally:
            for s in servers:
                s.stop()
    res["runs"] = {**runs, **res["runs"]}
    res["load_end"] = loadavg()

    def per_round(a_: str, b_: str, key: str = "tok_s", invert: bool = False) -> list[float]:
        if a_ not in runs or b_ not in runs:
            return []
        pairs = zip(runs[a_], runs[b_])
        return [(q[key] / p[key]) if invert else (p[key] / q[key]) for p, q in pairs]

    res["ratios"] = {
        "pier (process) / offline engine (target >= 0.85)": per_round("pier (process)", "offline engine"),
        "pier (thread) / offline engine": per_round("pier (thread)", "offline engine"),
        "pier (process) / pier (thread)": per_round("pier (process)", "pier (thread)"),
        "pier (process) / vLLM OpenAI server, throughput (target >= 1.5)": per_round("pier (process)",
                                                                                      "vLLM OpenAI server"),
        "TTFT p99, vLLM / pier (process) (target >= 1.0)": per_round("pier (process)", "vLLM OpenAI server",
                                                                     "ttft_p99_s", invert=True),
    }
    if a.baseline:
        res["ratios"][f"pier (process) / pier {a.baseline} (process), throughput"] = per_round(
            "pier (process)", f"pier {a.baseline} (process)")
        res["ratios"][f"TTFT p50, pier {a.baseline} / pier (process)"] = per_round(
            "pier (process)", f"pier {a.baseline} (process)", "ttft_p50_s", invert=True)
        res["ratios"][f"offline engine / offline engine {a.baseline}, throughput"] = per_round(
            "offline engine", f"offline engine {a.baseline}")
    md = write_report(res, a.name or ("llm_process-quick" if a.quick else "llm_process"))
    print(md.read_text())


if __name__ == "__main__":
    main()
