# Two commands for a fresh machine:  make serve   |   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PA_DIR ?= $(HOME)/opt/perf-analyzer
PA_INSTALL := ../shared/tools/perf-analyzer/install.sh

.PHONY: serve test lint unit perf-analyzer models pipeline protos bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q 'torch==2.13.0'  # pinned: the TorchScript tests' torch, a CPU build where one is on disk
	$(PY) -m pip install -q -e '.[test]'
	touch $@

serve: $(VENV)/.installed  ## serve the example repository on :8000 (HTTP) :8001 (gRPC) :8002 (metrics)
	$(VENV)/bin/pier serve --model-repository model_repository

test: $(VENV)/.installed perf-analyzer lint  ## lint, then every test (unit + e2e against real servers)
	PERF_ANALYZER=$(PA_DIR)/perf_analyzer $(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy server backends

unit: $(VENV)/.installed
	$(PY) -m pytest -q tests/server tests/backends

# NVIDIA perf_analyzer for the e2e check and the benchmarks (skipped when the installer is absent).
perf-analyzer:
	@if [ -x $(PA_DIR)/perf_analyzer ]; then :; \
	elif [ -f $(PA_INSTALL) ]; then bash $(PA_INSTALL) $(PA_DIR) >/dev/null || echo "perf_analyzer install failed: its test will skip"; \
	else echo "no $(PA_INSTALL): the perf_analyzer test will skip"; fi

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

model_repository/text_embedding/1/model.onnx: | $(VENV)/.bench-installed
	HF_HUB_OFFLINE=1 $(PY) scripts/export_text_embedding.py

bench: $(VENV)/.bench-installed perf-analyzer model_repository/text_embedding/1/model.onnx  ## side-by-side benchmarks -> bench/results/
	$(PY) -m bench.run

models: $(VENV)/.installed  ## rebuild the example models (byte-identical; the TorchScript one with torch 2.13.0)
	$(PY) scripts/build_example_models.py
	$(PY) scripts/build_torch_examples.py

pipeline: $(VENV)/.installed  ## build text_embedding + tokenizer + the embed ensemble into model_repository/
	HF_HUB_OFFLINE=1 $(PY) scripts/build_embed_pipeline.py

protos: $(VENV)/.installed  ## regenerate server/protocol from protos/
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
