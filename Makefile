# The two entry points of the README. Both create .venv with the Python 3 on PATH, install
# vitlab into it, and run. Override e.g. `make train PYTHON=python3.11 ARGS="train.epochs=1"`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/vit_cifar10.yaml
ARGS   ?=

.PHONY: train test install clean

# Train on CIFAR-10 with the default config (downloads CIFAR-10 unless ARGS point elsewhere).
train: $(VENV)/.installed
	$(BIN)/python train.py --config $(CONFIG) $(ARGS)

# The whole test suite (what CI runs through .ci/run).
test: $(VENV)/.installed
	$(BIN)/python -m pytest $(ARGS)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
