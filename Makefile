# One target per job. `make demo` and `make test` each set up everything they need on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned (an unpinned one can pull a newer release's several GB of CUDA packages). On Linux PyPI's
# torch==2.13.0 is itself the CUDA build, right for an NVIDIA desktop; on a CPU-only box take PyTorch's CPU index:
# make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0

.PHONY: install install-dev demo test test-fast lint bench bench-strategies bench-memory clean gpu-bundle gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[examples,report]"

install-dev: install
	$(BIN)/pip install -q -e ".[dev]"

demo: install
	$(BIN)/mixtrain train digits --workers auto

test: install-dev
	$(BIN)/python -m pytest -q -n 2 --dist load --durations=25 tests

lint: install-dev
	$(BIN)/ruff check src tests benchmarks gpu
	$(BIN)/ruff format --check src tests benchmarks gpu
	$(BIN)/mypy

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/compare.py
	$(BIN)/python benchmarks/compare.py --emulate 1:3 --runners single1,ddp,mixtrain,mixtrain-all,mixtrain-equal \
		--json bench_results/emulate_1to3.json

# mixtrain's strategies beside a 3x slower worker (emulated), the parameter server against all-reduce,
# and all-reduce vs local SGD between two network namespaces over a 100 Mbit/s link (needs root)
STRATEGY_RUNNERS := single1,ddp,mx:allreduce,mx:ps,mx:ps-async,mx:local-sgd,mx:allreduce+bf16,mx:ps+bf16,mx:ps-async+bf16,mx:local-sgd+bf16
bench-strategies: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/compare.py --workloads cnn --emulate 1:3 --runners $(STRATEGY_RUNNERS) \
		--json bench_results/strategies_1to3.json
	$(BIN)/python benchmarks/compare.py --workloads mlp,cnn --runners ddp,mx:allreduce,mx:ps \
		--json bench_results/ps_vs_allreduce.json
	$(BIN)/python benchmarks/slow_link.py --strategies allreduce,allreduce+bf16,ps,ps-async:2,local-sgd:8,local-sgd:8+bf16

# Peak resident memory per worker process (one plain process, torchrun DDP, every mixtrain strategy) on a 12.6M
# and a 50M-parameter MLP, then the largest MLP that trains with each worker capped at 1.5 GB (a cgroup v1
# memory limit per worker: needs root; --skip-fit-search without). Raw results: bench_results/memory.json
bench-memory: install
	$(BIN)/python benchmarks/memory.py

# The GPU check (docs/gpu-check.md). Here, where pip works: `make gpu-bundle` builds .gpu-bundle/
# (Ray without its unused parts, the few packages the GPU image lacks, mixtrain's wheel; about 20 MiB) for
# CPython $(PYVER) manylinux x86-64. On the offline GPU machine, with .gpu-bundle carried along:
# `make gpu-check` installs it into a throwaway folder over that machine's torch and writes
# gpu-check.txt / gpu-check.json into $OUT (else mixtrain_runs/gpu-check-*/).
PYVER ?= 3.12
GPU_PYTHON ?= python3
gpu-bundle: $(BIN)/python
	$(BIN)/pip install -q packaging
	$(BIN)/python -m gpu.bundle --python-version $(PYVER)

gpu-check:
	$(GPU_PYTHON) gpu/check.py

clean:
	rm -rf $(VENV) mixtrain_runs bench_results
