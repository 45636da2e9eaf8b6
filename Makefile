# specmoe developer commands.  `make demo` and `make test` work on a fresh machine: both
# create .venv and install what they need first (`make setup`, idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.specmoe-setup
WHEELS := $(VENV)/wheelhouse
CSRC   := $(shell find csrc cuda -name '*.c' -o -name '*.h' -o -name '*.cu' 2>/dev/null)

.PHONY: setup build demo test test-slow test-install test-bench test-gpu test-sanitize bench clean fuzz fuzz-deps

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements-dev.txt tests/install/wheelhouse.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) tests/install/wheelhouse.py $(WHEELS)
	touch $@

# Rebuild the extension in place whenever a C source changed (warnings are errors here).
specmoe/.build-stamp: $(STAMP) $(CSRC) setup.py
	SPECMOE_WERROR=1 $(PY) setup.py --quiet build_ext --inplace
	touch $@

build: specmoe/.build-stamp

demo: build
	$(PY) -m specmoe demo

# make test runs its cases in parallel worker processes (pytest-xdist), one per core up to 4
# (`make test TEST_JOBS=1` runs them in one process).  Every case keeps its own tmp_path and
# $SPECMOE_CACHE, and store temporaries are claimed by flock, so workers share nothing on disk.
# On a 2-core 2.0 GHz Zen 1 host two workers took the suite from 17-20 to 11 minutes.
# The other targets stay in one process: cgroups, a Ray cluster, timed benchmark smoke runs.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: build fuzz-deps
	$(PY) -m pytest -q -n $(TEST_JOBS) -m "not slow" --durations=25 tests

# The end-to-end runs marked slow (pyproject.toml): a memory cgroup around convert and generate,
# a Ray cluster behind `specmoe serve --ray`, the setters-during-generate stress, the zoo and
# MTP training smoke runs, the notebooks, the two longest MTP runs (batched greedy, the
# one-request sampling distribution), and the costliest cases of the widest parametrisations
# (every architecture from a fused checkpoint, the scalar rows at the wide shape, the full
# shared traces, a second seed or slot count of the policy replays, the CLI form of the
# SIGKILL leftover, the n-gram drafter's sampling distribution).  Kept out of make test's
# 15 minutes; .ci/run runs them.
test-slow: build
	$(PY) -m pytest -q -m slow --durations=10 tests

# A user's install (issue 40): the sdist built from this checkout, installed into a fresh
# venv offline from the wheels `make setup` downloaded to $(WHEELS), the README's commands run
# there (tests/install/test_sdist.py; minutes: it compiles the extension and installs torch).
test-install: setup
	SPECMOE_TEST_INSTALL=1 $(PY) -m pytest -q -rs tests/install

# The benchmark scripts' smoke runs (benchmarks/speculation.py --quick, benchmarks/serve.py on
# the zoo model, the C harnesses of benchmarks/c): tests of the benchmark tools, kept out of
# make test's 15 minutes.
test-bench: build
	SPECMOE_TEST_BENCH=1 $(PY) -m pytest -q -rs tests/test_speculation_bench.py \
		tests/test_bench_harness.py tests/test_serve_bench.py tests/test_gptoss_bench.py \
		tests/test_predictors_bench.py tests/test_hybrid_bench.py

# The GPU tier on a machine with a GPU (issue 12; docs/gpu.md): rebuild with the toolkit
# required (SPECMOE_CUDA=1, so a missing nvcc is an error, not a skip), run the GPU tests with
# skips reported (the engine tests of test_gpu_tier.py too), then the decode and hybrid-tier
# benchmarks.  GPU_PY: an interpreter whose torch has CUDA (the
# GPU machines' python3); it gets this checkout on PYTHONPATH instead of .venv.
GPU_PY ?= $(PY)
test-gpu:
	SPECMOE_CUDA=1 SPECMOE_WERROR=1 $(GPU_PY) setup.py --quiet build_ext --inplace
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -rs tests/test_cuda.py tests/test_gpu_tier.py
	PYTHONPATH=$(CURDIR) $(GPU_PY) benchmarks/gpu_decode.py --json
	PYTHONPATH=$(CURDIR) $(GPU_PY) benchmarks/gpu_hybrid.py --json --layers 6 --dtypes bf16,int4

# clang + libFuzzer for the C fuzz target (tests/fuzz): installed when missing and we are root
# on Debian/Ubuntu (best effort: without it tests/test_fuzz_smoke.py skips the C target only).
fuzz-deps:
	@command -v clang >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang \
	   libclang-rt-14-dev >/dev/null) || echo "fuzz-deps: clang not installed; C fuzz target skipped"; }

# Long fuzz runs (issue 15): FUZZ_RUNS executions of the libFuzzer store target and
# FUZZ_PYRUNS seeded mutations of each Python loader; findings land in tests/fuzz/bin/.
FUZZ_RUNS   ?= 10000000
FUZZ_PYRUNS ?= 20000
fuzz: build fuzz-deps
	$(MAKE) -C tests/fuzz run RUNS=$(FUZZ_RUNS) PYRUNS=$(FUZZ_PYRUNS) PY=$(abspath $(PY))

# The C stress test of the cache and prefetch worker under ThreadSanitizer and
# AddressSanitizer (plain C binaries: no interpreter in the way).
test-sanitize: setup
	$(MAKE) -C tests/c sanitize

bench: build
	$(PY) benchmarks/cache.py --json

clean:
	rm -rf build specmoe/_C*.so specmoe/_cuda*.so specmoe/.build-stamp tests/c/bin tests/fuzz/bin
