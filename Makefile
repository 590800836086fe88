# Two commands do all the set-up on a fresh machine:  make demo  (the main job)  and  make test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build these machines carry locally; an unpinned torch pulls CUDA wheels.
TORCH ?= torch==2.13.0

.PHONY: venv demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# numpy 1.x: the Python-backend stub of the Triton server below wants it.
	$(PY) -m pip install -q -e ".[export,dev,triton,kernels,bench]" "numpy>=1.24,<2"
	# The Triton server binary bundled in nvidia-pytriton: only its files, and last, so that no
	# later install reports its unneeded dependencies as a (harmless) resolver error.
	$(PY) -m pip install -q --no-deps "nvidia-pytriton==0.7.0"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m specinfer.demo

test: venv
	# pyflakes' checks (unused imports, undefined names): each is a bug or dead code
	$(PY) -m ruff check --select F specinfer tests
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) .pytest_cache
