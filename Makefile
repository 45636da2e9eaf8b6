# specmoe developer commands.  `make demo` and `make test` work on a fresh machine: both
# create .venv and install what they need first (`make setup`, idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.specmoe-setup
CSRC   := $(shell find csrc -name '*.c' -o -name '*.h')

.PHONY: setup build demo test test-sanitize bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

# Rebuild the extension in place whenever a C source changed (warnings are errors here).
specmoe/.build-stamp: $(STAMP) $(CSRC) setup.py
	SPECMOE_WERROR=1 $(PY) setup.py --quiet build_ext --inplace
	touch $@

build: specmoe/.build-stamp

demo: build
	$(PY) -m specmoe demo

test: build
	$(PY) -m pytest -q tests

# The C stress test of the cache and prefetch worker under ThreadSanitizer and
# AddressSanitizer (plain C binaries: no interpreter in the way).
test-sanitize: setup
	$(MAKE) -C tests/c sanitize

bench: build
	$(PY) benchmarks/cache.py --json

clean:
	rm -rf build specmoe/_C*.so specmoe/.build-stamp tests/c/bin
