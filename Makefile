# Two set-up commands for a fresh machine (README.md): `make demo` and `make test`.
# Each creates .venv from this repository's own files.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
# torch 2.14.1 is what sglang 0.5.23 pins; on this machine pip takes it from local disk.
# The demo needs torch alone; sglang's modules (tests, e2e) also import torchvision.
TORCH  := torch==2.14.1
TORCHVISION := torchvision==0.29.1
SGLANG := sglang==0.5.23
# The GPU host's triton alone (no torch), for tests/kernels/test_aot_sm90.py: every kernel must
# compile for sm_90 with it as well as with the triton above.  A 188 MB wheel; the
# environment is 670 MB and took 8 s to build here with the wheel in pip's cache.
TRITON36_VENV := .venv-triton36
TRITON36      := triton==3.6.*
# The end-to-end tier (tests/e2e): real sglang servers and sglang's router need sglang with
# its full dependencies, which the main .venv does not carry (it installs sglang
# --no-deps).  The `nixl` meta package is what sglang imports; with torch 2.14.1 (CUDA 13)
# it loads nixl-cu13.  The adapter is installed as a regular package (not editable) so
# that its kvmem_sglang.pth start-up guard is in place; it is reinstalled when it changes.
E2E_VENV   := .venv-e2e
E2E_PY     := $(E2E_VENV)/bin/python
# Mooncake (sglang's default PD backend): the non-CUDA build, DRAM over TCP here.  The
# CUDA build installs the same mooncake/ directory: never both in one environment.
E2E_PKGS   := $(SGLANG) sglang-router==0.3.2 nixl==1.5.1 nixl-cu13==1.5.1 pytest \
              mooncake-transfer-engine-non-cuda==0.3.13.post1
ADAPTER    := $(wildcard integration/sglang/kvmem_sglang/*.py) integration/sglang/pyproject.toml \
              integration/sglang/setup.py integration/sglang/kvmem_sglang.pth

.PHONY: demo test check test-main test-interpret test-e2e bench bench-smoke venv-demo venv-test \
	venv-triton36 venv-e2e clean

# The tiers (markers in pyproject.toml): `make check` is the edit loop, what runs in one
# process with no server and no other interpreter (Hypothesis's dev profile: a tenth of
# the examples); `make test` runs every tier once, with the ci profile.
CHECK_MARKS := not (subprocess or nixl or sglang or e2e or slow)

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
	$(PIP) install -q $(TORCH) $(TORCHVISION) -e '.[test,nixl,sglang-deps]'
	$(PIP) install -q --no-deps $(SGLANG)
	$(PIP) install -q --no-deps -e integration/sglang
	touch $@

$(TRITON36_VENV)/.ready:
	rm -rf $(TRITON36_VENV)
	$(PYTHON) -m venv $(TRITON36_VENV)
	$(TRITON36_VENV)/bin/python -m pip --disable-pip-version-check install -q '$(TRITON36)'
	touch $@

$(E2E_VENV)/.ready: pyproject.toml
	rm -rf $(E2E_VENV)
	$(PYTHON) -m venv $(E2E_VENV)
	$(E2E_PY) -m pip --disable-pip-version-check install -q $(TORCH) $(TORCHVISION) $(E2E_PKGS)
	$(E2E_PY) -m pip --disable-pip-version-check install -q --no-deps -e .
	touch $@

# Mooncake's engine.so needs libibverbs.so.1 (Debian's libibverbs1) even over TCP.  Where
# ld.so does not find it, the package and its libnl are fetched with apt and unpacked
# under .venv-e2e, for the Mooncake servers' LD_LIBRARY_PATH only (apt-get install would
# add ibverbs-providers too, which crashes every NIXL process at exit: docs/transfer.md).
# The file holds the library directories (empty: the system has it).
$(E2E_VENV)/ibverbs.path: $(E2E_VENV)/.ready tests/transfer/rdma_host.py
	$(E2E_PY) tests/transfer/rdma_host.py fetch-lib $(abspath $(E2E_VENV))/ibverbs libibverbs1 > $@.tmp
	mv $@.tmp $@

# From a fresh build directory: setuptools never prunes build/lib, so a module removed
# from the adapter would be installed again from an old one.
$(E2E_VENV)/.adapter: $(E2E_VENV)/.ready $(ADAPTER)
	rm -rf integration/sglang/build
	$(E2E_PY) -m pip --disable-pip-version-check install -q --no-deps --force-reinstall \
	  ./integration/sglang
	touch $@

venv-demo: $(VENV)/.demo-ready
venv-test: $(VENV)/.test-ready
venv-triton36: $(TRITON36_VENV)/.ready
venv-e2e: $(E2E_VENV)/.adapter $(E2E_VENV)/ibverbs.path

demo: $(VENV)/.demo-ready
	$(BIN)/kvmem demo

# Every tier once: the environments two at a time; the Triton kernels under the
# interpreter in a process of their own (TRITON_INTERPRET is read when a kernel is
# decorated); then the main suite and the end-to-end tier side by side, each one's output
# printed whole when it ends.  Side by side they took 33 min here where one after the
# other took about 57 (the tier waits on servers most of its time; README.md, "Tests").
test:
	$(MAKE) --no-print-directory -j2 venv-test venv-triton36 venv-e2e
	$(MAKE) --no-print-directory test-interpret
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main test-e2e MAIN_WORKERS=1

# The main suite's pytest processes: alone (`make test-main`) two pytest-xdist workers, one
# a core, the tests that fork from the sglang fork servers in one of them (tests/conftest.py);
# in `make test` one, since the end-to-end tier runs beside it.
MAIN_WORKERS ?= 2
MAIN_XDIST = $(if $(filter-out 1,$(MAIN_WORKERS)),-n $(MAIN_WORKERS) --dist loadfile)

# tests/ includes test_bench_smoke.py (every benchmark once, tiny sizes; sglang's Mooncake
# pair runs in .venv-e2e) and
# test_aot_sm90.py (the kernels compiled for sm_90 with both tritons).
test-main: $(VENV)/.test-ready $(TRITON36_VENV)/.ready $(E2E_VENV)/.adapter $(E2E_VENV)/ibverbs.path
	$(BIN)/ruff check -q .
	$(BIN)/ruff format --check -q .
	$(BIN)/mypy kvmem integration/sglang/kvmem_sglang
	KVMEM_HYPOTHESIS=ci $(BIN)/python -m pytest -q $(MAIN_XDIST) tests

check: $(VENV)/.test-ready
	$(BIN)/ruff check -q .
	$(BIN)/ruff format --check -q .
	$(BIN)/mypy kvmem integration/sglang/kvmem_sglang
	KVMEM_HYPOTHESIS=dev $(BIN)/python -m pytest -q -m "$(CHECK_MARKS)" tests

test-interpret: $(VENV)/.test-ready
	TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1 $(BIN)/python -m pytest -q tests/interpret

# Real sglang 0.5.23 prefill/decode servers and sglang's router on 127.0.0.1, stock beside
# SGLANG_KVMEM=1, driven over HTTP (tests/e2e/README.md).
test-e2e: $(E2E_VENV)/.adapter $(E2E_VENV)/ibverbs.path
	KVMEM_E2E=1 $(E2E_PY) -m pytest -q tests/e2e

# Writes bench/results/bench-<device>.json and the PNG plots of bench/plot.py beside it,
# then the figures README.md and docs/ quote from it (bench/figures.py).  sglang's
# Mooncake pairs run in .venv-e2e (bench/bench_sglang_transfer.py), and so does sglang's
# serving benchmark through real PD pairs (bench/bench_serving.py: bench/results/
# serving-cpu.json and its plots; it refuses a machine that is not quiet).
bench: $(VENV)/.test-ready $(E2E_VENV)/.adapter $(E2E_VENV)/ibverbs.path
	KVMEM_BENCH_OUT=bench/results $(BIN)/python -m pytest -q bench \
	  --benchmark-columns=median,iqr,ops --benchmark-sort=name
	$(BIN)/python -m bench.figures

# Every benchmark once at tiny sizes (what tests/test_bench_smoke.py runs), into /tmp.
bench-smoke: $(VENV)/.test-ready $(E2E_VENV)/.adapter $(E2E_VENV)/ibverbs.path
	KVMEM_BENCH_SMOKE=1 KVMEM_BENCH_OUT=$${TMPDIR:-/tmp}/kvmem-bench-smoke $(BIN)/python -m pytest -q bench

clean:
	rm -rf $(VENV) $(TRITON36_VENV) $(E2E_VENV) .pytest_cache .benchmarks .hypothesis
