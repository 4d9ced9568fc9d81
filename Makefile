# wsync: two commands for a fresh clone.
#   make demo   set up .venv, then run the main job (a trainer syncing a policy to 4 worker processes)
#   make test   set up .venv, then run every test
#
# The torch build is chosen here and only here. The default is the CPU build, from PyTorch's CPU
# index (PyPI's torch==2.13.0 is a CUDA build of several GB); on a CUDA machine:
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROJECTS := . conformance benchmarks $(sort $(dir $(wildcard plugins/*/pyproject.toml contrib/*/pyproject.toml)))
PYTEST_ARGS ?=
# test processes (pytest-xdist, each test file whole in one of them): most tests wait on timeouts,
# peers and sockets, so two processes on two cores take about two thirds of one's time; JOBS=0 runs
# everything in this process
JOBS ?= 2

.PHONY: setup demo test bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: Makefile requirements-dev.txt $(addsuffix /pyproject.toml,$(PROJECTS))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools
	$(BIN)/python -m pip install -q --no-deps $(TORCH)  # (its dependencies come with the next line)
	$(BIN)/python -m pip install -q -r requirements-dev.txt $(addprefix -e ,$(PROJECTS))
	$(BIN)/python -c "import torch, tensordict, wsync_core; print('torch', torch.__version__, 'tensordict', tensordict.__version__)"
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

bench: setup
	$(BIN)/wsync bench --transports shm,mp --sizes 1MiB,16MiB --workers 2 --compare torchrl --json b.json --plot b.png

clean:
	rm -rf $(VENV)
