#!/usr/bin/env bash
# Triton's upstream QA tests against `pier serve` (or --server triton): see docs/development.md.
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
exec "$PY" -m scripts.triton_qa "$@"
