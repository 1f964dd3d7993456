# `make test` and `make demo` set themselves up: a .venv with torch (the CPU
# build on a CPU machine; an existing CUDA torch is kept), then this package
# editable with its test and integrations extras. Re-running is a no-op unless pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hybridcomm-setup
TORCH_CPU := torch==2.13.0

.PHONY: setup lint format test test-fast test-doctests test-host test-sim-a test-sim-b test-sim-loops demo bench profile gpu-check gpu-bench mutation clean
setup: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	    echo "[setup] keeping the CUDA torch of $(PYTHON) (venv with system site-packages)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  echo "[setup] installing $(TORCH_CPU) (CPU build)"; \
	  $(PY) -m pip install -q $(TORCH_CPU) numpy 2>&1 | grep -v "is ignored" || true; \
	fi
	@$(PY) -c "import torch" || { echo "[setup] torch failed to install"; exit 1; }
	@echo "[setup] installing hybridcomm (editable, [test,integrations])"
	@$(PY) -m pip install -q -e ".[test,integrations]" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import hybridcomm, hybridcomm.kernels" || { echo "[setup] hybridcomm failed to install"; exit 1; }
	@$(PY) -c "from hybridcomm.sync import host_ext as h; h.load() or print('[setup] the host C++ extension did not build (Python loops instead):', h.why_not())"
	@$(PY) -c "import pytorch_lightning, accelerate, transformers" || { echo "[setup] the [integrations] extra failed to install"; exit 1; }
	@touch $(STAMP)

# `make test` runs five lanes at once, each its own pytest process (make -j, each
# lane's output printed whole when it ends): most tests wait on sockets, child
# processes and deadlines, so one lane at a time left the 2 cores idle much of the
# time. The doctests (with the tests that use the library in the test's own
# process: RUN_LAST in tests/tiers.py); the host suite (every other test file on
# the host path, the rest of the fast tier included) on TEST_WORKERS pytest-xdist
# workers, a file per worker at a time (module fixtures made once; TEST_WORKERS=0:
# one process); and the suites on the
# simulated GPU in three lanes with coverage. The GPU path (CuPy NCCL transport, comm
# stream, the synchronizer, engine and channel) runs on the simulated CUDA runtime
# there (and in the training loops' simgpu cases, which set it per rank); its
# stream-ordered code must stay >= 90% covered (tests/coverage_gpu_path.rc).
SIM_ONLY := tests/test_gpu_path.py tests/test_simgpu.py tests/test_forward_mode.py \
            tests/test_compression.py tests/test_one_device.py tests/test_powersgd.py
SIM_TESTS := tests/test_gpu_path.py tests/test_simgpu.py tests/test_optimizer_equivalence.py \
             tests/test_optimizer_features.py tests/test_allreduce_multiprocess.py \
             tests/test_forward_mode.py tests/test_compression.py tests/test_checkpoint.py \
             tests/test_one_device.py tests/test_powersgd.py
# (three lanes of about the same length with SIM_LOOPS)
SIM_TESTS_A := tests/test_gpu_path.py tests/test_simgpu.py tests/test_forward_mode.py \
               tests/test_checkpoint.py tests/test_one_device.py
SIM_TESTS_B := $(filter-out $(SIM_TESTS_A),$(SIM_TESTS))
SIM_LOOPS := tests/test_training_loops.py tests/test_model_reads.py tests/test_join.py \
             tests/test_shard.py tests/test_shard_release.py tests/test_shard_granularity.py \
             tests/test_shard_dcp.py
COV := $(PY) -m coverage
COVRC := --rcfile=tests/coverage_gpu_path.rc
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The formatter decides layout and the linter catches unused or undefined names
# (pyproject.toml's [tool.ruff]); `make format` applies both.
lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: lint
	@rm -rf .coverage-data
	@$(MAKE) --no-print-directory -j5 --output-sync=target \
	    test-doctests test-host test-sim-a test-sim-b test-sim-loops
	@$(COV) combine $(COVRC) -q
	$(COV) report $(COVRC) --fail-under=90

# The lanes of `make test` (each runs alone too; the coverage report needs the three sim lanes).
# The doctests, and the test modules that use the library in the test's own process
# (a group of one rank: RUN_LAST in tests/tiers.py), where no test forks ranks after them.
IN_PROCESS := $(shell grep -l "^RUN_LAST = True" tests/test_*.py)

test-doctests: setup
	$(PY) -m pytest -q --doctest-modules hybridcomm kernels $(IN_PROCESS)

test-host: setup
	$(PY) -m pytest -q $(XDIST) tests $(addprefix --ignore=,$(SIM_ONLY) $(IN_PROCESS)) \
	    -k "not ((test_training_loops or test_model_reads or test_join or test_shard) and simgpu)"

test-sim-a: setup
	HYBRIDCOMM_SIMULATE_GPU=1 $(COV) run $(COVRC) -m pytest -q $(SIM_TESTS_A)

test-sim-b: setup
	HYBRIDCOMM_SIMULATE_GPU=1 $(COV) run $(COVRC) -m pytest -q $(SIM_TESTS_B)

test-sim-loops: setup
	$(COV) run $(COVRC) -m pytest -q $(SIM_LOOPS) -k simgpu

# The fast tier, for the edit-test loop: the tests marked `fast` (the planner, the cost
# model, the schedules, the kernels at small sizes, the engine and the bucket lifecycle
# over the fakes in tests/fakes, the hooks at one rank), in this one process: no rank
# or subprocess is started, and tests/tiers.py refuses any that a test tries to start.
# Under a minute on 2 cores. `make test` runs these too.
# (Only the files that mark something fast are collected: other modules may start a
# process as they import, e.g. to see whether network namespaces work.)
FAST_FILES = $(shell grep -l "pytest.mark.fast" tests/test_*.py)
test-fast: setup
	HYBRIDCOMM_TEST_TIER=fast $(PY) -m pytest -q -m "fast and not slow" $(FAST_FILES)

# The main job: the thesis experiment where it applies (root: 4 ranks on a shaped
# 100 Mbit/s network, batch 256; otherwise loopback, and it says why), < 3 minutes.
demo: setup
	$(PY) benchmarks/train.py --demo

# The all-reduce microbenchmark: every algorithm next to torch.distributed.
bench: setup
	$(PY) -m hybridcomm.tools.bench --nprocs 4 -b 4K -e 16M -f 4 --algo ring,butterfly,halving_doubling,auto,native

# nsys profiles of both benchmarks (GPU machines with Nsight Systems).
profile: setup
	bash benchmarks/profile/nsys_bench.sh && bash benchmarks/profile/nsys_train.sh

# Every test under tests/gpu (kernels, CuPy NCCL, the optimizer; one GPU or more),
# with a JSON report of what ran, on what device, and how long it took. Not part
# of `make test`; without CUDA it is a dry run (everything skips, exit 0).
GPU_CHECK_JSON ?= gpu-check.json
gpu-check: setup
	$(PY) tests/gpu/gpu_check.py --output $(GPU_CHECK_JSON)

# hybridcomm's speed on one GPU in ~4 minutes (at most 6): kernels against torch and the
# copy bandwidth, a training step at world 1 against plain torch and DDP, 2 and 4 ranks
# on the one GPU, profiles; tables, a verdict line and a JSON report. Not part of
# `make test`; without CUDA it is a dry run on the simulated GPU (tiny sizes, ~30 s).
GPU_BENCH_JSON ?= gpu-bench.json
gpu-bench: setup
	$(PY) benchmarks/gpu_bench.py --json $(GPU_BENCH_JSON)

# Mutation check of the GPU path (not part of `make test`): each mutation listed in
# tests/mutation/mutations.py (the known defects put back), applied to a copy of the
# checkout, must make a test fail; prints a table and `caught N of M`.
# MUTATION_ARGS="--only id,..." runs some, "--list" lists them.
mutation: setup
	$(PY) tests/mutation/run.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .coverage-data
