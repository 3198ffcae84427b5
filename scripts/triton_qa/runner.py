"""Run Triton's upstream QA tests (unedited) against `pier serve` or the reference tritonserver.

    scripts/triton_qa.sh [--server pier|triton] [--suite NAME ...] [--list]

Prints PASS/FAIL/SKIP per case, then `N passed, M failed` and the skipped count with reasons; writes
build/triton_qa/<server>/summary.json (and every server/client log under build/triton_qa/<server>/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from scripts.triton_qa import sources
from scripts.triton_qa.plan import Check, Group, Pytest, Result, Script, Skip, Unit
from scripts.triton_qa.servers import REPO_ROOT, Pier, Running, ServerKind, Triton, wait_ports_free
from scripts.triton_qa.suites import SUITES

BUILD = REPO_ROOT / "build" / "triton_qa"
VENV = BUILD / "venv"
REQUIREMENTS = ["tritonclient[all]==2.51.0", "numpy<2", "pytest", "pytest-timeout", "pytest-asyncio", "requests",
                "sseclient-py", "psutil", "aiohttp", "geventhttpclient", "python-rapidjson"]
WRAPPER = Path(__file__).with_name("unit_wrapper.py")


def ensure_venv() -> str:
    """build/triton_qa/venv with what the upstream test files import (tritonclient 2.51.0 = Triton r24.10)."""
    py = VENV / "bin" / "python"
    stamp = VENV / ".qa-requirements"
    want = "\n".join(REQUIREMENTS)
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return str(py)
    print(f"creating {VENV} (pip install {' '.join(REQUIREMENTS)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    stamp.write_text(want)
    return str(py)


class Runner:
    def __init__(self, kind: ServerKind, work: Path, py: str, ctx: SimpleNamespace):
        self.kind, self.work, self.py, self.ctx = kind, work, py, ctx
        self.results: list[Result] = []
        self.seq = 0
        self.current: Running | None = None  # the server of the group being run (stopped on interruption)

    # ------------------------------------------------------------------ reporting
    def record(self, suite: str, case: str, status: str, detail: str = "", seconds: float = 0.0) -> None:
        for r in self.results:  # a later check on the same case (e.g. the state-release log check) can fail it
            if r.suite == suite and r.case == case:
                if status == "FAIL" and r.status != "FAIL":
                    r.status, r.detail = "FAIL", detail
                elif status == "FAIL":
                    r.detail += "\n" + detail
                return
        self.results.append(Result(suite, case, status, detail, seconds))
        line = f"{status} {suite}::{case}"
        if status != "PASS" and detail:
            line += "  -- " + detail.strip().splitlines()[-1][:200]
        print(line, flush=True)

    # ------------------------------------------------------------------ groups
    def run_group(self, suite: str, group: Group) -> None:
        self.seq += 1
        tag = f"{self.seq:03d}.{suite}.{group.label or 'group'}".replace("/", "_")
        logdir = self.work / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        server_log = logdir / f"{tag}.server.log"
        self.ctx.server_log = server_log
        if group.prepare:
            group.prepare(self.ctx)
        if group.no_server:
            for step in group.steps:
                self.run_step(suite, group, step, logdir, tag, None)
            return
        env = dict(group.env)
        server = Running(self.kind, group.flags, server_log, group.cwd, env)
        self.current = server
        if group.expect_start_failure is not None:
            name = f"server_start[{group.label}]"
            t0 = time.monotonic()
            ready, note = server.start(ready_timeout=30, expect_fail=True)
            server.stop()
            log = server_log.read_text(errors="replace")
            count = sum(1 for line in log.splitlines() if group.expect_start_failure in line)
            if ready:
                self.record(suite, name, "FAIL", "server started; expected it to refuse the flags",
                            time.monotonic() - t0)
            elif count != 1:
                tail = "\n".join(log.splitlines()[-5:])
                self.record(suite, name, "FAIL", f"server did not start ({note}) but its log has {count} lines with "
                            f"{group.expect_start_failure!r} (expected 1); log tail:\n{tail}", time.monotonic() - t0)
            else:
                self.record(suite, name, "PASS", "", time.monotonic() - t0)
            return
        ready, note = server.start(ready_timeout=self.ctx.start_timeout)
        if not ready:
            server.stop()
            tail = "\n".join(server_log.read_text(errors="replace").splitlines()[-8:])
            for step in group.steps:
                for case in self.case_names(step):
                    if isinstance(step, Skip):
                        self.record(suite, step.name, "SKIP", step.reason)
                    else:
                        self.record(suite, case, "FAIL", f"server failed to start ({note}); log tail:\n{tail}")
            return
        try:
            for step in group.steps:
                self.run_step(suite, group, step, logdir, tag, server)
        finally:
            if group.wait_server_exit:
                if server.wait(60) is None:
                    print(f"    {tag}: server still running 60 s after the test; stopping it", file=sys.stderr)
            rc = server.stop()
        if group.server_exit_zero and rc not in (0, None):
            for step in group.steps:
                for case in self.case_names(step):
                    self.record(suite, case, "FAIL", f"server shut down non-gracefully (exit status {rc})")
        for chk in group.after_stop:
            self.run_check(suite, chk)

    def case_names(self, step) -> list[str]:
        if isinstance(step, Unit):
            return [self.unit_case(step, t) for t in step.expect] or [f"{step.file}{step.suffix}"]
        if isinstance(step, Pytest):
            return [f"{step.file}{step.suffix}"]
        return [step.name]

    @staticmethod
    def unit_case(step: Unit, test_id: str) -> str:
        return f"{step.file}::{test_id.replace('.', '::')}{step.suffix}"

    def base_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.update(extra)
        return env

    def run_step(self, suite: str, group: Group, step, logdir: Path, tag: str, server: Running | None) -> None:
        if isinstance(step, Skip):
            self.record(suite, step.name, "SKIP", step.reason)
        elif isinstance(step, Check):
            self.run_check(suite, step)
        elif isinstance(step, Script):
            self.run_script(suite, group, step, logdir, tag, server)
        elif isinstance(step, Unit):
            self.run_unit(suite, group, step, logdir, tag, server)
        elif isinstance(step, Pytest):
            self.run_pytest(suite, group, step, logdir, tag)

    def run_check(self, suite: str, chk: Check) -> None:
        t0 = time.monotonic()
        try:
            why = chk.fn(self.ctx)
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        self.record(suite, chk.name, "PASS" if why is None else "FAIL", why or "", time.monotonic() - t0)

    def _run(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path,
             timeout: float) -> tuple[int | None, str]:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            rc: int | None = None
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:  # the client's whole process group, also when the runner itself is interrupted
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        return rc, log.read_text(errors="replace")

    def run_script(self, suite: str, group: Group, step: Script, logdir: Path, tag: str,
                   server: Running | None) -> None:
        log = logdir / f"{tag}.{step.name}.client.log".replace("/", "_").replace(" ", "_")
        t0 = time.monotonic()
        rc, out = self._run(step.argv, group.cwd, self.base_env(step.env), log, step.timeout)
        problems = []
        if rc is None:
            problems.append(f"timed out after {step.timeout:.0f} s")
        elif (rc == 0) != step.expect_rc0:
            problems.append(f"exit status {rc}" + ("" if step.expect_rc0 else " (expected non-zero)"))
        lines = out.splitlines()
        for pattern, n in step.grep_eq.items():
            got = sum(1 for line in lines if pattern in line)
            if got != n:
                problems.append(f"{got} output lines with {pattern!r}, expected {n}")
        for pattern, n in step.grep_min.items():
            got = sum(1 for line in lines if pattern in line)
            if got < n:
                problems.append(f"{got} output lines with {pattern!r}, expected >= {n}")
        if step.server_log_min and server is not None:
            slog = server.log.read_text(errors="replace").splitlines()
            for pattern, n in step.server_log_min.items():
                got = sum(1 for line in slog if pattern in line)
                if got < n:
                    problems.append(f"server log has {got} lines with {pattern!r}, expected >= {n}")
        detail = ""
        if problems:
            tail = "\n".join(lines[-15:])
            detail = "; ".join(problems) + f"\n--- output tail ({log}):\n{tail}"
        self.record(suite, step.name, "FAIL" if problems else "PASS", detail, time.monotonic() - t0)

    def run_unit(self, suite: str, group: Group, step: Unit, logdir: Path, tag: str,
                 server: Running | None) -> None:
        name = f"{step.file}{''.join('.' + a for a in step.args)}{step.suffix}"
        log = logdir / f"{tag}.{name}.client.log".replace("/", "_")
        res = logdir / f"{tag}.{name}.results.jsonl".replace("/", "_")
        res.unlink(missing_ok=True)
        env = self.base_env({**group.env, **step.env, "QA_RESULT_JSON": str(res)})
        if group.server_pid_env and server is not None:
            env["SERVER_PID"] = str(server.pid)
        if group.server_log_env and server is not None:
            env["SERVER_LOG"] = str(server.log)
        t0 = time.monotonic()
        rc, out = self._run([self.py, str(WRAPPER), step.file, *step.args], group.cwd, env, log, step.timeout)
        elapsed = time.monotonic() - t0
        seen = []
        if res.exists():
            for line in res.read_text().splitlines():
                rec = json.loads(line)
                seen.append(rec["id"])
                status = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[rec["outcome"]]
                self.record(suite, self.unit_case(step, rec["id"]), status, rec["detail"], 0.0)
        missing = [t for t in step.expect if t not in seen]
        tail = "\n".join(out.splitlines()[-15:])
        why = f"timed out after {step.timeout:.0f} s" if rc is None else f"exit status {rc}"
        for t in missing:
            self.record(suite, self.unit_case(step, t), "FAIL", f"did not run/finish ({why}); output tail:\n{tail}")
        if not seen and not step.expect:
            self.record(suite, f"{step.file}{step.suffix}", "FAIL", f"no test ran ({why}); output tail:\n{tail}",
                        elapsed)
        elif rc is None and not missing:
            print(f"    {name}: timed out after {step.timeout:.0f} s (after its tests)", file=sys.stderr)

    def run_pytest(self, suite: str, group: Group, step: Pytest, logdir: Path, tag: str) -> None:
        name = f"{step.file}{step.suffix}"
        log = logdir / f"{tag}.{name}.client.log".replace("/", "_")
        xml = logdir / f"{tag}.{name}.junit.xml".replace("/", "_")
        xml.unlink(missing_ok=True)
        targets = [f"{step.file}::{s}" for s in step.selectors] or [step.file]
        argv = [self.py, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-rA",
                f"--timeout={step.case_timeout:.0f}", f"--junitxml={xml}", *targets]
        env = self.base_env({**group.env, **step.env})
        rc, out = self._run(argv, group.cwd, env, log, step.timeout)
        count = 0
        if xml.exists():
            for tc in ET.parse(xml).getroot().iter("testcase"):
                count += 1
                cls = tc.get("classname", "").split(".")[-1]
                case = f"{step.file}::{cls}::{tc.get('name')}{step.suffix}"
                bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
                skipped = tc.find("skipped")
                if bad is not None:
                    self.record(suite, case, "FAIL", (bad.get("message") or "") + "\n" + (bad.text or ""),
                                float(tc.get("time", 0)))
                elif skipped is not None:
                    self.record(suite, case, "SKIP", skipped.get("message") or "")
                else:
                    self.record(suite, case, "PASS", "", float(tc.get("time", 0)))
        if count < step.expect_min:
            why = f"timed out after {step.timeout:.0f} s" if rc is None else f"exit status {rc}"
            tail = "\n".join(out.splitlines()[-15:])
            self.record(suite, f"{name}[{step.expect_min - count} of {step.expect_min} not run]", "FAIL",
                        f"{why}; output tail:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/triton_qa.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=["pier", "triton"], default="pier")
    ap.add_argument("--suite", action="append", choices=list(SUITES), help="run only these suites (repeatable)")
    ap.add_argument("--group", action="append", metavar="LABEL",
                    help="run only the server groups with this label (repeatable; e.g. dyna: the -d client examples)")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="seconds for a server to become ready")
    ap.add_argument("--list", action="store_true", help="list the suites and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(SUITES))
        return 0

    src = sources.locate()
    if isinstance(src, str):
        print(f"skipped: upstream QA sources not found at {src}")
        return 0
    kind: ServerKind = Pier() if args.server == "pier" else Triton()
    missing = kind.available()  # type: ignore[attr-defined]
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    busy = wait_ports_free(timeout=2)
    if busy:
        print(f"error: ports {busy} are in use; the upstream tests expect localhost:8000/8001/8002", file=sys.stderr)
        return 2

    py = ensure_venv()
    work = BUILD / args.server
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    qa, pyexamples, repeat_cfg = sources.extract(src, work)
    bindir = work / "bin"
    bindir.mkdir()
    kind.shim(bindir / "tritonserver")
    ctx = SimpleNamespace(qa=qa, py=py, pyexamples=pyexamples, repeat_src_config=repeat_cfg, bindir=bindir,
                          path=os.environ.get("PATH", ""), server=args.server, start_timeout=args.start_timeout,
                          server_log=None)
    runner = Runner(kind, work, py, ctx)
    t0 = time.monotonic()

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    try:
        for suite in args.suite or list(SUITES):
            print(f"=== {suite}", flush=True)
            try:
                groups = SUITES[suite](ctx)
            except Exception as e:  # noqa: BLE001
                runner.record(suite, "setup", "FAIL", f"building the suite failed: {type(e).__name__}: {e}")
                continue
            for group in groups:
                if not args.group or group.label in args.group:
                    runner.run_group(suite, group)
    except KeyboardInterrupt:
        print("interrupted: stopping the server; the summary covers the cases run so far", file=sys.stderr)
    finally:
        if runner.current is not None:
            runner.current.stop(grace=10)

    counts = Counter(r.status for r in runner.results)
    summary = {
        "server": args.server, "seconds": round(time.monotonic() - t0, 1),
        "passed": counts["PASS"], "failed": counts["FAIL"], "skipped": counts["SKIP"],
        "sources": {k: str(v) for k, v in src.items()},
        "cases": [r.__dict__ for r in runner.results],
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    reasons = Counter(r.detail for r in runner.results if r.status == "SKIP")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed")
    print(f"{counts['SKIP']} skipped: " + "; ".join(f"{n} {why}" for why, n in reasons.most_common()))
    print(f"summary: {work / 'summary.json'}; logs: {work / 'logs'}")
    return 1 if counts["FAIL"] else 0
