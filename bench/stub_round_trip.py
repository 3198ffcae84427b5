"""The Python stub's round trip, old revision vs this checkout (issue 29 part 1: typed messages
and the Supervisor must not make it slower): `ProcessInstance.execute` called directly, with no
server, frontend or load generator in the way, on the identity model of
bench/python_backend_process.py, for three payloads: one request of INPUT0 [16] FP32 (64 B,
inline), one of [262144] FP32 (1 MiB each way, the reusable memfd region), and a batch of 8
small requests.

    .venv/bin/python -m bench.stub_round_trip                 # old = DEFAULT_OLD, 5 rounds
    .venv/bin/python -m bench.stub_round_trip --old REV --rounds 7 --seconds 3

Each side runs in a process of its own that imports Pier from its source tree (the old one from a
`git worktree` of REV, the new one from this checkout), stub included; rounds alternate ABBA, each
a fresh instance measured for --seconds per payload after a warm-up. Reported: the median round's
p50 / p99 latency and calls/s per side, and the per-round ratio new/old of the p50 (median and
min-max). Writes bench/results/stub_round_trip.{md,json}. Run it under the CPU lock
(`flock /tmp/pier-cpu.lock ...`): the 2 cores are shared by both sides' parent and stub.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, git_describe, loadavg, log, machine
from bench.python_backend_process import MODEL_PY
from bench.report import ratio_cells, ratio_reading
from bench.revisions import git, worktree

DEFAULT_OLD = "1bc2132"  # main before the stub's typed messages and its move onto pier.ipc.Supervisor
PAYLOADS = ("64 B", "1 MiB", "8 x 64 B")

# Run as `python -c MEASURE TREE MODEL_DIR SECONDS`: Pier from TREE (server/ as `pier`, backends/ as
# `pier.backends`, the stub too), one ProcessInstance, each payload timed; prints JSON.
BOOT = """
import sys, types
tree = sys.argv[1]
pier = types.ModuleType("pier"); pier.__path__ = [tree + "/server"]; sys.modules["pier"] = pier
exec(open(tree + "/server/__init__.py").read(), pier.__dict__)
backends = types.ModuleType("pier.backends"); backends.__path__ = [tree + "/backends"]
sys.modules["pier.backends"] = backends; pier.backends = backends
"""
MEASURE = BOOT + f"BOOT = {BOOT!r}\n" + """
import json, os, time
from pathlib import Path
import numpy as np
from pier.backends.python import process
from pier.contract.backend import InstanceContext, ModelContext
from pier.contract.types import InferenceRequest, InstanceGroupSpec, ModelSpec, Tensor, TensorSpec

folder, seconds = Path(sys.argv[2]), float(sys.argv[3])
spec = ModelSpec(name="identity_fp32", platform="", backend="python", max_batch_size=64,
                 inputs=(TensorSpec("INPUT0", "FP32", (-1,)),), outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
                 instance_groups=(InstanceGroupSpec("g", "KIND_CPU", 1),), default_model_filename="model.py",
                 parameters={})
ctx = ModelContext(spec=spec, version=1, model_dir=folder, version_dir=folder / "1")
command = getattr(process, "StubCommand", None) or getattr(process, "Launch")
stub = command((sys.executable, "-c", BOOT.replace("sys.argv[1]", repr(tree)) +
                "from pier.backends.python.stub import main; main(sys.argv[1:])"), dict(os.environ))
instance = process.ProcessInstance(ctx, InstanceContext("identity_fp32_0", "KIND_CPU"), stub)

def stub_pid():
    kids = []
    for task in Path("/proc/self/task").iterdir():
        kids += (task / "children").read_text().split()
    (pid,) = kids
    return int(pid)

def cpu_s(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def request(n):
    x = np.random.default_rng(0).random((1, n), dtype=np.float32)
    return InferenceRequest("identity_fp32", "", [Tensor("INPUT0", "FP32", [1, n], x)])

out = {}
try:
    for name, batch in (("64 B", [request(16)]), ("1 MiB", [request(262144)]), ("8 x 64 B", [request(16)] * 8)):
        for _ in range(200):
            instance.execute(batch)
        times = []
        pid = stub_pid()
        cpu0 = cpu_s(os.getpid()) + cpu_s(pid)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            result = instance.execute(batch)
            times.append(time.perf_counter() - t0)
        cpu = cpu_s(os.getpid()) + cpu_s(pid) - cpu0
        assert all(not isinstance(r, Exception) for r in result), result
        us = np.asarray(times) * 1e6
        out[name] = {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
                     "calls_per_s": len(us) / float(us.sum() / 1e6), "count": len(us),
                     "cpu_us_per_call": cpu * 1e6 / len(us)}
finally:
    instance.close()
print(json.dumps(out))
"""


def _run(tree: Path, model_dir: Path, seconds: float) -> dict[str, dict[str, float]]:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tree), str(model_dir), str(seconds)],
                          capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stub_round_trip", description=__doc__.splitlines()[0])
    p.add_argument("--old", default=DEFAULT_OLD, help=f"the old revision (default {DEFAULT_OLD})")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0, help="measured seconds per payload and side per round")
    args = p.parse_args(argv)
    old_sha = git("rev-parse", "--short", f"{args.old}^{{commit}}")
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="pier-stub-rt-") as tmp, worktree(args.old) as old_tree:
        model_dir = Path(tmp) / "identity_fp32"
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "1" / "model.py").write_text(MODEL_PY)
        for r in range(args.rounds):
            order = ("old", "new") if r % 4 in (0, 3) else ("new", "old")  # ABBA
            got: dict[str, dict[str, dict[str, float]]] = {}
            for side in order:
                got[side] = _run(old_tree if side == "old" else ROOT, model_dir, args.seconds)
                log(f"round {r + 1} {side}: "
                    + ", ".join(f"{k} p50 {v['p50_us']:.1f} us" for k, v in got[side].items()))
            rounds.append(got)
    lines = [f"# Python stub round trip: {old_sha} (old) vs {git_describe()} (new)", "",
             f"{started}; {machine()}; load average before: {loadavg()}. `ProcessInstance.execute` called in a loop "
             f"on the identity model (no server, no frontend, no load generator), {args.rounds} rounds in ABBA order, "
             f"{args.seconds:g} s per payload and side per round, a fresh instance per side and round. Both "
             "processes (the caller and its stub) share the machine's 2 cores with nothing else of the benchmark.",
             "CPU µs per call: the caller's and the stub's CPU time (user + system, /proc) over the timed "
             "calls, divided by their count: the work a round trip costs, less sensitive than latency to "
             "what else runs on the machine.",
             "", "| payload | old p50 µs | new p50 µs | old p99 µs | new p99 µs | old CPU µs/call | new CPU µs/call | "
             "p50 new/old (median) | min–max | reading | CPU new/old (median) | min–max | reading |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for name in PAYLOADS:
        ratios = [rd["new"][name]["p50_us"] / rd["old"][name]["p50_us"] for rd in rounds]
        cpu_ratios = [rd["new"][name]["cpu_us_per_call"] / rd["old"][name]["cpu_us_per_call"] for rd in rounds]
        med = {side: {k: statistics.median(rd[side][name][k] for rd in rounds)
                      for k in ("p50_us", "p99_us", "calls_per_s", "cpu_us_per_call")} for side in ("old", "new")}
        cell, spread = ratio_cells(ratios)
        cpu_cell, cpu_spread = ratio_cells(cpu_ratios)
        lines.append(f"| {name} | {med['old']['p50_us']:.1f} | {med['new']['p50_us']:.1f} | "
                     f"{med['old']['p99_us']:.1f} | {med['new']['p99_us']:.1f} | {med['old']['cpu_us_per_call']:.1f} | "
                     f"{med['new']['cpu_us_per_call']:.1f} | {cell} | {spread} | {ratio_reading(ratios)} | "
                     f"{cpu_cell} | {cpu_spread} | {ratio_reading(cpu_ratios)} |")
        summary[name] = {"ratios_p50": ratios, "ratios_cpu": cpu_ratios, "median": med}
    lines += ["", "Ratios below 1 mean the new revision is faster (lower latency). Each round: "]
    lines += [f"- round {i + 1}: " + "; ".join(f"{n} p50 old {rd['old'][n]['p50_us']:.1f} / new "
                                               f"{rd['new'][n]['p50_us']:.1f} µs" for n in PAYLOADS)
              for i, rd in enumerate(rounds)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    md, raw = RESULTS / "stub_round_trip.md", RESULTS / "stub_round_trip.json"
    md.write_text("\n".join(lines) + "\n")
    raw.write_text(json.dumps({"old": old_sha, "new": git_describe(), "rounds": rounds, "summary": summary},
                              indent=1) + "\n")
    log(f"wrote {md.relative_to(ROOT)}, {raw.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
