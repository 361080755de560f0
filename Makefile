# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
CONFIG ?= config.example.yaml
LISTEN ?= 127.0.0.1:8080
PG_URL_DEFAULT := postgres://postgres@127.0.0.1:5432/gpuproxy

.PHONY: run test install lint bench clean

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
	DATABASE_URL="$${DATABASE_URL:-$$(scripts/ensure-postgres)}" $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	@ls bench/*.py >/dev/null 2>&1 && for f in bench/*.py; do $(PY) $$f || exit 1; done || echo "no benchmarks yet"

clean:
	rm -rf $(VENV) var .pytest_cache
