"""The fault campaign: mixed load for a few minutes while faults are injected on a schedule, every
request counted (right, wrong, a clear error naming the fault, lost), the server's memory and
descriptors before and after, and what is left once it has stopped.

    .venv/bin/python -m bench.chaos                          # Pier, Pier --frontend-processes 2, Triton 2.51
    .venv/bin/python -m bench.chaos --only pier --duration 60
    PIER_REFERENCE_TOOLS=/path/to/tools .venv/bin/python -m bench.chaos   # Triton needs its tools

Load (bench/chaos_load.py, one closed-loop client thread each): v2 infer over HTTP (Pier's ONNX
`simple`, the python `addsub_py`, the ensemble `ens_py`) and gRPC (`addsub_py`), a gRPC stream to
the decoupled `count_py`, sequences on `seq_py`, OpenAI streamed completions on a
random-weight tiny Llama (Pier), clients that disconnect mid-stream, clients that never read.
Models: bench/chaos_models.py. The server runs in poll mode (--repository-poll-secs 2).

Faults (SCHEDULE, seconds from the start of the load): kill -9 of a Python stub (a stateless
model's, later the sequence model's), of the LLM engine core, of a frontend process; a model
reloaded (its config edited), unloaded (its folder moved out) and loaded again; a corrupt model
folder dropped into the repository; a served model's file corrupted, then restored; the slow
readers from the start to the middle. Triton 2.51 (python backend) runs the same campaign where it
applies: not the ONNX model, the LLM or frontend processes.

Writes bench/results/chaos[-quick].{md,json}. Exit status 1 when a campaign could not run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import chaos_load as load
from bench.chaos_models import ADDSUB, BROKEN, drop_broken_model, write_repository
from bench.common import RESULTS, git_describe, loadavg, log, machine, temp_dir
from bench.servers import Server, Servers, start_pier, start_triton
from tests.processes import descendants

SETTLE_S = 5.0  # quiet before a resource sample


@dataclass
class Target:
    label: str
    server: Server
    repo: Path
    pier: bool
    frontends: int = 0
    tmp: Path | None = None  # the server's TMPDIR (None: the system's, not checked)
    seen_children: set[int] = field(default_factory=set)

    @property
    def http(self) -> str:
        assert self.server.http
        return self.server.http

    @property
    def grpc(self) -> str:
        assert self.server.grpc
        return self.server.grpc

    @property
    def pid(self) -> int:
        if self.server.proc is not None:
            return self.server.proc.pid
        assert self.server.pid is not None
        return self.server.pid


# ---- processes -----------------------------------------------------------------------------

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def find_child(target: Target, *words: str) -> int | None:
    """The server's descendant whose command line holds every word (the first one found)."""
    for pid in sorted(descendants(target.pid)):
        line = _cmdline(pid)
        if all(w in line for w in words):
            return pid
    return None


def _fd_kinds(pid: int) -> dict[str, int]:
    """The server process's open descriptors by kind (socket, pipe, anon_inode:..., a file's folder)."""
    kinds: Counter = Counter()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if ":[" in link:  # socket:[inode], pipe:[inode], anon_inode:[eventfd]
            kinds[link.split(":[")[0]] += 1
        else:  # anon_inode:inotify, or a file: its folder
            kinds[link if link.startswith("anon_inode:") else str(Path(link).parent)] += 1
    return dict(kinds)


def sample(pid: int) -> dict[str, Any]:
    """The server process's resident memory, open descriptors (and their kinds) and threads; its
    children's count and memory."""
    def rss(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    children = descendants(pid)
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        fds = threads = -1
    return {"rss_mib": round(rss(pid) / 1024, 1), "fds": fds, "threads": threads, "children": len(children),
            "children_rss_mib": round(sum(rss(c) for c in children) / 1024, 1), "fd_kinds": _fd_kinds(pid)}


# ---- faults --------------------------------------------------------------------------------

@dataclass
class Fault:
    at: float  # seconds from the start of the load
    name: str
    act: Callable[[Target], str]  # does it; returns what it did, in words
    applies: Callable[[Target], bool] = lambda t: True


def _kill(target: Target, what: str, *words: str) -> str:
    pid = find_child(target, *words)
    if pid is None:
        return f"no {what} found"
    os.kill(pid, signal.SIGKILL)
    return f"kill -9 {what} (pid {pid})"


def _reload(target: Target) -> str:
    config = target.repo / "addsub_py" / "config.pbtxt"
    config.write_text(config.read_text() + f"\n# edited at {time.strftime('%H:%M:%S')}: reload\n")
    return "addsub_py/config.pbtxt edited (poll: reload under load)"


def _park(target: Target) -> Path:
    return target.repo.parent / "parked"


def _unload(target: Target) -> str:
    _park(target).mkdir(exist_ok=True)
    shutil.move(str(target.repo / "count_py"), str(_park(target) / "count_py"))
    return "count_py moved out of the repository (poll: unload under load)"


def _load(target: Target) -> str:
    shutil.move(str(_park(target) / "count_py"), str(target.repo / "count_py"))
    return "count_py moved back (poll: load)"


def _drop_broken(target: Target) -> str:
    drop_broken_model(target.repo)
    return "broken_py/ dropped in: a model.py that does not parse (poll: its load fails)"


def _remove_broken(target: Target) -> str:
    shutil.rmtree(target.repo / "broken_py", ignore_errors=True)
    return "broken_py/ removed"


def _corrupt(target: Target) -> str:
    (target.repo / "addsub_py" / "1" / "model.py").write_text(BROKEN)
    return "addsub_py/1/model.py overwritten with text that does not parse (poll: its reload fails)"


def _restore(target: Target) -> str:
    (target.repo / "addsub_py" / "1" / "model.py").write_text(ADDSUB)
    return "addsub_py/1/model.py restored (poll: reload)"


STUB = {True: "pier.backends.python.stub", False: "triton_python_backend_stub"}

SCHEDULE = [
    Fault(15, "kill -9 of a Python stub (addsub_py)",
          lambda t: _kill(t, "addsub_py's stub", STUB[t.pier], "addsub_py")),
    Fault(30, "kill -9 of the LLM engine core", lambda t: _kill(t, "the engine core", "pier.backends.llm.engine_core"),
          lambda t: t.pier),
    Fault(45, "kill -9 of a frontend process", lambda t: _kill(t, "frontend process", "pier.frontends.workers.worker"),
          lambda t: t.frontends > 0),
    Fault(60, "model reload under load", _reload),
    Fault(75, "model unload under load", _unload),
    Fault(90, "model load under load", _load),
    Fault(100, "corrupt model folder dropped into the repository", _drop_broken),
    Fault(110, "a served model's file corrupted", _corrupt),
    Fault(125, "the corrupted file restored", _restore),
    Fault(140, "kill -9 of the sequence model's stub (the state it kept is lost)",
          lambda t: _kill(t, "seq_py's stub", STUB[t.pier], "seq_py")),
    Fault(150, "corrupt model folder removed", _remove_broken),
]
SLOW_READERS = (5, 70)  # opened, closed (seconds from the start of the load)


# ---- one campaign --------------------------------------------------------------------------

def _wait_ready(target: Target, models: list[str], timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(requests.get(f"http://{target.http}/v2/models/{m}/ready", timeout=5).status_code == 200
                   for m in models):
                return True
        except requests.RequestException:
            pass
        time.sleep(0.5)
    return False


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# Files other libraries leave in TMPDIR on purpose, with whose they are: not the server's to remove.
# `.ses`: onnxruntime 1.32's telemetry (the 1DS SDK) writes its session file (first-launch time and a
# session id, kept across runs by design) when the library is imported; Pier imports it to serve ONNX.
FOREIGN_TMP = {".ses": "onnxruntime's telemetry session file, written when onnxruntime is imported"}


def _tmp(target: Target) -> tuple[list[str], list[str]]:
    """What is in the server's private temporary folder (Pier: TMPDIR; the frontends' sockets, the
    LLM engine core's), each entry with its size and first bytes (what left it there?): the
    server's, and the files of FOREIGN_TMP (another library's, said whose)."""
    if target.tmp is None:
        return [], []
    ours, foreign = [], []
    for path in sorted(target.tmp.rglob("*")):
        rel = str(path.relative_to(target.tmp))
        if rel in FOREIGN_TMP:
            foreign.append(f"{rel} ({FOREIGN_TMP[rel]})")
            continue
        head = repr(path.read_bytes()[:80]) if path.is_file() else ""
        ours.append(f"{rel} ({path.stat().st_size} B{', ' + head if head else ''})")
    return ours, foreign


def _quiet_sample(target: Target, workloads: list[load.Workload]) -> dict[str, Any]:
    """The server's resources with no client connected: every workload's client closed (the
    garbage collector closes those it dropped), then SETTLE_S of quiet."""
    for w in workloads:
        w.close()
    gc.collect()
    time.sleep(SETTLE_S)
    return sample(target.pid)


def campaign(target: Target, duration: float, models: list[str]) -> dict[str, Any]:
    tally = load.Tally()
    workloads: list[load.Workload] = []
    if target.pier:
        workloads.append(load.HttpAddSub(target, tally, "simple"))
    workloads += [load.HttpAddSub(target, tally, "addsub_py"), load.GrpcAddSub(target, tally),
                  load.HttpAddSub(target, tally, "ens_py", ("OUT_SUM", "OUT_DIFF"), factor=2),
                  load.GrpcDecoupledStream(target, tally), load.GrpcSequence(target, tally)]
    openai = None
    if target.pier:
        openai = load.OpenAIStream(target, tally)
        workloads.append(openai)
    disconnectors = load.Disconnectors(target, tally, openai=target.pier)
    slow = load.SlowReaders(target, openai=target.pier)

    log(f"{target.label}: warm-up (every workload once)")
    if openai is not None:
        openai.warm()
    warm = load.Tally()
    for w in workloads:
        w.tally = warm
        w.once()
        w.tally = tally
    if any(k != "ok" for c in warm.outcomes.values() for k in c):
        raise RuntimeError(f"the warm-up failed: {dict(warm.outcomes)} {warm.examples}")
    before = _quiet_sample(target, workloads)
    shm_before = _shm()
    log(f"{target.label}: before {before}")

    stop_watch = threading.Event()

    def watch() -> None:  # every child the server has had, for the check after it stopped
        while not stop_watch.is_set():
            target.seen_children |= descendants(target.pid)
            stop_watch.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tally.t0 = time.monotonic()
    for w in [*workloads, disconnectors]:
        w.thread.start()
    done: list[dict[str, Any]] = []
    plan = [f for f in SCHEDULE if f.applies(target) and f.at < duration]
    marks: list[tuple[float, Fault | str]] = [(f.at, f) for f in plan]
    marks += [(SLOW_READERS[0], "open"), (min(SLOW_READERS[1], duration - 10), "close")]
    marks.sort(key=lambda m: m[0])
    for at, what in marks:
        time.sleep(max(0.0, tally.t0 + at - time.monotonic()))
        if what == "open":
            slow.open()
            done.append({"at": at, "fault": "slow readers open (never read)", "did": ", ".join(slow.opened)})
        elif what == "close":
            slow.close()
            done.append({"at": at, "fault": "slow readers close", "did": "their sockets closed"})
        else:
            assert isinstance(what, Fault)
            try:
                did = what.act(target)
            except Exception as exc:
                did = f"could not: {exc}"
            log(f"{target.label}: t={at:.0f}s {what.name}: {did}")
            done.append({"at": at, "fault": what.name, "did": did})
    time.sleep(max(0.0, tally.t0 + duration - time.monotonic()))
    slow.close()
    for w in [*workloads, disconnectors]:
        w.stop.set()
    for w in [*workloads, disconnectors]:
        w.thread.join(load.REQUEST_TIMEOUT_S + 10)
    stuck = [w.name for w in [*workloads, disconnectors] if w.thread.is_alive()]
    log(f"{target.label}: load stopped after {time.monotonic() - tally.t0:.0f} s")

    ready = _wait_ready(target, models)
    again = load.Tally()  # every workload once more: the restarted children serve
    for w in workloads:
        w.tally = again
        w.once()
    after = _quiet_sample(target, workloads)
    log(f"{target.label}: after {after}")

    t_stop = time.monotonic()
    os.kill(target.pid, signal.SIGTERM)
    code: int | None = None
    deadline = time.monotonic() + 60
    while _alive(target.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    exit_s = time.monotonic() - t_stop
    exited = not _alive(target.pid)
    if target.server.proc is not None and exited:
        code = target.server.proc.wait()
    stop_watch.set()
    watcher.join(5)
    time.sleep(1.0)  # the kernel reaps orphans
    last_words = [line.strip()[:300] for line in target.server.log_tail(3).splitlines() if line.strip()]
    target.server.stop()  # Triton's stop.sh: removes its run folder (its server is gone by now)
    left_children = sorted(p for p in target.seen_children if _alive(p))
    tmp_left, tmp_foreign = _tmp(target)
    return {
        "target": target.label, "duration_s": duration, "outcomes": {k: dict(v) for k, v in tally.outcomes.items()},
        "examples": {f"{w} / {k}": v for (w, k), v in tally.examples.items()},
        "events": tally.events, "faults": done, "before": before, "after": after,
        "models_ready_after": ready, "after_pass": {k: dict(v) for k, v in again.outcomes.items()},
        "after_pass_examples": {f"{w} / {k}": v for (w, k), v in again.examples.items()},
        "stuck_clients": stuck, "exit_code": code, "last_words": last_words, "exited": exited,
        "exit_s": round(exit_s, 1),
        "children_seen": len(target.seen_children), "children_left": left_children,
        "shm_left": sorted(_shm() - shm_before), "tmp_left": tmp_left if target.tmp else None,
        "tmp_foreign": tmp_foreign,
    }


# ---- the report ----------------------------------------------------------------------------

COLUMNS = ["ok", "wrong", "hung", "left"]


def _table(result: dict[str, Any]) -> list[str]:
    kinds = sorted({k for c in result["outcomes"].values() for k in c if k.startswith("error")})
    head = ["workload", "requests", "answered right", *[k.removeprefix("error: ") for k in kinds],
            "client left mid-stream", "lost (no answer in 60 s)", "wrong answers"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total: Counter = Counter()
    for workload, c in result["outcomes"].items():
        total.update(c)
        row = [workload, str(sum(c.values())), str(c.get("ok", 0)), *[str(c.get(k, 0)) for k in kinds],
               str(c.get("left", 0)), str(c.get("hung", 0)), str(c.get("wrong", 0))]
        lines.append("| " + " | ".join(row) + " |")
    row = ["**all**", f"**{sum(total.values())}**", f"**{total.get('ok', 0)}**",
           *[f"**{total.get(k, 0)}**" for k in kinds], f"**{total.get('left', 0)}**", f"**{total.get('hung', 0)}**",
           f"**{total.get('wrong', 0)}**"]
    lines.append("| " + " | ".join(row) + " |")
    return lines


def _fault_table(result: dict[str, Any]) -> list[str]:
    lines = ["| t (s) | fault | what was done | errors until the next fault (by kind) | the last error |",
             "|---|---|---|---|---|"]
    faults = result["faults"]
    for i, f in enumerate(faults):
        end = faults[i + 1]["at"] if i + 1 < len(faults) else result["duration_s"] + load.REQUEST_TIMEOUT_S
        events = [(t, kind or outcome) for t, _, outcome, kind in result["events"]
                  if f["at"] <= t < end and outcome in ("error", "hung", "wrong")]
        window = Counter(kind for _, kind in events)
        last = f"+{max(t for t, _ in events) - f['at']:.1f} s" if events else "—"
        lines.append(f"| {f['at']:.0f} | {f['fault']} | {f['did']} | "
                     f"{', '.join(f'{k}: {n}' for k, n in window.most_common()) or '—'} | {last} |")
    return lines


def _status(r: dict[str, Any]) -> str:
    """The exit status (not known for a server started by a script, such as Triton's start.sh)."""
    return "exited" if r["exit_code"] is None else f"status {r['exit_code']}"


def _fd_change(before: dict[str, Any], after: dict[str, Any]) -> str:
    b, a = before.get("fd_kinds", {}), after.get("fd_kinds", {})
    changed = {k: a.get(k, 0) - b.get(k, 0) for k in {*a, *b} if a.get(k, 0) != b.get(k, 0)}
    return "".join(f"; {n:+d} {k}" for k, n in sorted(changed.items()))


def _resources(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| server | RSS before → after (MiB) | descriptors before → after | threads | children (RSS MiB) "
             "| exit after SIGTERM | child processes left | /dev/shm entries left | temp folders left |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, a = r["before"], r["after"]
        ended = f"{_status(r)} in {r['exit_s']} s" if r["exited"] else f"still running {r['exit_s']:.0f} s later"
        tmp = "—" if r["tmp_left"] is None else f"{len(r['tmp_left'])} {' '.join(r['tmp_left'][:4])}"
        if r.get("tmp_foreign"):
            tmp += f" (and another library's: {'; '.join(r['tmp_foreign'])})"
        lines.append(
            f"| {r['target']} | {b['rss_mib']} → {a['rss_mib']} ({a['rss_mib'] - b['rss_mib']:+.1f}) "
            f"| {b['fds']} → {a['fds']} ({a['fds'] - b['fds']:+d}{_fd_change(b, a)}) | {b['threads']} → {a['threads']} "
            f"| {b['children']} ({b['children_rss_mib']}) → {a['children']} ({a['children_rss_mib']}) "
            f"| {ended} | {len(r['children_left'])} of {r['children_seen']} seen "
            f"| {len(r['shm_left'])} {' '.join(r['shm_left'][:4])} | {tmp} |")
    return lines


def _summary(results: list[dict[str, Any]]) -> list[str]:
    """The servers side by side: every request's outcome, the resources, what was left."""
    def totals(r: dict[str, Any]) -> Counter:
        total: Counter = Counter()
        for c in r["outcomes"].values():
            total.update(c)
        return total

    rows: list[tuple[str, Callable[[dict[str, Any], Counter], str]]] = [
        ("requests", lambda r, t: str(sum(t.values()))),
        ("answered right", lambda r, t: str(t.get("ok", 0))),
        ("a clear error naming the fault", lambda r, t: str(sum(n for k, n in t.items()
                                                                 if k.startswith("error") and k != "error: other"))),
        ("an error naming no known fault", lambda r, t: str(t.get("error: other", 0))),
        ("client left mid-stream (on purpose)", lambda r, t: str(t.get("left", 0))),
        ("**lost** (no answer in 60 s)", lambda r, t: f"**{t.get('hung', 0)}**"),
        ("**wrong answers**", lambda r, t: f"**{t.get('wrong', 0)}**"),
        ("server RSS before → after (MiB)", lambda r, t: f"{r['before']['rss_mib']} → {r['after']['rss_mib']}"),
        ("descriptors before → after", lambda r, t: f"{r['before']['fds']} → {r['after']['fds']}"),
        ("every model serves after the faults", lambda r, t: "yes" if r["models_ready_after"] and all(
            set(c) == {"ok"} for c in r["after_pass"].values()) else f"no: {r['after_pass']}"),
        ("exit after SIGTERM", lambda r, t: (f"{_status(r)} in {r['exit_s']} s" if r["exited"]
                                             else "did not exit")),
        ("child processes left", lambda r, t: f"{len(r['children_left'])} of {r['children_seen']} seen"),
        ("/dev/shm entries left", lambda r, t: str(len(r["shm_left"]))),
        ("temporary files left", lambda r, t: "not checked" if r["tmp_left"] is None else str(len(r["tmp_left"]))),
    ]
    lines = ["| | " + " | ".join(r["target"] for r in results) + " |", "|---|" + "---|" * len(results)]
    counted = [(r, totals(r)) for r in results]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r, t) for r, t in counted) + " |")
    return lines


def write_report(results: list[dict[str, Any]], notes: list[str], quick: bool, started: dict[str, str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "chaos" + ("-quick" if quick else "")
    md, raw = RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"
    lines = ["# Fault campaign: every request counted while the server is hurt", "",
             f"- run: {started['date']} – {time.strftime('%H:%M:%S')}; git: {git_describe()}; machine: {machine()}; "
             f"load average at start {started['load']}, at end {loadavg()}",
             "- the 2 cores are shared by the server, its child processes, the load generator (one thread "
             "per workload) and the models: timings are this machine's, counts are what matters",
             "- `python -m bench.chaos` (bench/chaos.py; models bench/chaos_models.py, load bench/chaos_load.py)",
             ""]
    lines += ["## Side by side", "", *_summary(results), ""]
    for r in results:
        lines += [f"## {r['target']}", "", f"{r['duration_s']:.0f} s of load.", ""] + _table(r) + [""]
        lines += _fault_table(r) + [""]
        if r["after_pass"]:
            lines.append(f"- after the load, every workload once more: {r['after_pass']}"
                         + (f" ({r['after_pass_examples']})" if r["after_pass_examples"] else ""))
        if r["last_words"]:
            lines.append("- the server's last log lines after SIGTERM: "
                         + " / ".join(f"`{w}`" for w in r["last_words"]))
        if r["stuck_clients"]:
            lines.append(f"- client threads still waiting at the end: {', '.join(r['stuck_clients'])}")
        examples = [f"`{k}`: {v}" for k, v in r["examples"].items() if not k.endswith("/ left")]
        if examples:
            lines += ["- one message of each kind:"] + [f"  - {e}" for e in examples]
        lines.append("")
    lines += ["## Resources and what is left", "", *_resources(results), ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    md.write_text("\n".join(lines))
    raw.write_text(json.dumps({"started": started, "git": git_describe(), "machine": machine(), "results": results,
                               "notes": notes}, indent=1, default=str))
    log(f"wrote {md}")
    return md


# ---- main ----------------------------------------------------------------------------------

PIER_FLAGS = ("--model-control-mode=poll", "--repository-poll-secs=2", "--exit-timeout-secs=30")
TRITON_FLAGS = ("--model-control-mode=poll", "--repository-poll-secs=2", "--exit-timeout-secs=30")
SHARED_MODELS = ["addsub_py", "count_py", "seq_py", "ens_py"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 180; 60 with --quick)")
    p.add_argument("--quick", action="store_true", help="a short smoke run (60 s): writes chaos-quick.*")
    p.add_argument("--only", default="pier,pier-frontends,triton", help="comma-separated: pier, pier-frontends, triton")
    args = p.parse_args(argv)
    duration = args.duration or (60.0 if args.quick else 180.0)
    started = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load": loadavg()}
    results, notes, failed = [], [], []
    for which in args.only.split(","):
        try:
            with temp_dir("chaos-") as scratch, Servers() as servers:
                repo = scratch / "repo"
                pier = which != "triton"
                write_repository(repo, pier_extras=pier)
                models = SHARED_MODELS + (["simple", "tiny_llama"] if pier else [])
                if pier:
                    frontends = 2 if which == "pier-frontends" else 0
                    flags = (*PIER_FLAGS, *((f"--frontend-processes={frontends}",) if frontends else ()))
                    label = "Pier" + (f" --frontend-processes {frontends}" if frontends else "")
                    tmp = scratch / "tmp"
                    tmp.mkdir()
                    server = servers.add(label, functools.partial(start_pier, label.replace(" ", "_"), repo, *flags,
                                                                  timeout=300, env={"TMPDIR": str(tmp)}),
                                         required=True)
                else:
                    frontends, tmp = 0, None
                    label = "Triton 2.51 (python backend)"
                    server = servers.add(label, functools.partial(start_triton, repo, extra=TRITON_FLAGS))
                    if server is None:
                        notes += servers.left_out_notes()
                        continue
                assert server is not None
                target = Target(label, server, repo, pier, frontends, tmp)
                if not _wait_ready(target, models):
                    raise RuntimeError(f"{label}: the models are not ready:\n{server.log_tail(40)}")
                results.append(campaign(target, duration, models))
        except Exception:
            traceback.print_exc()
            failed.append(which)
    if results:
        write_report(results, notes + [f"{w}: could not run (see the log)" for w in failed], args.quick, started)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
