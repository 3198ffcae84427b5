"""A/B check of a refactor: the server of an older revision (old) against this checkout's Pier (new),
on the same machine at the same time, rounds interleaved so that the machine's drift cancels.

    .venv/bin/python -m bench.ab                        # old = a9568b8, 3 rounds, full windows
    .venv/bin/python -m bench.ab --old REV --rounds 5
    .venv/bin/python -m bench.ab --quick                # 1 round, short windows: a smoke run
    .venv/bin/python -m bench.ab --only identity        # or llm, sequence; comma-separated
    .venv/bin/python -m bench.ab --only sequence --out sequence_ab   # results under another name
    .venv/bin/python -m bench.ab --only identity --serve-arg=--frontend-processes=2   # both sides so

The old revision is checked out with `git worktree add --detach` in a temporary folder and served
from there as `python -m server serve` (cwd and PYTHONPATH = that folder: before the restructuring
the code imported `server` / `backends` top-level); the new one is bench.common's Pier command (the
installed `pier`). Both serve copies of the same model repository on free loopback ports and stay up
for the whole of their benchmark:

- identity: perf_analyzer on `identity_fp32` (batch 1, INPUT0 [16] FP32) over HTTP and gRPC at
  concurrency 1 and 8, with bench/identity.py's windows (bench.common.Settings, quick or full);
- python: the same points on bench/python_backend_process.py's python-backend identity model in
  its stub process (Pier's default execution mode);
- sequence: perf_analyzer on the example's stateful `accumulate` (sequence batcher, direct strategy,
  implicit state; perf_analyzer sends sequences of 20 requests, each concurrent client its own
  sequence) over gRPC: one instance at concurrency 1 and 8, and a copy with two instances at 8
  (where a sequence stays on its instance since issue 31);
- llm: bench/llm_openai_bench.py's OpenAI-API workload (the random ~27 M-parameter Llama of
  bench/llm_bench.py, greedy, ignore_eos, 32 concurrent streams, usage included): output tokens/s and
  time to first token p50; 64 requests per round (32 with --quick), round r uses workload seed r
  on both sides.

Every point is measured once per side per round, in ABBA order (round 1 old then new, round 2 new
then old, ...). The per-round ratio is new / old; the report gives its median and min-max, each
side's median throughput and p50 latency, and every round's ratio. Writes
bench/results/refactor_ab[-quick].{md,json,png} (or `--out NAME`). Servers are stopped and the worktree removed on
errors, Ctrl-C and SIGTERM too. Exit status 1 when a benchmark could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import report
from bench.common import ROOT, Settings, git_describe, loadavg, log, machine, pier_command, sigterm_as_interrupt
from bench.measure import alternate, fmt_ms, fmt_rate, perf_analyzer_point
from bench.python_backend_process import CONFIG as PYTHON_CONFIG
from bench.python_backend_process import MODEL_PY
from bench.report import finish, ratio_cells, ratio_reading
from bench.revisions import check_old_imports, describe_head, git, start_old, worktree
from bench.server_cpu import metered
from bench.servers import Server, Servers, measure, ready_or_stopped, start_pier
from bench.tools import PERF_ANALYZER_MISSING, perf_analyzer

DEFAULT_OLD = "a9568b8"
BENCHMARKS = ("identity", "python", "sequence", "llm")
IDENTITY_MODEL = "identity_fp32"
PYTHON_MODEL = "identity_fp32"  # the python-backend one, in a repository of its own
IDENTITY_POINTS = [("http", 1), ("http", 8), ("grpc", 1), ("grpc", 8)]
SEQUENCE_POINTS = [("accumulate", 1), ("accumulate", 8), ("accumulate_2", 8)]  # model (2: two instances), concurrency
LLM_STREAMS = 32  # bench/llm_openai_bench.py's stream count
LLM_REQUESTS, LLM_REQUESTS_QUICK = 64, 32
LLM_START_TIMEOUT = 300  # model load (+ the kernels' first build on a fresh machine)
READING_RULE = "ratios are new/old; within the rounds' spread = no change"


# ---------------------------------------------------------------------------- results

@dataclass
class ABPoint:
    """One measured point: per round, each side's record (None when it could not be measured) with
    `tput` (throughput) and `p50_ms` (p50 latency; TTFT for the LLM) besides its raw figures."""

    bench: str
    label: str
    unit: str
    latency: str
    old: list[dict | None] = field(default_factory=list)
    new: list[dict | None] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # per round: "old→new" or "new→old"

    def _ratios(self, key: str) -> list[float]:
        return [n[key] / o[key] for o, n in zip(self.old, self.new) if o and n and o.get(key) and n.get(key)]

    def ratios(self) -> list[float]:
        return self._ratios("tput")

    def latency_ratios(self) -> list[float]:
        return self._ratios("p50_ms")

    def cpu_ratios(self) -> list[float]:
        """The server's CPU per request (bench/server_cpu.py), new/old per round."""
        return self._ratios("server_cpu_us")

    def median(self, side: str, key: str) -> float | None:
        vals = [r[key] for r in getattr(self, side) if r and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def to_dict(self) -> dict:
        r, lr = self.ratios(), self.latency_ratios()
        return {"bench": self.bench, "point": self.label, "unit": self.unit, "latency": self.latency,
                "order": self.order, "old": self.old, "new": self.new,
                "ratio_rounds": r, "ratio_median": statistics.median(r) if r else None,
                "latency_ratio_rounds": lr, "latency_ratio_median": statistics.median(lr) if lr else None,
                "reading": ratio_reading(r)}


# ---------------------------------------------------------------------------- runs

@dataclass
class Run:
    settings: Settings
    tree: Path
    tmp: Path
    old_name: str
    new_name: str
    points: list[ABPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()  # more `serve` flags, for both sides

    def pair(self, servers: Servers, what: str, start_old_fn: Callable[[], Server],
             start_new_fn: Callable[[], Server]) -> dict[str, Server]:
        old = servers.add(f"{self.old_name} ({what})", start_old_fn, required=True)
        new = servers.add(f"{self.new_name} ({what})", start_new_fn, required=True)
        assert old is not None and new is not None
        return {"old": old, "new": new}

    def measure_round(self, point: ABPoint, rnd: int, up: dict[str, Server], name: str,
                      one: Callable[[Server, str], dict]) -> None:
        """`point` once per side in round `rnd` (ABBA order: drift cancels over pairs of rounds);
        `one(server, label)` measures a side and returns its record (None when it could not)."""
        order = alternate(("old", "new"), rnd)
        point.order.append("→".join(order))
        got: dict[str, dict | None] = {}
        for side in order:
            label = f"round {rnd + 1}/{self.settings.rounds} {name} {side}"
            got[side] = measure(up[side], lambda s=up[side], lb=label: one(s, lb), label, self.notes)
        point.old.append(got["old"])
        point.new.append(got["new"])
        if got["old"] and got["new"]:
            log(f"round {rnd + 1} {name}: new/old {point.ratios()[-1]:.3f}")


@dataclass(frozen=True)
class PAPoint:
    """One perf_analyzer point: the model, protocol, concurrency and data arguments."""

    model: str
    proto: str
    concurrency: int
    data: tuple[str, ...]


def run_perf_analyzer(run: Run, bench: str, fill: Callable[[Path], None], points: dict[PAPoint, str]) -> None:
    """Both sides serve a copy of the repository `fill` writes; each point (-> its label) is measured
    with perf_analyzer once per side per round."""
    pa = perf_analyzer()
    if pa is None:
        run.notes.append(f"{bench} skipped: {PERF_ANALYZER_MISSING}")
        log(run.notes[-1])
        return
    settings = run.settings
    repos = {}
    for side in ("old", "new"):  # a private copy each (same files)
        repos[side] = run.tmp / f"{bench}_{side}"
        fill(repos[side])
    measured = {pt: ABPoint(bench, label, "infer/s", "p50 ms") for pt, label in points.items()}
    run.points += measured.values()

    def one(srv: Server, label: str, p: PAPoint) -> dict:
        pt = metered(srv, p.model, lambda: perf_analyzer_point(
            pa, settings, p.model, srv.http if p.proto == "http" else srv.grpc, p.proto, p.concurrency,
            list(p.data), label))
        cpu = f", server CPU {pt.server_cpu_us:,.0f} µs/req" if pt.server_cpu_us else ""
        log(f"{label}: {pt.throughput:,.0f} infer/s p50 {pt.p50_us / 1000:.3f} ms{cpu}"
            f"{'' if pt.stable else ' (unstable)'}")
        return {"tput": pt.throughput, "p50_ms": pt.p50_us / 1000, **pt.to_dict()}

    with Servers() as servers:
        up = run.pair(servers, bench, lambda: start_old(f"ab_old_{bench}", run.tree, repos["old"], *run.serve_args),
                      lambda: start_pier(f"ab_new_{bench}", repos["new"], *run.serve_args))
        for rnd in range(settings.rounds):
            for p, point in measured.items():
                run.measure_round(point, rnd, up, point.label, lambda s, lb, p=p: one(s, lb, p))


def run_identity(run: Run) -> None:
    def fill(repo: Path) -> None:
        shutil.copytree(ROOT / "model_repository" / IDENTITY_MODEL, repo / IDENTITY_MODEL)

    run_perf_analyzer(run, "identity", fill, {
        PAPoint(IDENTITY_MODEL, proto, c, ("--shape", "INPUT0:16")): f"{'HTTP' if proto == 'http' else 'gRPC'} c={c}"
        for proto, c in IDENTITY_POINTS})


def run_python(run: Run) -> None:
    """bench/python_backend_process.py's identity model in its stub process (the default mode)."""

    def fill(repo: Path) -> None:
        (repo / PYTHON_MODEL / "1").mkdir(parents=True)
        (repo / PYTHON_MODEL / "1" / "model.py").write_text(MODEL_PY)
        (repo / PYTHON_MODEL / "config.pbtxt").write_text(PYTHON_CONFIG % "process")

    run_perf_analyzer(run, "python", fill, {
        PAPoint(PYTHON_MODEL, proto, c, ("--shape", "INPUT0:16")): f"{'HTTP' if proto == 'http' else 'gRPC'} c={c}"
        for proto, c in IDENTITY_POINTS})


def run_sequence(run: Run) -> None:
    def fill(repo: Path) -> None:
        shutil.copytree(ROOT / "model_repository" / "accumulate", repo / "accumulate")
        two = repo / "accumulate_2"
        shutil.copytree(ROOT / "model_repository" / "accumulate", two)
        config = (two / "config.pbtxt").read_text()
        changed = config.replace('name: "accumulate"', 'name: "accumulate_2"').replace("count: 1", "count: 2")
        if changed.count("accumulate_2") != 1 or "count: 2" not in changed:
            raise RuntimeError("model_repository/accumulate/config.pbtxt: cannot make its two-instance copy")
        (two / "config.pbtxt").write_text(changed)

    run_perf_analyzer(run, "sequence", fill, {PAPoint(m, "grpc", c, ("--shape", "INPUT:1")): f"gRPC {m} c={c}"
                                              for m, c in SEQUENCE_POINTS})


def run_llm(run: Run) -> None:
    from bench.llm_bench import CACHE as LLM_CACHE
    from bench.llm_bench import build_model, workload
    from bench.llm_openai_bench import _drive, _wait_models, write_repo

    settings = run.settings
    n = LLM_REQUESTS_QUICK if settings.quick else LLM_REQUESTS
    log("building / reusing the tiny Llama (bench/llm_bench.py build_model)")
    folder = build_model(LLM_CACHE / "llama27m")
    workloads = [workload(n, seed) for seed in range(settings.rounds)]
    repos = {side: write_repo(run.tmp / f"llm_{side}", folder) for side in ("old", "new")}  # run_pier's model
    run.info["llm_workload"] = (
        f"{n} requests per round, {LLM_STREAMS} concurrent streams (openai SDK, stream, include_usage), prompts "
        f"16-256 token ids, outputs 8-256 tokens, greedy, ignore_eos; round r uses seed r on both sides "
        f"(seed 0: {sum(o for _, o in workloads[0])} output tokens); kv_cache_memory_bytes 1 GiB")

    def ready(server: Server) -> Server:
        return ready_or_stopped(server, lambda: _wait_models(f"http://{server.http}", LLM_START_TIMEOUT, server.proc))

    point = ABPoint("llm", f"LLM OpenAI API, {LLM_STREAMS} streams", "output tok/s", "TTFT p50 ms")
    run.points.append(point)
    with Servers() as servers:
        up = run.pair(
            servers, "llm",
            lambda: ready(start_old("ab_old_llm", run.tree, repos["old"], *run.serve_args, timeout=LLM_START_TIMEOUT)),
            lambda: ready(start_pier("ab_new_llm", repos["new"], *run.serve_args, timeout=LLM_START_TIMEOUT)))

        def drive(srv: Server, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
            res = asyncio.run(_drive(f"http://{srv.http}", reqs, LLM_STREAMS))
            if not res["requests"]:
                raise RuntimeError(f"{srv.name}: no request finished: {res['errors'][:2]}")
            return res

        def one(srv: Server, label: str, reqs: list[tuple[list[int], int]]) -> dict:
            res = drive(srv, reqs)
            if res["errors"]:
                run.notes.append(f"{label}: {len(res['errors'])}+ failed requests, e.g. {res['errors'][0]}")
            log(f"{label}: {res['tok_s']:.1f} tok/s, TTFT p50 {res['ttft_p50_s'] * 1000:.0f} ms, "
                f"{res['requests']} requests in {res['wall_s']:.1f} s")
            return {"tput": res["tok_s"], "p50_ms": res["ttft_p50_s"] * 1000, **res}

        warm = workload(16, seed=10_000)  # not measured: first batches, allocator, kernels
        for side in ("old", "new"):
            log(f"llm warm-up {side}: 16 requests")
            measure(up[side], lambda s=up[side]: drive(s, warm), f"llm warm-up {side}", run.notes)
        for rnd in range(settings.rounds):
            run.measure_round(point, rnd, up, "llm", lambda s, lb, r=workloads[rnd]: one(s, lb, r))


# ---------------------------------------------------------------------------- report

def _plot(path: Path, title: str, points: list[ABPoint]) -> bool:
    plt = report.pyplot()
    if plt is None:
        return False
    shown = [p for p in points if p.ratios()]
    if not shown:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(max(9.0, 2.2 * len(shown) + 3), 4.6), squeeze=False)
    for ax, (getter, ylabel) in zip(axes[0], ((ABPoint.ratios, "throughput new/old (higher = new faster)"),
                                             (ABPoint.latency_ratios, "p50 latency new/old (lower = new faster)"))):
        for i, p in enumerate(shown):
            vals = getter(p)
            if not vals:
                continue
            offsets = [(j - (len(vals) - 1) / 2) * 0.08 for j in range(len(vals))]
            ax.scatter([i + o for o in offsets], vals, color="tab:blue", zorder=3, s=28,
                       label="round" if i == 0 else None)
            med = statistics.median(vals)
            ax.hlines(med, i - 0.3, i + 0.3, color="tab:red", zorder=4, label="median" if i == 0 else None)
            ax.annotate(f"{med:.3f}", (i + 0.32, med), fontsize=7, va="center")
        ax.axhline(1.0, color="black", lw=1, ls="--", zorder=2)
        ax.set_xticks(range(len(shown)), [p.label.replace("LLM OpenAI API, ", "LLM\n") for p in shown], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=9)
        lo = min([0.9, *(v for p in shown for v in getter(p))])
        hi = max([1.1, *(v for p in shown for v in getter(p))])
        ax.set_ylim(lo - 0.03, hi + 0.03)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _side_cell(p: ABPoint, side: str, key: str, fmt: Callable[[float | None], str]) -> str:
    return fmt(p.median(side, key))


def _rounds_cell(p: ABPoint) -> str:
    cells = []
    for o, n, order in zip(p.old, p.new, p.order):
        if o and n and o.get("tput"):
            mark = "" if o.get("stable", True) and n.get("stable", True) else "~"
            cells.append(f"{n['tput'] / o['tput']:.3f}{mark} ({order})")
        else:
            cells.append(f"— ({order})")
    return " / ".join(cells)


def _cpu_cell(p: ABPoint) -> str:
    """The server's CPU µs per request, each side's median, and the per-round ratios new/old."""
    old, new = p.median("old", "server_cpu_us"), p.median("new", "server_cpu_us")
    if old is None or new is None:
        return "—"
    med, rng = ratio_cells(p.cpu_ratios())
    return f"{old:,.0f} → {new:,.0f}, {med}" + ("" if rng in ("—", "(1 round)") else f" ({rng})")


def write_report(run: Run, started: dict, old_rev: str, old_desc: str, new_desc: str, durations: dict,
                 name: str = "refactor_ab") -> Path:
    md, png, raw = report.result_files(name, run.settings.quick)
    title = f"Refactor A/B: old {old_rev} vs new {new_desc}"
    has_png = _plot(png, title, run.points)
    lines = [f"# {title}", "",
             f"**Reading rule: {READING_RULE}.** Throughput ratio > 1 = new faster; latency ratio < 1 = new faster.",
             "",
             f"- old: `{old_rev}` = commit {old_desc}, served from a `git worktree` as `python -m server serve` "
             "(cwd and PYTHONPATH = the worktree)",
             f"- new: {new_desc} (`git describe`: {describe_head()}), served as `{' '.join(_pier_cmd())} serve`",
             *([f"- both sides served with `{' '.join(run.serve_args)}`"] if run.serve_args else []),
             f"- machine: {machine()}; load average at start {started['load']}, at end {loadavg()}",
             f"- date: {started['date']} – {time.strftime('%H:%M:%S')}; {run.settings.describe()}",
             "- both servers run at once for the whole of their benchmark, on copies of the same model repository; "
             "each point is measured once per side per round, rounds in ABBA order (old→new, new→old, ...); "
             "ratio per round = new/old; the table gives their median, min–max and every round "
             "(`~`: perf_analyzer could not stabilise at the configured threshold in that round)",
             "- time taken: " + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items()),
             ""]
    if "llm_workload" in run.info:
        lines += [f"- LLM workload (bench/llm_openai_bench.py's): {run.info['llm_workload']}", ""]
    for bench, title_g in (("identity", "identity_fp32: perf_analyzer, batch 1, INPUT0 [16] FP32 (sync)"),
                           ("python", "identity_fp32 as a python-backend model in its stub process: perf_analyzer, "
                                      "batch 1, INPUT0 [16] FP32 (sync)"),
                           ("sequence", "accumulate (sequence batcher, direct, implicit state): perf_analyzer "
                                        "sequences of 20 requests over gRPC, one per concurrent client"),
                           ("llm", "LLM through the OpenAI API (tiny random Llama, CPU)")):
        pts = [p for p in run.points if p.bench == bench]
        if not pts:
            continue
        unit, lat = pts[0].unit, pts[0].latency
        lines += [f"## {title_g}", "",
                  f"| point | old {unit} | new {unit} | new/old median | new/old min–max | per round | "
                  f"old {lat} | new {lat} | {lat} new/old median (min–max) | "
                  "server CPU µs/req old → new, new/old median (min–max) | reading |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in pts:
            med, rng = ratio_cells(p.ratios())
            lmed, lrng = ratio_cells(p.latency_ratios())
            lat_cell = lmed if lrng in ("—", "(1 round)") else f"{lmed} ({lrng})"
            lines.append(f"| {p.label} | {_side_cell(p, 'old', 'tput', fmt_rate)} | "
                         f"{_side_cell(p, 'new', 'tput', fmt_rate)} | {med} | {rng} | {_rounds_cell(p)} | "
                         f"{_side_cell(p, 'old', 'p50_ms', lambda v: fmt_ms(v * 1000) if v else '—')} | "
                         f"{_side_cell(p, 'new', 'p50_ms', lambda v: fmt_ms(v * 1000) if v else '—')} | "
                         f"{lat_cell} | {_cpu_cell(p)} | {ratio_reading(p.ratios())} |")
        lines.append("")
    if run.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in run.notes], ""]
    only = sorted({p.bench for p in run.points})
    lines += [f"Run with `python -m bench.ab --old {old_rev} --rounds {run.settings.rounds}"
              f"{' --quick' if run.settings.quick else ''} --only {','.join(only)}"
              f"{'' if name == 'refactor_ab' else ' --out ' + name}`. Server logs: bench/.cache/logs/ab_*.log.", ""]
    if has_png:
        lines += [f"![{title}]({png.name})", ""]
    md.write_text("\n".join(lines))
    payload = {"title": title, "reading_rule": READING_RULE, "old": {"rev": old_rev, "commit": old_desc},
               "new": {"git": new_desc, "describe": describe_head()}, "machine": machine(), "started": started,
               "ended": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load": loadavg()},
               "settings": run.settings.__dict__, "durations_s": durations, "info": run.info,
               "points": [p.to_dict() for p in run.points], "notes": run.notes}
    raw.write_text(json.dumps(payload, indent=1))
    report.log_written(md, png if has_png else None, raw)
    return md


def _pier_cmd() -> list[str]:
    return [Path(c).name if i == 0 else c for i, c in enumerate(pier_command())]


# ---------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("--old", default=DEFAULT_OLD, help=f"the old revision (default {DEFAULT_OLD})")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="short perf_analyzer windows, fewer LLM requests, 1 round")
    p.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default="refactor_ab", help="the results' name: bench/results/NAME.{md,json,png}")
    p.add_argument("--serve-arg", action="append", default=[], help="a `serve` flag for both sides (repeatable)")
    args = p.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown or not chosen:
        p.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    settings = Settings.make(args.quick, args.rounds)
    log(settings.describe())
    # SIGTERM -> KeyboardInterrupt for the whole run, so the finally blocks stop the servers and
    # remove the worktree (bench.servers.Servers does the same while servers are up).
    with sigterm_as_interrupt():
        return _run(args.old, settings, chosen, args.out, tuple(args.serve_arg))


def _run(old: str, settings: Settings, chosen: list[str], out: str = "refactor_ab",
         serve_args: tuple[str, ...] = ()) -> int:
    started = report.started_info()
    try:
        old_sha = git("rev-parse", "--short", f"{old}^{{commit}}")
        subject = git("log", "-1", "--format=%s", old_sha)
        old_desc = f"{old_sha} \"{subject[:70]}{'…' if len(subject) > 70 else ''}\""
    except Exception as exc:
        log(str(exc))
        return 2
    new_desc = git_describe()
    failed: list[str] = []
    durations: dict[str, float] = {}
    try:
        with worktree(old) as tree, tempfile.TemporaryDirectory(prefix="pier-ab-repos-") as tmp:
            check_old_imports(tree)
            run = Run(settings, tree, Path(tmp), f"old {old_sha}", f"new {new_desc.split()[0]}", serve_args=serve_args)
            for name, fn in (("identity", run_identity), ("python", run_python), ("sequence", run_sequence),
                             ("llm", run_llm)):
                if name not in chosen:
                    continue
                log(f"=== {name} ===")
                t0 = time.monotonic()
                try:
                    fn(run)
                except Exception as exc:
                    traceback.print_exc()
                    failed.append(name)
                    run.notes.append(f"{name} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                durations[name] = time.monotonic() - t0
                log(f"=== {name} done in {durations[name]:.0f} s ===")
        md = write_report(run, started, old, old_desc, new_desc, durations, out)
    except KeyboardInterrupt:
        log("interrupted: servers stopped, worktree removed")
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    return finish([md], failed)


if __name__ == "__main__":
    sys.exit(main())
