# Two entry points a newcomer needs (see README): `make check` and `make test`.
# Each creates .venv on first use; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take the CPU build of torch, pinned, and never a CUDA one: the
# "+cpu" local version is not on PyPI, so pip cannot fall back to a CUDA build.
# It is taken from the indexes pip is configured with, else from TORCH_CPU_INDEX
# (PyTorch's own CPU index by default).
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: check test wheel-test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing the default torch build"; \
		$(BIN)/pip install -q torch; \
	else \
		echo "no GPU: installing the CPU build of torch ($(TORCH_CPU))"; \
		$(BIN)/pip install -q "$(TORCH_CPU)" \
			$(if $(TORCH_CPU_INDEX),|| { echo "not on pip's indexes: trying $(TORCH_CPU_INDEX)"; \
			     $(BIN)/pip install -q --extra-index-url "$(TORCH_CPU_INDEX)" "$(TORCH_CPU)"; }) \
			|| exit 1; \
	fi
	$(BIN)/pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[tilelang,paddle,test]"
	touch $(STAMP)

check: $(STAMP)
	CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} $(BIN)/mqa-bwd check

test: $(STAMP)
	CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} $(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# The wheel built from this checkout, installed into a fresh virtualenv, runs the gate from an empty
# directory (tests/test_wheel.py): what a user who pip-installs the project gets.
wheel-test: $(STAMP)
	CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} MQA_TORCH_SPEC="$(TORCH_CPU)" MQA_TORCH_INDEX="$(TORCH_CPU_INDEX)" $(BIN)/python -m pytest -m wheel tests/test_wheel.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
