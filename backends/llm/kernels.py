"""Pier's compiled CPU kernels for the LLM engine, built on first use with torch's C++ extension tools.

`csrc/paged_attention.cpp` is compiled once per machine and torch version (about 10 s; cached under
`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) and loaded as the `torch.ops.pier_llm`
namespace. Where no C++ compiler is present the build fails once, is logged, and the engine keeps
the pure-torch attention.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("csrc") / "paged_attention.cpp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def paged_decode_attention() -> Callable[..., None] | None:
    """`torch.ops.pier_llm.paged_decode_attention`, building it on the first call; None if it cannot build."""
    with _lock:
        if "op" not in _state:
            _state["op"] = _build()
        return _state["op"]  # type: ignore[return-value]


def _build() -> Callable[..., None] | None:
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the `ninja` wheel's binary, when no system ninja is on PATH
            import ninja  # type: ignore[import-not-found]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        start = time.monotonic()
        log.info("loading the LLM CPU kernels (compiled on first use on this machine, about 10 s)")
        cpp_extension.load(
            name="pier_llm_kernels",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-fopenmp"],  # OpenMP: ATen's parallel_for is header code
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        log.info("LLM CPU kernels ready in %.1f s", time.monotonic() - start)
        return torch.ops.pier_llm.paged_decode_attention
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("LLM CPU kernels unavailable, using torch attention instead: %s", str(exc).splitlines()[0][:300])
        return None
