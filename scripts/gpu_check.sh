#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU (run from the repository root; installs nothing).
# Runs the GPU-only checks and prints a table: ONNX Runtime's CUDA / TensorRT execution
# providers; a TensorRT engine built from the mlp_onnx example by scripts/build_trt_engine.py,
# served by Pier (tensorrt_plan) and compared with onnxruntime; the TorchScript example on CUDA
# compared with the CPU; the LLM engine on CUDA (greedy tokens vs transformers on the same GPU,
# and under swap preemption), and in its own process (device auto: CUDA there; kill -9, restart);
# FP8 checkpoints on CUDA (block-wise weight-only vs transformers; torch._scaled_mm W8A8 on sm89+).
# Then the frontend-processes table on the machine's cores (issue 22, where perf_analyzer is there),
# and the GPU text_embedding table (issue 3): bench/text_embedding_gpu.py, Pier with and without
# dynamic batching vs the module called directly on the GPU; its files go to $OUT when set.
# And the GPU image (docker/Dockerfile.gpu, on its default CUDA base or GPU_IMAGE_BASE): built, then
# asked inside for CUDA (torch) and ONNX Runtime's CUDA provider; a row says SKIPPED where Docker or
# the base image cannot be had (the borrowed machines have no Docker and reach no registry).
# Needs: python3 with Pier's dependencies, onnxruntime-gpu, tensorrt and a CUDA build of torch
# (pier[gpu]); checks skip, with the reason, when a piece is missing, and the table says which.
#   bash scripts/gpu_check.sh [PYTHON]
# On the borrowed GPU machines (Python 3.12, torch, no network), run scripts/gpu_wheels.sh here
# first, carry .whl, and start the device command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site && bash scripts/gpu_check.sh
set -uo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/.."
# Pier as the package `pier` without installing it (no setuptools needed): the same mapping as
# pyproject.toml's package-dir, server/ -> pier and backends/ -> pier.backends, as a link tree.
TREE=$(mktemp -d)/pier
mkdir -p "$TREE"
for f in server/*; do ln -s "$PWD/$f" "$TREE/"; done
ln -s "$PWD/backends" "$TREE/backends"
export PYTHONPATH=$PWD:$(dirname "$TREE")${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
"$PY" - <<'PY'
import importlib
for mod in ("onnxruntime", "tensorrt", "torch", "tritonclient.grpc", "orjson", "aiohttp", "grpc"):
    try:
        m = importlib.import_module(mod)
        extra = ""
        if mod == "onnxruntime":
            extra = " providers=" + ",".join(m.get_available_providers())
        if mod == "torch":
            extra = f" cuda={m.cuda.is_available()} devices={m.cuda.device_count()}"
        print(f"{mod:20s} {getattr(m, '__version__', '?')}{extra}")
    except Exception as exc:
        print(f"{mod:20s} MISSING ({type(exc).__name__}: {exc})")
PY
LOG=/tmp/pier_gpu_check.log
"$PY" -m pytest -q -rA tests/backends/test_onnxruntime_gpu.py tests/backends/test_tensorrt.py \
    "tests/backends/test_pytorch.py::test_example_mlp_on_cuda_matches_cpu" \
    "tests/backends/llm/test_engine_greedy.py::test_cuda_matches_transformers_on_cuda" \
    "tests/backends/llm/test_quantization_fp8.py::test_fp8_on_cuda" \
    "tests/backends/llm/test_tensor_parallel.py::test_nccl_two_gpus_equal_one" \
    tests/backends/llm/test_engine_core.py > "$LOG" 2>&1
# The engine builder's command line too (the tests call the same build_engine function).
PLAN=/tmp/pier_gpu_check_mlp.plan
if ! "$PY" -c "import tensorrt" 2>/dev/null; then
    echo "SKIPPED scripts/build_trt_engine.py: no tensorrt package" >> "$LOG"
elif "$PY" scripts/build_trt_engine.py model_repository/mlp_onnx/1/model.onnx "$PLAN" >> "$LOG" 2>&1; then
    echo "PASSED scripts/build_trt_engine.py mlp_onnx -> $PLAN ($(stat -c %s "$PLAN") bytes)" >> "$LOG"
else
    echo "FAILED scripts/build_trt_engine.py mlp_onnx -> $PLAN" >> "$LOG"
fi
# The GPU text_embedding table (a benchmark, quick windows: about 2 minutes).
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    if timeout 600 "$PY" -m bench.text_embedding_gpu --quick >> "$LOG" 2>&1; then
        echo "PASSED bench/text_embedding_gpu.py -> bench/results/text_embedding-gpu-quick.md" >> "$LOG"
        [ -n "${OUT:-}" ] && cp bench/results/text_embedding-gpu-quick.* "$OUT"/ 2>/dev/null
    else
        echo "FAILED bench/text_embedding_gpu.py" >> "$LOG"
    fi
else
    echo "SKIPPED bench/text_embedding_gpu.py: torch sees no CUDA device" >> "$LOG"
fi
# Tensor parallelism, 1 vs 2 ranks (issue 35): NCCL, one rank per GPU; needs two GPUs.
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then
    if timeout 600 "$PY" -m bench.tensor_parallel --device cuda --out /tmp/tensor_parallel-gpu >> "$LOG" 2>&1; then
        echo "PASSED bench/tensor_parallel.py --device cuda -> /tmp/tensor_parallel-gpu.md" >> "$LOG"
        [ -n "${OUT:-}" ] && cp /tmp/tensor_parallel-gpu.* "$OUT"/ 2>/dev/null
    else
        echo "FAILED bench/tensor_parallel.py --device cuda" >> "$LOG"
    fi
else
    echo "SKIPPED bench/tensor_parallel.py --device cuda: needs 2 CUDA devices (NCCL, one rank per GPU)" >> "$LOG"
fi
# Frontend processes on the machine's cores (issue 22): identity_fp32, Pier with 0/1/2/4 frontend
# processes (vs Triton where PIER_REFERENCE_TOOLS has it), perf_analyzer where it is installed.
PA=${PERF_ANALYZER:-$HOME/opt/perf-analyzer/perf_analyzer}
if [ ! -x "$PA" ]; then
    echo "SKIPPED bench/frontend_processes.py: no perf_analyzer at $PA (PERF_ANALYZER=...)" >> "$LOG"
elif PERF_ANALYZER=$PA timeout 900 "$PY" -m bench.frontend_processes --quick --no-embedding >> "$LOG" 2>&1; then
    echo "PASSED bench/frontend_processes.py on $(nproc) cores -> bench/results/frontend_processes-quick.md" >> "$LOG"
    [ -n "${OUT:-}" ] && cp bench/results/frontend_processes-quick.* "$OUT"/ 2>/dev/null
else
    echo "FAILED bench/frontend_processes.py" >> "$LOG"
fi
# The GPU image: where Docker runs and the CUDA base image is here or can be pulled.
GPU_BASE=${GPU_IMAGE_BASE:-$(sed -n 's/^ARG BASE_IMAGE=//p' docker/Dockerfile.gpu)}
DOCKER_BIN=$(command -v docker || true)
SECRET=()
[ -s /etc/ssl/certs/ca-certificates.crt ] && SECRET=(--secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt)
if [ -z "$DOCKER_BIN" ] || ! "$DOCKER_BIN" info >/dev/null 2>&1; then
    echo "SKIPPED docker/Dockerfile.gpu build: no Docker daemon on this machine" >> "$LOG"
elif ! "$DOCKER_BIN" image inspect "$GPU_BASE" >/dev/null 2>&1 \
        && ! timeout 900 "$DOCKER_BIN" pull -q "$GPU_BASE" >> "$LOG" 2>&1; then
    echo "SKIPPED docker/Dockerfile.gpu build: its base image $GPU_BASE cannot be pulled" >> "$LOG"
elif ! DOCKER_BUILDKIT=1 timeout 3600 "$DOCKER_BIN" build -q -f docker/Dockerfile.gpu -t pier:gpu-check \
        --build-arg "BASE_IMAGE=$GPU_BASE" "${SECRET[@]}" . >> "$LOG" 2>&1; then
    echo "FAILED docker/Dockerfile.gpu build on $GPU_BASE" >> "$LOG"
elif timeout 300 "$DOCKER_BIN" run --rm --gpus all --entrypoint python pier:gpu-check -c \
        "import onnxruntime as o, torch; assert torch.cuda.is_available(); assert 'CUDAExecutionProvider' in o.get_available_providers(), o.get_available_providers()" \
        >> "$LOG" 2>&1; then
    echo "PASSED docker/Dockerfile.gpu on $GPU_BASE: in the image torch sees CUDA, onnxruntime has CUDAExecutionProvider" >> "$LOG"
else
    echo "FAILED docker/Dockerfile.gpu on $GPU_BASE: built, but in it torch or onnxruntime sees no CUDA" >> "$LOG"
fi
echo
echo "| result | check |"
echo "|---|---|"
grep -E '^(PASSED|FAILED|SKIPPED|ERROR)' "$LOG" | sed -E 's/^([A-Z]+) (.*)$/| \1 | \2 |/'
[ -f bench/results/text_embedding-gpu-quick.md ] && sed -n '/## Targets/,/^- Pier rows/p' bench/results/text_embedding-gpu-quick.md
grep -qE '^(FAILED|ERROR)' "$LOG" && { tail -60 "$LOG"; exit 1; }
exit 0
