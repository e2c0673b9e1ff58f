#!/usr/bin/env bash
# GPU check: the GPU tests and the GPU benchmarks on a CUDA host, in under 5 minutes.
#
#   bench/gpu_check.sh OUTDIR
#
# Uses the host's own python3 (the H200 target: Python 3.12, torch 2.11, triton 3.6, CuPy)
# with this repository on PYTHONPATH, and installs nothing.  Writes to OUTDIR:
#   env.txt          GPU name, driver, versions
#   gpu-tests.log    pytest tests/gpu (kernels vs references on CUDA tensors, cuda_vmm pool
#                    under memory pressure, the adapter's allocator without host syncs)
#   gpu-hardening.log  chunks past 2^31 units, two devices where there are two, streams
#   sglang-staging.log, sglang_staging.json
#                    the staging gather/scatter against sglang's kernels (where sglang imports)
#   bench.log        pytest bench (kvmem vs baselines; ratios at the end)
#   bench-cuda.json  the benchmark table as JSON
#   nvidia-*-*.png   its plots (bench/plot.py), named after the GPU, where matplotlib
#                    imports; elsewhere draw them from the JSON on any machine with the
#                    test environment: python -m bench.plot OUTDIR/bench-cuda.json bench/results
# Exit status: non-zero if the tests or the benchmarks failed.
set -uo pipefail
out="${1:?usage: bench/gpu_check.sh OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=python3

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  $py - <<'PY'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError as e:
    print("cupy: not importable:", e)
try:
    import sglang.srt.disaggregation.common.staging_buffer  # noqa: F401
    print("sglang staging buffer: importable")
except Exception as e:  # noqa: BLE001
    print("sglang staging buffer: not importable here (", type(e).__name__, e, ")")
try:
    import nixl_cu13  # noqa: F401
    print("nixl: nixl_cu13 importable")
except Exception as e:  # noqa: BLE001
    print("nixl: not importable here (", type(e).__name__, e, ")")
PY
} 2>&1 | tee "$out/env.txt"

status=0
echo "== GPU tests"
timeout 80 $py -m pytest -q -p no:cacheprovider tests/gpu \
  --ignore=tests/gpu/test_gpu_sglang_staging.py --ignore=tests/gpu/test_cuda_hardening.py \
  2>&1 | tee "$out/gpu-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== hardening: K half past 2^31 units, cuda:1 while cuda:0 is current, allocator streams, no hidden syncs"
timeout 100 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cuda_hardening.py 2>&1 \
  | tee "$out/gpu-hardening.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== sglang staging: kvmem's pack/unpack against sglang's Triton staging kernels"
# Byte for byte and in bandwidth; where sglang does not import (the H200 image has none)
# the test says so in one skip line and nothing is compared.
KVMEM_GPU_OUT="$out" timeout 30 $py -m pytest -q -s -rs -p no:cacheprovider \
  tests/gpu/test_gpu_sglang_staging.py 2>&1 | tee "$out/sglang-staging.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmarks"
# Baselines that need sglang run only where it imports (the H200 image has none): said
# in the log, not hidden.
deselect=()
if ! $py -c "import sglang.srt.mem_cache.allocator" >/dev/null 2>&1; then
  echo "sglang is not importable here: its baselines (tests named *sglang*) are not run"
  deselect=(-k "not sglang")
fi
# The NIXL benchmarks need NIXL (carry a nixl-cu13 wheel to run them there).
if ! $py -c "import nixl_cu13" >/dev/null 2>&1 && ! $py -c "import nixl_cu12" >/dev/null 2>&1; then
  echo "NIXL is not importable here: bench_transfer.py and bench_demo.py are not run"
  deselect+=(--ignore bench/bench_transfer.py --ignore bench/bench_demo.py)
fi
KVMEM_BENCH_OUT="$out" timeout 75 $py -m pytest -q -p no:cacheprovider bench "${deselect[@]}" \
  --benchmark-columns=median,iqr,ops --benchmark-sort=name 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: exit $status; results in $out"
exit $status
