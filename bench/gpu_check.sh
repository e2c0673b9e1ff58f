#!/usr/bin/env bash
# GPU check: the GPU tests and the GPU benchmarks on a CUDA host, in under 5 minutes on a
# bare H200 host (an empty Triton cache, no NIXL, no sglang, maybe no pytest-benchmark).
#
#   bench/gpu_check.sh OUTDIR          run the steps below, results in OUTDIR
#   bench/gpu_check.sh --plan [OUTDIR] print the plan (each step's budget, what it needs,
#                                      what would be skipped on this host and why) and
#                                      run nothing: also on a machine without a GPU
#   bench/gpu_check.sh --selftest OUTDIR   the step runner on a few CPU commands (a pass,
#                                      a failure, a step past its budget, a sharded one):
#                                      what tests/test_bench_smoke.py checks here
#
# Uses the host's own python3 (the H200 target: Python 3.12, torch 2.11, triton 3.6, CuPy)
# with this repository on PYTHONPATH, and installs nothing.
#
# Steps, in order (the first is a small kernel grid, so a broken kernel or toolchain shows
# within a minute).  Each runs under a time budget sized from the Triton kernels it
# compiles on an empty cache:
#
#     budget = BASE_S + run seconds + kernels * PER_KERNEL_S / processes
#
# kernels and run seconds are estimates per step (the table below says where each comes
# from); PER_KERNEL_S starts as a guess and is replaced by what the first step measured
# (seconds per new cubin in the Triton cache).  A step whose budget does not fit in what
# is left of KVMEM_GPU_CHECK_SECONDS (default 280) is skipped, saying so; one that needs
# a package the host lacks (NIXL, sglang, pytest-benchmark) too.  Every step prints one
# line: what ran (pytest's counts), what it compiled, its time against its budget, or why
# it was skipped.  Set KVMEM_GPU_CHECK_SECONDS higher to run everything on a slow host.
#
# Writes to OUTDIR:
#   env.txt        GPU name, driver, versions, which optional packages import
#   summary.txt    the one line per step, and the totals
#   steps.tsv      the same as columns (measured kernels and seconds: the next sizing)
#   <step>.log     each step's pytest output (-rs: every skip with its reason)
#   bench-cuda.json, nvidia-*-*.png, sglang_staging.json   where those steps ran
# Exit status: 1 if a step failed or ran past its budget, 2 without a CUDA device (or
# without pytest), else 0 (skips are listed, not failures).
#
# For planning (and the CPU test of this script, tests/test_bench_smoke.py):
#   KVMEM_PYTHON=...                    the interpreter (default python3)
#   KVMEM_GPU_CORES=16                  plan for that many cores (default: nproc)
#   KVMEM_GPU_WITHOUT="nixl sglang pytest-benchmark"   treat these as not importable
#   KVMEM_GPU_BASE_S, KVMEM_GPU_PER_KERNEL_S           override the two sizing guesses
set -uo pipefail

plan_only=0; selftest=0
if [ "${1:-}" = "--plan" ]; then plan_only=1; shift; fi
if [ "${1:-}" = "--selftest" ]; then selftest=1; shift; fi
if [ "$plan_only" = 0 ]; then
  out="${1:?usage: bench/gpu_check.sh [--plan | --selftest] OUTDIR}"
else
  out="${1:-}"
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${KVMEM_PYTHON:-python3}

DEADLINE=${KVMEM_GPU_CHECK_SECONDS:-280}  # the whole script, under the 5 minutes asked
# A pytest process's start on the H200 host (python, torch, triton, a CUDA context, kvmem,
# collection): a guess (about 12 s), not measured there yet.
BASE_S=${KVMEM_GPU_BASE_S:-12}
# One Triton 3.6 compile for sm_90 on that host's CPU: a guess until the first step
# measures it (kept when it compiled nothing: a warm cache).
PER_KERNEL_S=${KVMEM_GPU_PER_KERNEL_S:-1.0}
CORES=${KVMEM_GPU_CORES:-$(nproc 2>/dev/null || echo 4)}
SHARDS=$(( CORES / 2 )); [ "$SHARDS" -gt 8 ] && SHARDS=8; [ "$SHARDS" -lt 1 ] && SHARDS=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
T0=$SECONDS

if [ -n "$out" ]; then
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
fi

without=" ${KVMEM_GPU_WITHOUT:-} "
importable() {  # importable PACKAGE CODE
  case $without in *" $1 "*) return 1 ;; esac
  $py -c "$2" >/dev/null 2>&1
}
cubins() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }
left() { echo $(( DEADLINE - (SECONDS - T0) )); }
say() {  # one line to stdout and, when there is an OUTDIR, to summary.txt
  echo "$*"
  [ -n "$out" ] && echo "$*" >> "$out/summary.txt"
  return 0
}

has_cuda=0; importable cuda "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && has_cuda=1
has_pytest=0; importable pytest "import pytest" && has_pytest=1
has_nixl=0; importable nixl "from kvmem.transfer.nixl import import_nixl; import_nixl()" && has_nixl=1
has_sglang=0; importable sglang "import sglang.srt.disaggregation.common.staging_buffer" && has_sglang=1
has_sglang_alloc=0; importable sglang "import sglang.srt.mem_cache.allocator" && has_sglang_alloc=1
has_benchmark=0; importable pytest-benchmark "import pytest_benchmark" && has_benchmark=1
has_cupy=0; importable cupy "import cupy" && has_cupy=1

if [ -n "$out" ]; then
  : > "$out/summary.txt"
  printf 'step\tstatus\tseconds\tbudget\tkernels_est\tkernels_compiled\tprocesses\tresult\n' > "$out/steps.tsv"
fi
if [ "$plan_only" = 0 ] && [ "$selftest" = 0 ]; then
  {
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    $py - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
PY
    echo "cores $CORES, $SHARDS processes for the sharded step, TRITON_CACHE_DIR $TRITON_CACHE_DIR ($(cubins) cubins in it)"
    echo "importable: pytest=$has_pytest cupy=$has_cupy nixl=$has_nixl sglang=$has_sglang pytest-benchmark=$has_benchmark"
  } 2>&1 | tee "$out/env.txt"
  if [ "$has_cuda" = 0 ]; then echo "gpu_check: no CUDA device here: nothing to check"; exit 2; fi
  if [ "$has_pytest" = 0 ]; then echo "gpu_check: pytest is not importable here: nothing can run"; exit 2; fi
fi

status=0; n_ran=0; n_skipped=0; n_failed=0

# step NAME KERNELS RUN_S PROCESSES NEED WHAT -- COMMAND...
#   KERNELS    Triton kernel variants it compiles on an empty cache (an estimate)
#   RUN_S      seconds it runs besides its start and its compiles (an estimate)
#   PROCESSES  1, or "shards": the command runs in $SHARDS processes at once, each with
#              KVMEM_GPU_SHARD=i/n (the pack grid: see tests/gpu/test_cuda_pack_pool.py)
#   NEED       "-" or the reason it cannot run here (a missing package), decided above
step() {
  local name=$1 kernels=$2 run_s=$3 procs=$4 need=$5 what=$6
  shift 7
  local cmd=("$@") n=1
  [ "$procs" = shards ] && n=$SHARDS
  local budget
  budget=$(awk -v b="$BASE_S" -v r="$run_s" -v k="$kernels" -v p="$PER_KERNEL_S" -v n="$n" \
    'BEGIN { x = b + r + k * p / n; printf "%d", (x == int(x)) ? x : int(x) + 1 }')
  local rem; rem=$(left)
  if [ "$plan_only" = 1 ]; then  # as if every step before took its whole budget
    rem=$(( DEADLINE - ${PLANNED:-0} ))
    local would=run
    if [ "$need" != - ]; then
      would="skip: $need"
    elif [ "$budget" -gt "$rem" ]; then
      would="skip: out of time unless the steps before end early (needs ${budget}s, ${rem}s left)"
    else
      PLANNED=$(( ${PLANNED:-0} + budget ))
    fi
    say "plan $name budget=${budget}s kernels=$kernels processes=$n would=$would | $what"
    return 0
  fi
  if [ "$need" != - ]; then
    n_skipped=$((n_skipped + 1))
    say "[$name] skipped: $need | $what"
    printf '%s\tskipped\t0\t%s\t%s\t0\t%s\t%s\n' "$name" "$budget" "$kernels" "$n" "$need" >> "$out/steps.tsv"
    return 0
  fi
  if [ "$budget" -gt "$rem" ]; then
    n_skipped=$((n_skipped + 1))
    say "[$name] skipped: needs ${budget}s ($kernels kernels at ${PER_KERNEL_S}s over $n process(es)), ${rem}s left of ${DEADLINE}s | $what"
    printf '%s\tskipped\t0\t%s\t%s\t0\t%s\tout of time\n' "$name" "$budget" "$kernels" "$n" >> "$out/steps.tsv"
    return 0
  fi
  local log="$out/$name.log" before t rc=0
  before=$(cubins); t=$SECONDS
  if [ "$n" -gt 1 ]; then
    local pids=() i
    for ((i = 0; i < n; i++)); do
      KVMEM_GPU_SHARD="$i/$n" timeout "$budget" "${cmd[@]}" > "$log.$i" 2>&1 &
      pids+=($!)
    done
    local one
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"; one=$?
      [ "$one" -ne 0 ] && [ "$rc" -ne 124 ] && rc=$one
    done
    for ((i = 0; i < n; i++)); do echo "== process $i of $n"; cat "$log.$i"; rm -f "$log.$i"; done > "$log"
  else
    timeout "$budget" "${cmd[@]}" > "$log" 2>&1; rc=$?
  fi
  local secs=$((SECONDS - t)) compiled=$(( $(cubins) - before ))
  # pytest's count lines (one per process): "12 passed, 1 skipped in 30.1s"
  local result
  result=$(grep -E '^=*[^=]*\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b[^=]* in [0-9.]+s' "$log" \
           | sed -E 's/^=+ //; s/ =+$//' | paste -sd ';' -)
  [ -z "$result" ] && result="no pytest summary (see $name.log)"
  local verdict=ok
  case $rc in
    0) n_ran=$((n_ran + 1)) ;;
    124) verdict="TIMEOUT (ran past its ${budget}s budget)"; status=1; n_failed=$((n_failed + 1)) ;;
    5) verdict="nothing collected"; status=1; n_failed=$((n_failed + 1)) ;;
    *) verdict="FAILED (exit $rc)"; status=1; n_failed=$((n_failed + 1)) ;;
  esac
  say "[$name] ran: $result | $what | $compiled kernels compiled (est $kernels), ${secs}s of ${budget}s | $verdict"
  grep -E '^SKIPPED' "$log" | sed -E 's/^/    /' | head -n 5 | while read -r l; do say "$l"; done
  if [ "$rc" -ne 0 ]; then tail -n 25 "$log"; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "${verdict%% *}" "$secs" "$budget" "$kernels" \
    "$compiled" "$n" "$result" >> "$out/steps.tsv"
  if [ "$name" = smoke ] && [ "$compiled" -gt 0 ]; then
    # the host's own compile rate, for the budgets of the steps that follow
    PER_KERNEL_S=$(awk -v s="$secs" -v b="$BASE_S" -v c="$compiled" \
      'BEGIN { x = (s - b) / c; if (x < 0.2) x = 0.2; if (x > 5) x = 5; printf "%.2f", x }')
    say "    measured: ${PER_KERNEL_S}s per kernel (the following budgets use it)"
  fi
}

if [ "$selftest" = 1 ]; then  # the runner itself, on CPU commands
  step pass 0 3 1 - "a step that passes" -- "$py" -c "print('3 passed, 1 skipped in 0.10s')"
  step fail 0 3 1 - "a step that fails" -- "$py" -c "import sys; print('1 failed, 2 passed in 0.20s'); sys.exit(1)"
  step slow 0 1 1 - "a step past its budget" -- sleep 30
  step sharded 0 3 shards - "a sharded step" -- "$py" -c "import os; print('shard', os.environ['KVMEM_GPU_SHARD']); print('1 passed in 0.01s')"
  step missing 0 3 1 "a package is not importable here" "a step that cannot run here" -- false
  say "gpu_check: $n_ran ran ok, $n_failed failed, $n_skipped skipped; exit $status"
  exit $status
fi

need_nixl="-"; [ "$has_nixl" = 0 ] && need_nixl="NIXL is not importable here (carry a nixl-cu13 wheel): the disagg sides cannot run"
need_sglang="-"; [ "$has_sglang" = 0 ] && need_sglang="sglang is not importable here: nothing to compare its staging kernels with"
has_tms=0; importable sglang "import torch_memory_saver, sglang.srt.mem_cache.memory_pool" && has_tms=1
need_tms="-"; [ "$has_tms" = 0 ] && need_tms="sglang or torch_memory_saver is not importable here: nothing to run the adapter beside --enable-memory-saver with"
need_bench="-"; [ "$has_benchmark" = 0 ] && need_bench="pytest-benchmark is not importable here (carry its wheel): the benchmarks are its fixtures"
pyt=("$py" -m pytest -q -rs -p no:cacheprovider)

# Kernel estimates: the pack grid's 75 cases compile about 204 variants (issue 15, an
# empty Triton cache), about 2.7 a case; the small grid is 6 of them.  The others are
# counted by reading the tests (a guess each, replaced by steps.tsv's measured column):
# the allocator's take/free/undo/slot kernels per page size and check flag, the disagg
# sides' pack/unpack of one spec, the hardening chunks, the pool tests' few shapes.
KVMEM_GPU_GRID=small step smoke 18 5 1 - "small kernel grid first: 6 pack/unpack cases vs the CPU reference" -- \
  "${pyt[@]}" tests/gpu/test_cuda_pack_pool.py -k kernel_matches_ref
step disagg 10 25 1 "$need_nixl" "the disagg sides on CUDA pools: no host sync in step(), memory reused after the unpack" -- \
  "${pyt[@]}" tests/gpu/test_gpu_disagg.py
step hardening 12 40 1 - "chunks past 2^31 units, two devices where there are two, streams, sync-free paths" -- \
  "${pyt[@]}" tests/gpu/test_cuda_sizes_devices_streams.py
step allocator-pool 30 30 1 - "allocator kernels vs the CPU allocator, cuda_vmm pools under pressure and over several chunks, CuPy views" -- \
  "${pyt[@]}" tests/gpu/test_cuda_allocator.py tests/gpu/test_cuda_allocator_order.py \
  tests/gpu/test_gpu_memory_vmm.py tests/gpu/test_gpu_memory_chunks.py \
  tests/gpu/test_cuda_pack_pool.py -k "not kernel_matches_ref"
KVMEM_GPU_GRID=rest step pack-grid 186 10 shards - "the rest of the pack grid (69 cases), sharded" -- \
  "${pyt[@]}" tests/gpu/test_cuda_pack_pool.py -k kernel_matches_ref
KVMEM_GPU_OUT="$out" step sglang-staging 16 15 1 "$need_sglang" "the adapter's staging gather/scatter vs sglang's Triton kernels" -- \
  "${pyt[@]}" -s tests/gpu/test_gpu_sglang_staging.py
step sglang-memory-saver 4 30 1 "$need_tms" "the adapter beside --enable-memory-saver: kvmem's pool and torch_memory_saver's part both released and resumed" -- \
  "${pyt[@]}" tests/gpu/test_gpu_sglang_memory_saver.py
# The benchmarks: sglang's baselines only where it imports, the NIXL ones only where NIXL
# does (said in the log), the table and its plots into OUTDIR.
bench_args=()
[ "$has_sglang_alloc" = 0 ] && bench_args+=(-k "not sglang")
[ "$has_nixl" = 0 ] && bench_args+=(--ignore bench/bench_transfer.py --ignore bench/bench_demo.py)
# bench_netns.py measures TCP over a veth between host-memory pools (no GPU part; it needs
# root to make network namespaces): the CPU run's, not this script's
bench_args+=(--ignore bench/bench_netns.py)
KVMEM_BENCH_OUT="$out" step bench 20 60 1 "$need_bench" "pytest bench: kvmem vs its baselines (no sglang baselines without sglang, no NIXL ones without NIXL)" -- \
  "${pyt[@]}" bench "${bench_args[@]}" --benchmark-columns=median,iqr,ops --benchmark-sort=name

if [ "$plan_only" = 1 ]; then
  say "plan total: ${PLANNED:-0}s of budgets for the steps that would run, ${DEADLINE}s allowed (BASE_S=${BASE_S}s, PER_KERNEL_S=${PER_KERNEL_S}s, $SHARDS processes for the sharded step)"
  exit 0
fi
say "gpu_check: $n_ran ran ok, $n_failed failed, $n_skipped skipped; $((SECONDS - T0))s of ${DEADLINE}s; exit $status; results in $out"
exit $status
