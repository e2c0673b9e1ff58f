# Two set-up commands for a fresh machine (README.md): `make demo` and `make test`.
# Each creates .venv from this repository's own files.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
# torch 2.14.1 is what sglang 0.5.23 pins; on this machine pip takes it from local disk.
TORCH  := torch==2.14.1 torchvision==0.29.1
SGLANG := sglang==0.5.23

.PHONY: demo test test-main test-interpret bench venv-demo venv-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Runtime + NIXL: what `kvmem demo` needs.
$(VENV)/.demo-ready: pyproject.toml | $(BIN)/python
	$(PIP) install -q $(TORCH) -e '.[nixl]'
	touch $@

# Everything the tests and benchmarks need, sglang 0.5.23 included (installed without its
# dependencies, then only what its allocator / memory pool / PD modules import), and the
# sglang adapter (integration/sglang, which registers sglang's `kvmem` plugin).
$(VENV)/.test-ready: pyproject.toml integration/sglang/pyproject.toml | $(BIN)/python
	$(PIP) install -q $(TORCH) -e '.[test,nixl,sglang-deps]'
	$(PIP) install -q --no-deps $(SGLANG)
	$(PIP) install -q --no-deps -e integration/sglang
	touch $@

venv-demo: $(VENV)/.demo-ready
venv-test: $(VENV)/.test-ready

demo: $(VENV)/.demo-ready
	$(BIN)/kvmem demo

# The main suite, then the Triton kernels under the interpreter in a process of their own
# (TRITON_INTERPRET is read when a kernel is decorated).
test: $(VENV)/.test-ready
	$(MAKE) --no-print-directory test-main test-interpret

test-main: $(VENV)/.test-ready
	$(BIN)/python -m pytest -q tests

test-interpret: $(VENV)/.test-ready
	TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1 $(BIN)/python -m pytest -q tests/interpret

bench: $(VENV)/.test-ready
	$(BIN)/python -m pytest -q bench --benchmark-columns=median,iqr,ops --benchmark-sort=name

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks .hypothesis
