# Two commands: `make lab` to learn, `make test` to check everything.
# Both create .venv if missing and install minipar with its dependencies; torch is
# pinned through constraints.txt so a CPU machine never pulls the CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup lab test test-fast test-full notebooks lint demo exercises clean

# The newer pip installs in about half the time of the one venv bundles. pip byte-compiles
# every package (~40 s of CPU): not skipped (--no-compile), since where
# PYTHONDONTWRITEBYTECODE is set (containers, CI) every process would then compile torch
# from source on import, 3 s more each.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt -e ".[dev,hf]"
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(BIN)/jupyter lab --notebook-dir=. notebooks/index.ipynb

# The whole suite: lint, engine tests, exercise checks, every notebook under nbval.
# Two pytest workers (pytest-xdist), a test module to each at a time: on 2 cores the
# spawned ranks of one test leave room for another's waits (tests/README.md has the times).
test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests
	$(MAKE) notebooks

# Engine tests only (no notebooks), for a quick loop while coding.
test-fast: setup
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile tests

# make test plus every test marked slow (tests/README.md lists them and why): the
# exhaustive parity matrix (every layout x ZeRO stage x schedule), the parity cases whose
# code path another case already covers, and every lesson in the browser. Hours on 2 cores.
test-full: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests --full
	$(MAKE) notebooks SPAWN_LESSONS="$$(ls notebooks/*.ipynb)"
	$(MAKE) test-browser BROWSER_FLAGS=--full

# Every notebook top to bottom under strict nbval (flags explained in notebooks/README.md).
# Committed notebooks carry no outputs (checked first), so each is executed into build/nbref/;
# nbval then re-runs those copies and requires every output to come out the same
# (after notebooks/sanitize.cfg) and no cell to fail.
# Beside them, two notebooks at a time, SPAWN_LESSONS are executed once more into
# build/nbspawn/ with every launch forced to spawn, as where fork is missing (Windows): the
# launcher lesson, whose cells launch functions of their own (such functions travel by
# value; minipar/launch.py); make test-full executes every lesson so. They go first
# (spawned ranks import torch: the longest runs). Their outputs are not compared: a
# spawned rank's imports count against a launch's short timeout, so lesson 00's hang
# demonstrations may stop a rank before it joins, a different (correct) report.
NBREF := build/nbref
NBSPAWN := build/nbspawn
SPAWN_LESSONS ?= notebooks/00_collectives_and_launcher.ipynb
notebooks: setup
	@if ! ls notebooks/*.ipynb >/dev/null 2>&1; then echo "no notebooks yet"; exit 0; fi; \
	$(BIN)/python -c "import json, sys; bad = [f for f in sys.argv[1:] if any(\
	  c.get('outputs') or c.get('execution_count') for c in json.load(open(f))['cells'])]; \
	  sys.exit('commit notebooks stripped; these carry outputs: ' + ' '.join(bad) \
	  if bad else 0)" notebooks/*.ipynb || exit 1; \
	rm -rf $(NBREF) $(NBSPAWN) && mkdir -p $(NBREF) $(NBSPAWN) || exit 1; \
	{ ls $(SPAWN_LESSONS) | sed 's|^|$(NBSPAWN) |'; ls notebooks/*.ipynb | sed 's|^|$(NBREF) |'; } | \
	  xargs -P 2 -L 1 sh -c '[ $$0 = $(NBSPAWN) ] && export MINIPAR_START_METHOD=spawn; \
	  exec $(BIN)/python tools/execute_notebook.py --timeout 180 --output-dir $$0 "$$1"' \
	  || exit 1; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --nbval --nbval-current-env \
	  --nbval-cell-timeout=180 --nbval-sanitize-with notebooks/sanitize.cfg \
	  --durations=0 --durations-min=5 $(NBREF)

# The course in a real JupyterLab, driven by headless Chromium (tests_browser/test_lab.py):
# lessons run from the Run menu, no error output and no undrawn widget or figure on the
# page, a dashboard redraws when a control moves, and every request that leaves 127.0.0.1
# is blocked (plotly and widgets render offline). Three lessons, one of each kind of front
# end (every lesson and dashboard with BROWSER_FLAGS=--full, as make test-full does).
# Installs Debian's chromium through apt and Playwright into .venv when missing (never
# `playwright install`); screenshots go to build/screenshots/. Bounded: 7.5 minutes at most.
BROWSER_FLAGS ?=
.PHONY: test-browser
test-browser: setup
	@command -v chromium >/dev/null || { s=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$s apt-get update -q && \
	  $$s env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	@$(BIN)/python -c "import playwright" 2>/dev/null || \
	  $(PIP) install -c constraints.txt playwright
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests_browser $(BROWSER_FLAGS)

# Regenerate exercises/ from solutions/ (a learner's changed file is first kept as .bak).
exercises: setup
	$(BIN)/python tools/make_exercises.py

lint: setup
	$(BIN)/ruff check .

# An 8-rank 2 x 2 x 2 run (dp x pp x tp, ZeRO-1, 1F1B) beside the single-process run.
demo: setup
	$(BIN)/python -m minipar train --dp 2 --pp 2 --tp 2 --zero 1 --microbatches 2 \
	  --steps 20 --compare --trace demo.trace.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
