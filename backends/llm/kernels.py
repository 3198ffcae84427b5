"""Pier's compiled CPU kernels for the LLM engine, built on first use with torch's C++ extension tools.

`csrc/paged_attention.cpp` (decode attention over the paged cache), `csrc/layer_ops.cpp` (RMSNorm,
SiLU * up, RoPE + K/V cache write) and `csrc/quant_linear.cpp` (projections on 4- and 8-bit packed
weights, layers/quantized.py) are compiled once per machine and torch version (about 15 s;
cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) and loaded as the
`torch.ops.pier_llm` namespace. Where no C++ compiler is present the build fails once, is logged,
and the engine keeps the pure-torch path.

Processes load them one at a time under an flock of their build folder, which the kernel releases
when its holder dies. torch's own guard is a `lock` file that a process killed while it loads leaves
behind, and torch waits for that file to go away, forever: every later load on the machine would
hang. Under the flock, a `lock` file can only be such a leftover, and it is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "layer_ops.cpp", "quant_linear.cpp")]
_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> Any | None:
    """The `torch.ops.pier_llm` namespace, building it on the first call; None if it cannot build."""
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _build()
        return _state["ops"]


def paged_decode_attention() -> Callable[..., None] | None:
    """`torch.ops.pier_llm.paged_decode_attention`, or None when the kernels cannot build."""
    ops = load()
    return None if ops is None else ops.paged_decode_attention


def _digest() -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _build() -> Any | None:
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when no system ninja is on PATH
            import ninja  # type: ignore[import-not-found]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        start = time.monotonic()
        log.info("loading the LLM CPU kernels (compiled on first use on this machine, about 15 s)")
        # The sources' digest names the library: checkouts with different kernels keep one cached
        # build each instead of rebuilding over each other in the shared cache folder, and a header
        # change rebuilds too (torch's versioning hashes only the sources).
        name = f"pier_llm_kernels_{_digest()}"
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        with open(folder / "pier.lock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # one loader at a time; released when this process dies
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a process that died while it loaded the kernels", stale)
                stale.unlink(missing_ok=True)
            cpp_extension.load(
                name=name, build_directory=str(folder), sources=[str(s) for s in _SOURCES],
                # OpenMP: ATen's parallel_for is header code.
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
                verbose=False)
        log.info("LLM CPU kernels ready in %.1f s", time.monotonic() - start)
        return torch.ops.pier_llm
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("LLM CPU kernels unavailable, using torch attention instead: %s", str(exc).splitlines()[0][:300])
        return None
