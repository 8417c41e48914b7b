# Two commands: `make lab` to learn, `make test` to check everything.
# Both create .venv if missing and install minipar with its dependencies; torch is
# pinned through constraints.txt so a CPU machine never pulls the CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup lab test test-fast test-full notebooks lint demo exercises clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=. notebooks/index.ipynb

# The whole suite: lint, engine tests, exercise checks, every notebook under nbval.
test: setup lint
	$(BIN)/python -m pytest -q tests
	$(MAKE) notebooks

# Engine tests only (no notebooks), for a quick loop while coding.
test-fast: setup
	$(BIN)/python -m pytest -q -x tests

# The exhaustive parity matrix (every layout x ZeRO stage x schedule); slow.
test-full: setup
	$(BIN)/python -m pytest -q tests --full

notebooks: setup
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax \
	    --nbval-sanitize-with notebooks/sanitize.cfg notebooks; \
	else echo "no notebooks yet"; fi

lint: setup
	$(BIN)/ruff check .

demo: setup
	$(BIN)/python -m minipar train --steps 30

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
