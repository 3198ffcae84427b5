"""Where the benchmark tools are (perf_analyzer, the reference Triton, vLLM and the bare Python
servers), installing them when missing.

Environment variables (all optional):
  PIER_REFERENCE_TOOLS  folder of reference tools for the side-by-side rows, laid out as
                        perf-analyzer/, triton-reference/, vllm-reference/, python-limit/
                        (no default: when unset, the Triton, vLLM and bare python-limit rows are
                        skipped with a note in the report; see reference_tools())
  PERF_ANALYZER         perf_analyzer executable                 (default $PERF_ANALYZER_DIR/perf_analyzer)
  PERF_ANALYZER_DIR     perf_analyzer install dir                (default ~/opt/perf-analyzer)
  TRITON_DIR            reference Triton install dir             (default ~/opt/triton)
  PYTHON_LIMIT_DIR      folder with bare_http.py / bare_grpc.py  (default $PIER_REFERENCE_TOOLS/python-limit)
  PIER                  command that starts Pier, split on spaces (default: `pier` next to this Python,
                                                                  else `python -m pier`; `serve ...` follows)
A missing perf_analyzer is installed with this repository's scripts/install_perf_analyzer.sh (then,
if that fails, with $PIER_REFERENCE_TOOLS/perf-analyzer/install.sh); a missing Triton with
$PIER_REFERENCE_TOOLS/triton-reference/install.sh. If that fails or is not there, the benchmark
leaves that server out and says so in its report.
"""


from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bench.common import ROOT, log

REFERENCE_TOOLS_ENV = "PIER_REFERENCE_TOOLS"


def reference_tools() -> Path | None:
    """The folder named by $PIER_REFERENCE_TOOLS (perf-analyzer/, triton-reference/, vllm-reference/,
    python-limit/), or None when the variable is unset or empty or names no existing folder. There is
    no default: without it every side-by-side row that needs a reference tool is skipped."""
    value = os.environ.get(REFERENCE_TOOLS_ENV, "").strip()
    if not value:
        return None
    d = Path(value).expanduser()
    return d if d.is_dir() else None


def reference_tool(name: str) -> Path | None:
    """$PIER_REFERENCE_TOOLS/<name> (e.g. "triton-reference"), or None when it is not there."""
    base = reference_tools()
    if base is None or not (base / name).is_dir():
        return None
    return base / name


def reference_missing(name: str, row: str) -> str:
    """The report note for a row skipped because $PIER_REFERENCE_TOOLS/<name>/ is not there."""
    note = f"{REFERENCE_TOOLS_ENV} is not set (or has no {name}/): {row} skipped"
    value = os.environ.get(REFERENCE_TOOLS_ENV, "").strip()
    if value and reference_tools() is None:
        note += f" ({REFERENCE_TOOLS_ENV}={value} is not a folder)"
    return note


class ToolMissing(RuntimeError):
    """A reference tool is not there: the row is skipped, and str(exc) is the report's whole note."""


def _install(script: Path, target: Path, what: str) -> Path | None:
    """Run `bash script target`; returns the path the script printed last (None on failure)."""
    if not script.is_file():
        log(f"{what}: not installed at {target} and no {script}")
        return None
    log(f"{what}: installing into {target} with {script} (once)")
    try:
        proc = subprocess.run(["bash", str(script), str(target)], check=True, timeout=1800,
                              capture_output=True, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        log(f"{what}: install failed: {exc}" + (f"\n{err.strip()[-1500:]}" if err.strip() else ""))
        return None
    lines = [ln.strip() for ln in (proc.stdout or "").splitlines() if ln.strip()]
    return Path(lines[-1]) if lines else target


PERF_ANALYZER_INSTALLER = ROOT / "scripts" / "install_perf_analyzer.sh"
PERF_ANALYZER_MISSING = ("perf_analyzer not available: set PERF_ANALYZER (the binary) or PERF_ANALYZER_DIR, "
                         "or install it with `bash scripts/install_perf_analyzer.sh DIR`")


def perf_analyzer() -> Path | None:
    """The perf_analyzer executable: $PERF_ANALYZER, else $PERF_ANALYZER_DIR/perf_analyzer (default
    ~/opt/perf-analyzer), installed there when missing with scripts/install_perf_analyzer.sh, and
    only if that fails with $PIER_REFERENCE_TOOLS/perf-analyzer/install.sh (when that folder is set)."""
    if os.environ.get("PERF_ANALYZER"):
        p = Path(os.environ["PERF_ANALYZER"])
        return p if p.exists() else None
    d = Path(os.environ.get("PERF_ANALYZER_DIR", Path.home() / "opt" / "perf-analyzer"))
    exe = d / "perf_analyzer"
    if exe.exists():
        return exe
    installers = [PERF_ANALYZER_INSTALLER]
    ref = reference_tool("perf-analyzer")
    if ref is not None:
        installers.append(ref / "install.sh")
    for script in installers:
        printed = _install(script, d, "perf_analyzer")
        if exe.exists():
            return exe
        if printed is not None and printed.is_file():
            return printed
    return None


def perf_analyzer_required() -> Path:
    """perf_analyzer() or a RuntimeError saying how to get it (the benchmarks that drive with it need it)."""
    pa = perf_analyzer()
    if pa is None:
        raise RuntimeError(PERF_ANALYZER_MISSING)
    return pa


def triton_dir() -> Path | None:
    """The reference Triton install dir ($TRITON_DIR, default ~/opt/triton), installed when missing
    with $PIER_REFERENCE_TOOLS/triton-reference/install.sh; None when it is not installed and cannot be."""
    d = Path(os.environ.get("TRITON_DIR", Path.home() / "opt" / "triton"))

    def ok() -> bool:
        return (d / "backends" / "python" / "triton_python_backend_stub").exists() and (d / "pyenv").is_dir()

    if not ok():
        ref = reference_tool("triton-reference")
        if ref is None:
            log(f"triton: not installed at {d}; " + reference_missing("triton-reference", "its install"))
        else:
            _install(ref / "install.sh", d, "triton")
    return d if ok() else None


def python_limit_dir() -> Path | None:
    """The folder with bare_http.py / bare_grpc.py: $PYTHON_LIMIT_DIR, else
    $PIER_REFERENCE_TOOLS/python-limit; None when neither has both scripts."""
    if os.environ.get("PYTHON_LIMIT_DIR"):
        d: Path | None = Path(os.environ["PYTHON_LIMIT_DIR"])
    else:
        d = reference_tool("python-limit")
    if d is None:
        return None
    return d if (d / "bare_http.py").is_file() and (d / "bare_grpc.py").is_file() else None


