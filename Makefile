# The two entry points of the README. Both create .venv with the Python 3 on PATH, install
# vitlab into it, and run. Override e.g. `make train PYTHON=python3.11 ARGS="train.epochs=1"`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/vit_cifar10.yaml
ARGS   ?=

.PHONY: train test test-fast docs test-lowest install clean

# Train on CIFAR-10 with the default config (downloads CIFAR-10 unless ARGS point elsewhere). Installs
# vitlab alone (what training needs); the test, docs and export extras come with `make test`.
train: $(VENV)/.installed
	$(BIN)/python train.py --config $(CONFIG) $(ARGS)

# The whole test suite (what CI runs through .ci/run), the documentation's snippets and site included,
# one pytest-xdist worker per core, each test file on one worker (its module fixtures built once).
# Serial: make test ARGS="-n 0".
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n auto --dist loadfile $(ARGS)

# The edit-test loop: everything but the slow and the two-process tests (pytest markers), in about a minute and a
# half on 2 cores. make test and .ci/run still run everything.
test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n auto --dist loadfile -m "not slow and not multiprocess" $(ARGS)

# The documentation site (MkDocs), built with warnings as errors into site/.
docs: $(VENV)/.installed-dev
	$(BIN)/python -m mkdocs build --strict

# The suite against the lowest version of every direct dependency pyproject.toml admits (uv's
# lowest-direct resolution: direct dependencies at their lower bounds, the others at their newest),
# in a virtual environment of its own, with the test extra alone (what needs another extra skips). Not part
# of CI (docs/development.md has its time).
LOWEST := .venv-lowest
test-lowest: $(LOWEST)/.installed
	$(LOWEST)/bin/python -m pytest -n auto --dist loadfile $(ARGS)

$(LOWEST)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet uv
	$(LOWEST)/bin/uv pip install --quiet --python $(LOWEST)/bin/python --resolution lowest-direct -e '.[test]'
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "== installing vitlab and what training needs into $(VENV) (a few minutes the first time) =="
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --progress-bar on pip
	$(BIN)/python -m pip install --progress-bar on -e .
	@echo "== installed: the vitlab command is $(BIN)/vitlab (or 'source $(BIN)/activate', then vitlab) =="
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $@

clean:
	rm -rf $(VENV) $(LOWEST) *.egg-info .pytest_cache site
