#!/usr/bin/env bash
# GPU check: the GPU tests and the GPU benchmarks on a CUDA host, in under 5 minutes on a
# bare H200 host (an empty Triton cache; no NIXL, no sglang, no package index), with the
# results in one archive that is kept up to date as the steps run.
#
#   bench/gpu_check.sh OUTDIR            run the steps below; OUTDIR gets three files
#   bench/gpu_check.sh --plan            print the plan (each step's budget, what it needs,
#                                        what would be skipped on this host and why) and
#                                        run nothing: also on a machine without a GPU
#   bench/gpu_check.sh --dry-run OUTDIR  on a machine without a GPU, everything that can
#                                        run there: the probes, the benchmark step on the
#                                        CPU at smoke sizes (KVMEM_BENCH_SMOKE=1), the
#                                        CUDA test steps collected only (pytest
#                                        --collect-only: each file imports, or skips itself
#                                        without CUDA), the summary and the archive
#   bench/gpu_check.sh --selftest OUTDIR the step runner on a few CPU commands (a pass, a
#                                        failure, a step past its budget, a sharded one)
# tests/test_bench_smoke.py checks --plan, --dry-run and --selftest here, and runs the
# script with a stand-in for python3 (KVMEM_PYTHON) to check what happens to a step
# stopped at its budget, to the budgets after a fast first step, to a probe that hangs
# and to a run killed outright.
#
# Uses the host's own python3 (the H200 image's: Python 3.12, torch 2.11, triton 3.6,
# pytest, pytest-benchmark, CuPy, matplotlib) with this repository on PYTHONPATH, and
# installs nothing.
# Without pytest-benchmark the benchmarks time themselves with bench/timer.py (the same
# rounds and medians).  NIXL, where it is wanted, is a carried wheel (README.md).
#
# Output.  Everything is written to a scratch folder, and OUTDIR gets three files, each
# written again after the probes and after every step, so that a run killed outright
# (past the device tool's limit, say) leaves what the finished steps measured (the device
# tool returns at most 8 files from an output folder):
#   console.log             everything this script prints, as it prints it
#   summary.txt             bench/gpu_summary.py's screen of what the scratch folder holds
#                           (every step; every benchmark target against what was measured,
#                           PASS / FAIL / n/a; the figures behind each plot), printed at
#                           the end (also after a failure or an interrupt)
#   kvmem-gpu-check.tar.gz  the scratch folder:
#     env.txt        GPU name, driver, versions, which optional packages import
#     run.txt        the runner's line per step, as printed while it ran
#     steps.tsv      the same as columns (measured kernels and seconds: the next sizing)
#     summary.txt, console.log   as above
#     <step>.log     each step's pytest output (-rs: every skip with its reason)
#     bench-cuda.json, nvidia-*-*.png, sglang_staging.json   where those steps ran;
#     bench-transfer/   the NIXL benchmark's JSON and plots, where NIXL imports
# Exit status: 1 if a step failed or ran past its budget, 2 without a CUDA device (or
# without pytest), else 0 (skips are listed, not failures).
#
# Steps, in order: the small kernel grid (a broken kernel or toolchain shows within a
# minute, and it measures this host's compile rate), then the benchmarks (the H200
# targets are what they measure, so they get their budget before the rest; the CPU
# benchmarks, bench_demo.py, bench_netns.py, bench_sglang_transfer.py and bench_serving.py,
# are left out, and
# bench_transfer.py runs last, as a step of its own), then the other tests.  Each runs
# under a time budget sized from the Triton kernels it compiles on an empty cache:
#
#     budget = BASE_S + (processes - 1) * START_EXTRA_S + run seconds
#              + kernels * PER_KERNEL_S / processes
#
# kernels and run seconds are estimates per step (the table below says where each comes
# from); PER_KERNEL_S starts as a guess and is replaced by what the first step measured
# (seconds per new cubin in the Triton cache).  The benchmark step's budget never drops
# below BENCH_FLOOR_S (70 s), whatever the first step measured: its time is mostly its
# rounds and the fills of its pools, which a fast compiler does not shorten.  The whole
# run, the probes included, has KVMEM_GPU_CHECK_SECONDS (default 290): a step whose budget
# does not fit in what is left is skipped, saying so; one that needs a package the host
# lacks (NIXL, sglang) too.  The probes (one python process that imports torch, starts
# CUDA, imports CuPy, NIXL and sglang; nvidia-smi beside it) are planned at PROBE_S (8 s)
# and stopped at PROBE_LIMIT_S (30 s): what the python probe had not reported by then
# counts as not importable, and the log names the import it was stopped in.
#
# A step at its budget gets SIGINT, so that pytest ends as after a Ctrl-C: it prints its
# count line (what passed before) and runs its end-of-session hooks, where
# bench/conftest.py writes its JSON and plots (it also writes the JSON after every
# benchmark, marked partial, for a step that dies harder); SIGKILL follows KILL_S (5) s
# later (timeout --kill-after), for a process that does not end on SIGINT.  The last
# 10 s of the 5 minutes hold that grace, the summary and the archive (about 1 s).  Set
# KVMEM_GPU_CHECK_SECONDS higher to run everything on a slow host.
#
# For planning (and the CPU tests of this script):
#   KVMEM_PYTHON=...                    the interpreter (default python3)
#   KVMEM_GPU_CORES=16                  plan for that many cores (default: nproc)
#   KVMEM_GPU_WITHOUT="nixl sglang pytest-benchmark"   treat these as not importable
#   KVMEM_GPU_BASE_S, KVMEM_GPU_PER_KERNEL_S, KVMEM_GPU_START_EXTRA_S   the sizing guesses
#   KVMEM_GPU_BUDGET_S="bench=120 ..."  these steps get these budgets (seconds), instead
#                                       of the sizing and the floor
#   KVMEM_GPU_PROBE_LIMIT_S=30          each probe's bound
# Each step's command runs with KVMEM_GPU_STEP set to the step's name.
set -uo pipefail

mode=run
case "${1:-}" in
  --plan) mode=plan; shift ;;
  --selftest) mode=selftest; shift ;;
  --dry-run) mode=dry; shift ;;
esac
out="" work="" tee_pid=""
if [ "$mode" != plan ]; then
  out="${1:?usage: bench/gpu_check.sh [--plan | --dry-run OUTDIR | --selftest OUTDIR | OUTDIR]}"
  mkdir -p "$out" || exit 2
  out="$(cd "$out" && pwd)"  # before the cd below: OUTDIR is the caller's
  work="$(mktemp -d "${TMPDIR:-/tmp}/kvmem-gpu-check.XXXXXX")" || exit 2
  # everything printed from here on also goes to OUTDIR/console.log, as it is printed
  # (tee ignores SIGINT and SIGTERM: it ends when this script closes its output)
  exec > >(trap '' INT TERM; exec tee "$out/console.log") 2>&1
  tee_pid=${!:-}
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${KVMEM_PYTHON:-python3}
T0=$SECONDS

DEADLINE=${KVMEM_GPU_CHECK_SECONDS:-290}  # the whole run but the summary and the archive
# A pytest process's start on the H200 host (python, torch, triton, a CUDA context, kvmem,
# collection): a guess (about 12 s), not measured there yet.
BASE_S=${KVMEM_GPU_BASE_S:-12}
# Each more process of a step that starts several at once on one GPU: what of a start
# does not overlap (CUDA context creation on one device, the imports' disk reads): a
# guess, not measured.
START_EXTRA_S=${KVMEM_GPU_START_EXTRA_S:-1}
# One Triton 3.6 compile for sm_90 on that host's CPU: a guess until the first step
# measures it (kept when it compiled nothing: a warm cache).
PER_KERNEL_S=${KVMEM_GPU_PER_KERNEL_S:-1.0}
# The probes: one python process (torch, CUDA, CuPy, pytest, NIXL, sglang imported or
# not) with nvidia-smi beside it: a guess, for the plan; each is stopped at the bound.
PROBE_S=8
PROBE_LIMIT_S=${KVMEM_GPU_PROBE_LIMIT_S:-30}
# The benchmark step's least budget: it plausibly needs 35-75 s on the H200 (a start, 26
# compiles, about 30 s of rounds and pool fills): a guess, not measured there yet.  70 s
# is what the 5 minutes leave it when every step that runs on a bare host takes its
# whole budget at the guessed compile rate (--plan's total: 290 s).
BENCH_FLOOR_S=70
KILL_S=5
CORES=${KVMEM_GPU_CORES:-$(nproc 2>/dev/null || echo 4)}
SHARDS=$(( CORES / 2 )); [ "$SHARDS" -gt 8 ] && SHARDS=8; [ "$SHARDS" -lt 1 ] && SHARDS=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
ARCHIVE=kvmem-gpu-check.tar.gz

save() {  # OUTDIR's files as the scratch folder stands: the end screen, the archive
  "$py" -m bench.gpu_summary "$work" > "$work/summary.txt" 2>&1 \
    || echo "(bench/gpu_summary.py failed: see above)" >> "$work/summary.txt"
  cp -f "$out/console.log" "$work/console.log" 2>/dev/null  # a copy: tar reads no growing file
  cp -f "$work/summary.txt" "$out/summary.txt" \
    && tar -czf "$out/$ARCHIVE.part" -C "$work" . && mv -f "$out/$ARCHIVE.part" "$out/$ARCHIVE"
}

finish() {  # on every exit of a run: the end screen, then OUTDIR's files a last time
  local rc=$? saved=0
  trap - EXIT
  if [ -n "$work" ]; then
    echo
    if save; then
      saved=1
      cat "$work/summary.txt"
      echo "gpu_check: exit $rc; everything in $out/$ARCHIVE, this screen in $out/summary.txt, the console in $out/console.log"
    else
      cat "$work/summary.txt"
      echo "gpu_check: exit $rc; could not write $out/$ARCHIVE: the files stay in $work"
    fi
    # the console's last lines into the archive too: tee ends once its input is closed
    exec >/dev/null 2>&1
    local i
    for ((i = 0; i < 50; i++)); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
    if [ "$saved" = 1 ]; then
      cp -f "$out/console.log" "$work/console.log" \
        && tar -czf "$out/$ARCHIVE.part" -C "$work" . && mv -f "$out/$ARCHIVE.part" "$out/$ARCHIVE" \
        && rm -rf "$work"
    fi
  fi
  exit "$rc"
}
if [ -n "$work" ]; then
  trap finish EXIT
  trap 'exit 130' INT TERM  # so that finish runs then too
fi

cubins() { find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l; }
left() { echo $(( DEADLINE - (SECONDS - T0) )); }
say() {  # one line to stdout and, in a run, to run.txt
  echo "$*"
  [ -n "$work" ] && echo "$*" >> "$work/run.txt"
  return 0
}

# -- what this host has: one python process (not for --selftest), nvidia-smi beside it ----
has_cuda=0 has_pytest=0 has_nixl=0 has_sglang=0 has_sglang_alloc=0 has_tms=0
has_benchmark=0 has_cupy=0
probe="" probe_rc=0 probe_note="" smi_pid=""
probed="cuda pytest nixl sglang sglang_alloc tms benchmark cupy"  # the probe's order
if [ "$mode" = run ] || [ "$mode" = dry ]; then
  timeout --kill-after=2 "$PROBE_LIMIT_S" nvidia-smi \
    --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv \
    > "$work/nvidia-smi.txt" 2>&1 &
  smi_pid=$!
fi
if [ "$mode" != selftest ]; then
  # "try NAME" before each import, "has NAME 0|1" after it: a probe stopped at its bound
  # shows which import it was in
  probe=$(timeout --kill-after=2 "$PROBE_LIMIT_S" "$py" - 2>/dev/null <<'PY'
import os
CHECKS = {  # name: (the KVMEM_GPU_WITHOUT word that turns it off, what must import and hold)
    "cuda": ("cuda", "import torch; assert torch.cuda.is_available()"),
    "pytest": ("pytest", "import pytest"),
    "nixl": ("nixl", "from kvmem.transfer.nixl import import_nixl; import_nixl()"),
    "sglang": ("sglang", "import sglang.srt.disaggregation.common.staging_buffer"),
    "sglang_alloc": ("sglang", "import sglang.srt.mem_cache.allocator"),
    "tms": ("sglang", "import torch_memory_saver, sglang.srt.mem_cache.memory_pool"),
    "benchmark": ("pytest-benchmark", "import pytest_benchmark"),
    "cupy": ("cupy", "import cupy"),
}
without = set(os.environ.get("KVMEM_GPU_WITHOUT", "").split())
for name, (word, code) in CHECKS.items():
    print("try", name, flush=True)
    ok = 0
    if word not in without:
        try:
            exec(code, {})
            ok = 1
        except BaseException:
            pass
    print("has", name, ok, flush=True)
try:
    import torch, triton
    print("env torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
    if torch.cuda.is_available():
        print("env device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
except BaseException as e:
    print("env torch/triton:", repr(e))
PY
  )
  probe_rc=$?
fi
reported=" " last_try=""
while read -r kind name value; do
  case $kind in
    try) last_try=$name; continue ;;
    has) reported+="$name " ;;
    *) continue ;;
  esac
  case $name in
    cuda) has_cuda=$value ;; pytest) has_pytest=$value ;; nixl) has_nixl=$value ;;
    sglang) has_sglang=$value ;; sglang_alloc) has_sglang_alloc=$value ;;
    tms) has_tms=$value ;; benchmark) has_benchmark=$value ;; cupy) has_cupy=$value ;;
  esac
done <<< "$probe"
if [ "$mode" != selftest ] && [ "$probe_rc" -ne 0 ]; then
  missing=""
  for name in $probed; do [[ $reported == *" $name "* ]] || missing+=" $name"; done
  where="after its checks"  # in the versions' lines
  if [ -z "$last_try" ]; then where="before its first check"
  elif [[ $reported != *" $last_try "* ]]; then where="while importing for '$last_try'"; fi
  if [ "$probe_rc" -eq 124 ] || [ "$probe_rc" -eq 137 ]; then
    probe_note="probe: stopped at its ${PROBE_LIMIT_S}s bound $where"
  else
    probe_note="probe: exit $probe_rc $where"
  fi
  [ -n "$missing" ] && probe_note+="; counted as not importable:$missing"
fi

if [ -n "$work" ]; then
  printf 'step\tstatus\tseconds\tbudget\tkernels_est\tkernels_compiled\tprocesses\tresult\n' > "$work/steps.tsv"
fi
if [ "$mode" = plan ] && [ -n "$probe_note" ]; then say "$probe_note"; fi
if [ "$mode" = run ] || [ "$mode" = dry ]; then
  smi_rc=0; wait "$smi_pid"; smi_rc=$?
  {
    date -u +%FT%TZ
    cat "$work/nvidia-smi.txt"
    if [ "$smi_rc" -eq 124 ] || [ "$smi_rc" -eq 137 ]; then
      echo "nvidia-smi: stopped at its ${PROBE_LIMIT_S}s bound"
    fi
    grep '^env ' <<< "$probe" | sed 's/^env //'
    echo "mode $mode; cores $CORES, $SHARDS processes for the sharded step, TRITON_CACHE_DIR $TRITON_CACHE_DIR ($(cubins) cubins in it)"
    echo "importable: cuda=$has_cuda pytest=$has_pytest cupy=$has_cupy nixl=$has_nixl sglang=$has_sglang pytest-benchmark=$has_benchmark (KVMEM_GPU_WITHOUT='${KVMEM_GPU_WITHOUT:-}')"
    [ -n "$probe_note" ] && echo "$probe_note"
  } 2>&1 | tee "$work/env.txt"
  rm -f "$work/nvidia-smi.txt"
  [ -n "$probe_note" ] && echo "$probe_note" >> "$work/run.txt"  # printed above
  save
  if [ "$mode" = run ] && [ "$has_cuda" = 0 ]; then
    echo "gpu_check: no CUDA device here: nothing to check (--dry-run runs what a CPU can)"; exit 2
  fi
  if [ "$has_pytest" = 0 ]; then echo "gpu_check: pytest is not importable here: nothing can run"; exit 2; fi
fi

status=0; n_ran=0; n_skipped=0; n_failed=0
PLANNED=$PROBE_S

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
  local budget fixed
  budget=$(awk -v b="$BASE_S" -v e="$START_EXTRA_S" -v r="$run_s" -v k="$kernels" \
    -v p="$PER_KERNEL_S" -v n="$n" \
    'BEGIN { x = b + (n - 1) * e + r + k * p / n; printf "%d", (x == int(x)) ? x : int(x) + 1 }')
  fixed=$(tr ' ' '\n' <<< "${KVMEM_GPU_BUDGET_S:-}" | sed -n "s/^$name=\([0-9][0-9]*\)$/\1/p" | head -n 1)
  if [ -n "$fixed" ]; then
    budget=$fixed
  elif [ "$name" = bench ] && [ "$budget" -lt "$BENCH_FLOOR_S" ]; then
    budget=$BENCH_FLOOR_S
  fi
  local rem; rem=$(left)
  if [ "$mode" = plan ]; then  # as if every step before took its whole budget
    rem=$(( DEADLINE - PLANNED ))
    local would=run
    if [ "$need" != - ]; then
      would="skip: $need"
    elif [ "$budget" -gt "$rem" ]; then
      would="skip: out of time unless the steps before end early (needs ${budget}s, ${rem}s left)"
    else
      PLANNED=$(( PLANNED + budget ))
    fi
    say "plan $name budget=${budget}s kernels=$kernels processes=$n would=$would | $what"
    return 0
  fi
  if [ "$need" != - ]; then
    n_skipped=$((n_skipped + 1))
    say "[$name] skipped: $need | $what"
    printf '%s\tskipped\t0\t%s\t%s\t0\t%s\t%s\n' "$name" "$budget" "$kernels" "$n" "$need" >> "$work/steps.tsv"
    save
    return 0
  fi
  if [ "$budget" -gt "$rem" ]; then
    n_skipped=$((n_skipped + 1))
    say "[$name] skipped: needs ${budget}s ($kernels kernels at ${PER_KERNEL_S}s over $n process(es)), ${rem}s left of ${DEADLINE}s | $what"
    printf '%s\tskipped\t0\t%s\t%s\t0\t%s\tout of time (needs %ss, %ss left)\n' "$name" "$budget" \
      "$kernels" "$n" "$budget" "$rem" >> "$work/steps.tsv"
    save
    return 0
  fi
  local log="$work/$name.log" before t rc=0
  # SIGINT at the budget: pytest ends as after a Ctrl-C, its count line and end-of-session
  # hooks (the benchmarks' JSON and plots) included; SIGKILL KILL_S later
  local limit=(timeout -s INT --kill-after="$KILL_S" "$budget")
  before=$(cubins); t=$SECONDS
  if [ "$n" -gt 1 ]; then
    local pids=() i
    for ((i = 0; i < n; i++)); do
      KVMEM_GPU_STEP="$name" KVMEM_GPU_SHARD="$i/$n" "${limit[@]}" "${cmd[@]}" > "$log.$i" 2>&1 &
      pids+=($!)
    done
    local one
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"; one=$?
      # a timeout (124: ended by SIGINT, 137: by SIGKILL) outranks any other status
      if [ "$one" -eq 124 ] || [ "$one" -eq 137 ]; then rc=$one
      elif [ "$one" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ]; then rc=$one; fi
    done
    for ((i = 0; i < n; i++)); do echo "== process $i of $n"; cat "$log.$i"; rm -f "$log.$i"; done > "$log"
  else
    KVMEM_GPU_STEP="$name" "${limit[@]}" "${cmd[@]}" > "$log" 2>&1; rc=$?
  fi
  local secs=$((SECONDS - t)) compiled=$(( $(cubins) - before ))
  # pytest's count lines (one per process): "12 passed, 1 skipped in 30.1s", and what
  # --collect-only says: "6 tests collected in 0.5s"
  local result
  result=$(grep -E '^=*[^=]*\b(passed|failed|error|errors|skipped|deselected|collected|no tests ran)\b[^=]* in [0-9.]+s' "$log" \
           | sed -E 's/^=+ //; s/ =+$//' | paste -sd ';' -)
  [ -z "$result" ] && result="no pytest summary (see $name.log)"
  local verdict=ok
  if [ "$mode" = dry ] && [ "$rc" = 5 ]; then rc=0; fi  # collected nothing: skips itself without CUDA
  case $rc in
    0) n_ran=$((n_ran + 1)) ;;
    124|137) verdict="TIMEOUT (ran past its ${budget}s budget)"; status=1; n_failed=$((n_failed + 1)) ;;
    5) verdict="nothing collected"; status=1; n_failed=$((n_failed + 1)) ;;
    *) verdict="FAILED (exit $rc)"; status=1; n_failed=$((n_failed + 1)) ;;
  esac
  say "[$name] ran: $result | $what | $compiled kernels compiled (est $kernels), ${secs}s of ${budget}s | $verdict"
  grep -E '^SKIPPED' "$log" | sed -E 's/^/    /' | head -n 5 | while read -r l; do say "$l"; done
  if [ "$rc" -ne 0 ]; then tail -n 25 "$log"; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "${verdict%% *}" "$secs" "$budget" "$kernels" \
    "$compiled" "$n" "$result" >> "$work/steps.tsv"
  if [ "$name" = smoke ] && [ "$compiled" -gt 0 ]; then
    # the host's own compile rate, for the budgets of the steps that follow
    PER_KERNEL_S=$(awk -v s="$secs" -v b="$BASE_S" -v r="$run_s" -v c="$compiled" \
      'BEGIN { x = (s - b - r) / c; if (x < 0.2) x = 0.2; if (x > 5) x = 5; printf "%.2f", x }')
    say "    measured: ${PER_KERNEL_S}s per kernel (the following budgets use it)"
  fi
  save
}

if [ "$mode" = selftest ]; then  # the runner itself, on CPU commands
  step pass 0 3 1 - "a step that passes" -- "$py" -c "print('3 passed, 1 skipped in 0.10s')"
  step fail 0 3 1 - "a step that fails" -- "$py" -c "import sys; print('1 failed, 2 passed in 0.20s'); sys.exit(1)"
  step slow 0 1 1 - "a step past its budget" -- sleep 30
  step stubborn 0 1 1 - "a step that ignores SIGINT and SIGTERM" -- "$py" -c \
    "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; time.sleep(60)"
  step sharded 0 3 shards - "a sharded step" -- "$py" -c "import os; print('shard', os.environ['KVMEM_GPU_SHARD']); print('1 passed in 0.01s')"
  step missing 0 3 1 "a package is not importable here" "a step that cannot run here" -- false
  say "gpu_check: $n_ran ran ok, $n_failed failed, $n_skipped skipped; exit $status"
  exit $status
fi

need_nixl="-"; [ "$has_nixl" = 0 ] && need_nixl="NIXL is not importable here (README.md: carrying the nixl-cu13 wheel)"
need_sglang="-"; [ "$has_sglang" = 0 ] && need_sglang="sglang is not importable here: nothing to compare its staging kernels with"
need_tms="-"; [ "$has_tms" = 0 ] && need_tms="sglang or torch_memory_saver is not importable here: nothing to run the adapter beside --enable-memory-saver with"
pyt=("$py" -m pytest -q -rs -p no:cacheprovider)
bench_smoke=""
if [ "$mode" = dry ]; then  # CUDA tests: collected only; the benchmarks on the CPU, tiny
  pyt+=(--noconftest --collect-only)
  bench_smoke=1
fi

# Kernel estimates: the pack grid's 75 cases compile about 204 variants (issue 15, an
# empty Triton cache), about 2.7 a case; the small grid is 6 of them.  The benchmarks
# (bench_pack.py's cases): pack and unpack of 3 gqa-bf16 page sizes in two variants each
# (Triton specialises the page count on divisibility by 16, and the 1 MiB / 8-page /
# 2-page chunks are not) and of 3 fp8 MLA page sizes, 18, and about 8 of the allocator's.
# The others are counted by reading the tests (a guess each, replaced by steps.tsv's
# measured column): the allocator's take/free/undo/slot kernels per page size and check
# flag, the disagg sides' pack/unpack of one spec, the hardening chunks, the pool tests'
# few shapes.  Run seconds: the benchmarks' 30 s are their rounds (the 64 GiB
# release/resume the most) with the pools filled on the device (the CPU fill of 7.7 GiB
# took tens of seconds); the others are guesses.
KVMEM_GPU_GRID=small step smoke 18 5 1 - "small kernel grid first: 6 pack/unpack cases vs the CPU reference" -- \
  "${pyt[@]}" tests/gpu/test_cuda_pack_pool.py -k kernel_matches_ref
# The benchmarks: sglang's baselines only where it imports, the table and its plots into
# the archive.  Not here: the CPU ones (bench_demo.py, the kvmem demo's processes over UCX
# on host memory, minutes; bench_netns.py, TCP over a veth between host-memory pools, root
# only; bench_sglang_transfer.py, sglang's PD pairs on host memory; bench_serving.py, sglang
# servers on the CPU from .venv-e2e, tens of minutes), which are the CPU run's, and
# bench_transfer.py, NIXL, a step of its own below.
bench_opts=()
if [ "$has_benchmark" = 1 ]; then
  bench_opts+=(--benchmark-columns=median,iqr,ops --benchmark-sort=name)
else
  bench_opts+=(-p no:benchmark)  # bench/timer.py times them
fi
bench_args=(--ignore bench/bench_demo.py --ignore bench/bench_netns.py
  --ignore bench/bench_sglang_transfer.py --ignore bench/bench_serving.py
  --ignore bench/bench_transfer.py)
[ "$has_sglang_alloc" = 0 ] && bench_args+=(-k "not sglang")
KVMEM_BENCH_SMOKE="$bench_smoke" KVMEM_BENCH_OUT="$work" step bench 26 30 1 - "pytest bench: kvmem vs its baselines (no sglang baselines without sglang; not the CPU benchmarks, not NIXL's)" -- \
  "$py" -m pytest -q -rs -p no:cacheprovider bench "${bench_args[@]}" "${bench_opts[@]}"
step gpu-paths 42 70 1 - "chunks past 2^31 units, two devices where there are two, streams, sync-free paths; allocator kernels vs the CPU allocator, cuda_vmm pools under pressure and over several chunks, CuPy views" -- \
  "${pyt[@]}" tests/gpu/test_cuda_sizes_devices_streams.py \
  tests/gpu/test_cuda_allocator.py tests/gpu/test_cuda_allocator_order.py \
  tests/gpu/test_gpu_memory_vmm.py tests/gpu/test_gpu_memory_chunks.py \
  tests/gpu/test_cuda_pack_pool.py -k "not kernel_matches_ref"
step disagg 10 25 1 "$need_nixl" "the disagg sides on CUDA pools: no host sync in step(), memory reused after the unpack" -- \
  "${pyt[@]}" tests/gpu/test_gpu_disagg.py
KVMEM_GPU_GRID=rest step pack-grid 186 10 shards - "the rest of the pack grid (69 cases), sharded" -- \
  "${pyt[@]}" tests/gpu/test_cuda_pack_pool.py -k kernel_matches_ref
KVMEM_GPU_OUT="$work" step sglang-staging 16 15 1 "$need_sglang" "the adapter's staging gather/scatter vs sglang's Triton kernels" -- \
  "${pyt[@]}" -s tests/gpu/test_gpu_sglang_staging.py
step sglang-memory-saver 4 30 1 "$need_tms" "the adapter beside --enable-memory-saver: kvmem's pool and torch_memory_saver's part both released and resumed" -- \
  "${pyt[@]}" tests/gpu/test_gpu_sglang_memory_saver.py
# NIXL's write bandwidth between VRAM buffers (two agents in one process; a figure with no
# target yet): its kernels (a chunk packed once) and run seconds (7 rounds of 256 MiB and
# 128 MiB writes in two modes, the agents' start) are guesses.  Its JSON and plots into a
# folder of their own, beside the benchmark step's.
KVMEM_BENCH_SMOKE="$bench_smoke" KVMEM_BENCH_OUT="$work/bench-transfer" step bench-transfer 2 20 1 "$need_nixl" "NIXL write bandwidth on VRAM: kvmem's engine vs raw NIXL vs a plain copy" -- \
  "$py" -m pytest -q -rs -p no:cacheprovider bench/bench_transfer.py "${bench_opts[@]}"

if [ "$mode" = plan ]; then
  say "plan total: ${PLANNED}s of budgets (the probes' ${PROBE_S}s and the steps that would run), ${DEADLINE}s allowed (BASE_S=${BASE_S}s, START_EXTRA_S=${START_EXTRA_S}s, PER_KERNEL_S=${PER_KERNEL_S}s, $SHARDS processes for the sharded step)"
  exit 0
fi
say "gpu_check: $n_ran ran ok, $n_failed failed, $n_skipped skipped; $((SECONDS - T0))s of ${DEADLINE}s; exit $status"
exit $status
