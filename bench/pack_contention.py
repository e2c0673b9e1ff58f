"""CPU pack/unpack of a 128 MiB chunk, quiet and with one core kept busy by another
process (under load, pack stays within 2x of its quiet time).

    python -m bench.pack_contention [--rounds 15] [--tokens 1024] [--md FILE]

For page_size 1, 16 and 64 (32 layers x 8 heads x 128 dims, bf16, pages in random
order) it times, in the same run: ``kvmem.pack_pages`` / ``unpack_pages`` (one op over
all layers: the pool is one storage), the per-layer path they replaced (one op per layer
and K/V, ``_torch_copy_per_layer``, what separate per-layer tensors still take), the
same rows gathered by NumPy's ``take`` (no OpenMP at all: one thread; an alternative,
not what the library does) and a plain ``copy_`` of the same bytes.  All at torch's
default thread count.

Quiet and loaded rounds alternate: one ``while True: pass`` subprocess runs throughout
and is stopped (SIGSTOP) for each quiet call and continued (SIGCONT) for each loaded
one, so a change in what other processes do during the run hits both columns alike.
Medians and the slowest of ``--rounds`` calls each; the load average
(``os.getloadavg``) is printed, because on a shared machine "quiet" is only as quiet as
the others let it be."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from bench import print_table
import kvmem
from kvmem.kernels.pack import pack_buffers_ref
from kvmem.kernels.pack.cpu import _one_storage_rows, _torch_copy_per_layer

LAYERS, HEADS, DIM = 32, 8, 128


def _cases(tokens: int):
    for ps in (1, 16, 64):
        spec = kvmem.KVSpec(
            num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=ps, dtype=torch.bfloat16
        )
        pool = kvmem.KVPool(spec, num_pages=4 * tokens // ps + 1)
        gen = torch.Generator().manual_seed(ps)
        pool._mem.tensor.copy_(
            torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=gen)
        )
        n = tokens // ps
        ids = torch.randperm(pool.num_pages - 1, generator=gen)[:n] + 1
        out = torch.empty(kvmem.packed_nbytes(spec, n), dtype=torch.uint8)
        src = torch.randint(0, 256, out.shape, dtype=torch.uint8, generator=gen)
        plan = pool._plan(None, None)
        k, v = pool.k_buffer, pool.v_buffer
        kvmem.pack_pages(pool, ids, out=out)
        assert torch.equal(out, pack_buffers_ref(k, v, ids))
        fns = {
            "pack (one op)": lambda: kvmem.pack_pages(pool, ids, out=out),
            "pack (per layer)": lambda: _torch_copy_per_layer(plan, k, v, ids, out, True),
            "pack (numpy take)": _numpy_take(plan, k, v, ids, out),
            "unpack (one op)": lambda: kvmem.unpack_pages(out, pool, ids),
            "unpack (per layer)": lambda: _torch_copy_per_layer(plan, k, v, ids, out, False),
            "copy_": lambda: out.copy_(src),
        }
        yield ps, out.numel(), fns
        pool = out = src = None  # the lambdas above hold these names: dropped, not deleted


def _numpy_take(plan, k, v, ids, out):
    """The one-op rows gathered by np.take (single-threaded), when they are a contiguous
    [R, seg] array (whole pages, dense pool)."""
    (g,) = _one_storage_rows(plan, k, v)
    assert g.pitch == g.seg, "the pool's pages are not back to back"
    item = g.base.element_size()
    rows = g.base.as_strided((g.num_rows, g.seg // item), (g.pitch // item, 1), 0)
    rows = rows.view(torch.int64).numpy()
    idx = (np.asarray(g.starts)[:, None] + ids.numpy()[None, :] * g.page_step).reshape(-1)
    dst = out.view(torch.int64).view(idx.shape[0], -1).numpy()
    return lambda: np.take(rows, idx, axis=0, out=dst, mode="clip")


def _time(fn, rounds: int, busy: subprocess.Popen) -> tuple[list, list]:
    """(quiet times, loaded times): rounds alternate, the busy process stopped for the
    quiet call and running for the loaded one."""
    fn()  # warm-up
    quiet, loaded = [], []
    for _ in range(rounds):
        for state, ts in ((signal.SIGSTOP, quiet), (signal.SIGCONT, loaded)):
            busy.send_signal(state)
            time.sleep(0.02)  # let the scheduler see the change
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return quiet, loaded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--md", help="append the table as markdown to this file")
    a = ap.parse_args()
    load0 = os.getloadavg()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    res = {}
    try:
        for ps, nbytes, fns in _cases(a.tokens):
            for op, fn in fns.items():
                q, l = _time(fn, a.rounds, busy)
                res[(ps, op)] = (statistics.median(q), max(q), statistics.median(l), max(l))
                print(
                    f"   P{ps:<3} {op:<20} quiet {res[(ps, op)][0] * 1e3:8.1f} ms  loaded "
                    f"{res[(ps, op)][2] * 1e3:8.1f} ms",
                    flush=True,
                )
    finally:
        busy.kill()
        busy.wait()
    load1 = os.getloadavg()
    lines = [
        f"load average (1 / 5 / 15 min) before: {load0[0]:.2f} / {load0[1]:.2f} / "
        f"{load0[2]:.2f}, after: {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f} (after "
        f"includes the busy process); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; chunk {a.tokens} "
        f"tokens; median (max) of {a.rounds} quiet and {a.rounds} loaded calls, "
        f"alternating",
        "",
        "| page_size | op | quiet ms | loaded ms | loaded / quiet |",
        "|---|---|---|---|---|",
    ]
    for key, (qm, qw, lm, lw) in res.items():
        lines.append(
            f"| {key[0]} | {key[1]} | {qm * 1e3:.1f} ({qw * 1e3:.0f}) | "
            f"{lm * 1e3:.1f} ({lw * 1e3:.0f}) | {lm / qm:.2f} |"
        )
    print_table(lines, a.md)


if __name__ == "__main__":
    main()
