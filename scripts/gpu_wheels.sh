#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the Python 3.12 wheels that the GPU machines lack for Pier
# and its GPU checks: the machine's image has torch, numpy, aiohttp, uvloop, onnxruntime (CPU),
# prometheus-client and pytest, but not these (and nothing can be fetched there). Versions are the
# ones this checkout is tested with. Then, in the device run (see scripts/gpu_check.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
    grpcio==1.85.3 protobuf==6.33.6 orjson==3.13.0 watchdog==7.1.0 requests-toolbelt==1.0.0 \
    tritonclient==2.73.0 python-rapidjson geventhttpclient gevent greenlet zope.event zope.interface brotli
du -sh .whl && ls .whl
