# trinity: `make demo` runs the main job, `make test` runs the tests. Both create .venv first.
#
# Without a GPU the venv gets torch==2.13.0, the CPU build pip finds on local disk (never the
# multi-GB CUDA build). With a GPU (nvidia-smi present) the venv sees the machine's own torch
# (--system-site-packages) and installs torch only if none is there.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Test processes (pytest-xdist): each test file runs on one worker, the model zoo's architectures
# side by side. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo test bench lint clean

$(VENV)/.installed: pyproject.toml
ifeq ($(HAS_GPU),1)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch>=2.11"
else
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
endif
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m offload_compiler demo

test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

bench: $(VENV)/.installed
	$(PY) -m bench

lint: $(VENV)/.installed
	$(PY) -m ruff check offload_compiler tests bench

clean:
	rm -rf $(VENV) trinity_dumps .pytest_cache
