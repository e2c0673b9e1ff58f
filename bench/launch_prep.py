"""Host-side cost of preparing one pack launch, measured on the CPU: everything a CUDA
``pack_pages(..., check=False)`` / ``pack_buffers(..., check=False)`` does on the host
before Triton's own launcher (page-id coercion, the plan lookup, the chunk check, the
views, the launch's arguments), with the kernel replaced by a stub that records nothing.

    python -m bench.launch_prep [--calls N] [--repeats R]

The stub takes ``kvmem.kernels.pack.triton._copy_pages_kernel``'s place; ``check=False``
on CUDA skips the id validation (a host sync), which CPU tensors always run, so the
validation is stubbed too (``is_async_device`` reads True).  Cases: a KVPool of 32 and
of 80 layers (``kvmem.pack_pages``, the whole pool), and 80 per-layer K/V tensors given
to ``kvmem.pack_buffers`` (the sglang adapter's call, which keys the plan cache by every
buffer).  Prints, per case, the median and the spread (min, max) over R repeats of the
mean of N calls, in microseconds per call.  Runs against whichever kvmem is imported
(the repository's: run it from the root), so a tree before a change can be measured the
same way."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


class _Stub:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _cases():
    import kvmem

    out = []
    for layers in (32, 80):
        spec = kvmem.KVSpec(
            num_layers=layers, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
        )
        pool = kvmem.KVPool(spec, num_pages=65)
        ids = torch.arange(1, 17)
        chunk = torch.empty(kvmem.packed_nbytes(spec, 16), dtype=torch.uint8)
        out.append(
            (
                f"pack_pages, KVPool of {layers} layers, 16 pages",
                lambda pool=pool, ids=ids, chunk=chunk: kvmem.pack_pages(
                    pool, ids, out=chunk, check=False
                ),
            )
        )
    spec = kvmem.KVSpec(
        num_layers=80, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=65)
    ks, vs = list(pool.k_buffer), list(pool.v_buffer)  # 80 + 80 separate tensors
    ids = torch.arange(1, 17)
    chunk = torch.empty(kvmem.packed_nbytes(spec, 16), dtype=torch.uint8)
    out.append(
        (
            "pack_buffers, 80 K + 80 V tensors, 16 pages",
            lambda: kvmem.pack_buffers(ks, vs, ids, out=chunk, check=False),
        )
    )
    return out


def measure(calls: int, repeats: int) -> list[tuple[str, float, float, float]]:
    os.environ["KVMEM_FORCE_TRITON"] = "1"  # read per call: CPU tensors take _launch
    from kvmem.kernels import pack as P
    from kvmem.kernels.pack import triton as T

    T._copy_pages_kernel = _Stub()
    P.is_async_device = lambda t: True  # as on CUDA with check=False: no id validation
    rows = []
    for name, fn in _cases():
        for _ in range(100):  # the plans, the caches
            fn()
        means = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            means.append((time.perf_counter() - t) / calls * 1e6)
        rows.append((name, statistics.median(means), min(means), max(means)))
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import kvmem

    print(f"kvmem: {os.path.dirname(kvmem.__file__)}; {a.calls} calls x {a.repeats} repeats")
    for name, med, lo, hi in measure(a.calls, a.repeats):
        print(f"{name:<48} median {med:7.2f} us/call  [{lo:.2f}, {hi:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
