#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU (run from the repository root; installs nothing).
# Runs the GPU-only tests (ONNX Runtime CUDA / TensorRT execution providers) and prints a table.
# Needs: python3 with Pier's dependencies and onnxruntime-gpu; tests skip, with the reason,
# when a piece is missing, and the table says which.
#   bash scripts/gpu_check.sh [PYTHON]
set -uo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" - <<'PY'
import importlib
for mod in ("onnxruntime", "tensorrt", "torch", "tritonclient.grpc", "orjson", "aiohttp", "grpc"):
    try:
        m = importlib.import_module(mod)
        extra = ""
        if mod == "onnxruntime":
            extra = " providers=" + ",".join(m.get_available_providers())
        print(f"{mod:20s} {getattr(m, '__version__', '?')}{extra}")
    except Exception as exc:
        print(f"{mod:20s} MISSING ({type(exc).__name__}: {exc})")
PY
"$PY" -m pytest -q -rA tests/backends/test_onnxruntime_gpu.py > /tmp/pier_gpu_check.log 2>&1
echo
echo "| result | check |"
echo "|---|---|"
grep -E '^(PASSED|FAILED|SKIPPED|ERROR)' /tmp/pier_gpu_check.log | sed -E 's/^([A-Z]+) (.*)$/| \1 | \2 |/'
grep -qE '^(FAILED|ERROR)' /tmp/pier_gpu_check.log && { tail -40 /tmp/pier_gpu_check.log; exit 1; }
exit 0
