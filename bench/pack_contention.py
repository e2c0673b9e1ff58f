"""CPU pack/unpack of a 128 MiB chunk, quiet and with one core kept busy by another
process (issue 11, item 5: under load, pack stays within 2x of its quiet time).

    python -m bench.pack_contention [--rounds 15] [--tokens 1024] [--md FILE]

For page_size 1, 16 and 64 (32 layers x 8 heads x 128 dims, bf16, pages in random
order) it times, in the same run: ``kvmem.pack_pages`` / ``unpack_pages`` (one op over
all layers: the pool is one storage), the per-layer path they replaced (one op per layer
and K/V, ``_torch_copy_per_layer``, what separate per-layer tensors still take) and a
plain ``copy_`` of the same bytes.  Each at torch's default thread count, first with
nothing else started, then with a ``while True: pass`` subprocess running.  Medians and
the slowest round of ``--rounds`` calls; the load average (``os.getloadavg``) is printed
with each phase, because on a shared machine "quiet" is only as quiet as the others
let it be."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import kvmem
from kvmem.kernels import pack as P

LAYERS, HEADS, DIM = 32, 8, 128


def _cases(tokens: int):
    for ps in (1, 16, 64):
        spec = kvmem.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=ps,
                            dtype=torch.bfloat16)
        pool = kvmem.KVPool(spec, num_pages=4 * tokens // ps + 1)
        gen = torch.Generator().manual_seed(ps)
        pool._mem.tensor.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8,
                                             generator=gen))
        n = tokens // ps
        ids = torch.randperm(pool.num_pages - 1, generator=gen)[:n] + 1
        out = torch.empty(kvmem.packed_nbytes(spec, n), dtype=torch.uint8)
        src = torch.randint(0, 256, out.shape, dtype=torch.uint8, generator=gen)
        plan = pool._plan(None, None)
        k, v = pool.k_buffer, pool.v_buffer
        kvmem.pack_pages(pool, ids, out=out)
        assert torch.equal(out, P.pack_buffers_ref(k, v, ids))
        fns = {
            "pack (one op)": lambda: kvmem.pack_pages(pool, ids, out=out),
            "pack (per layer)": lambda: P._torch_copy_per_layer(plan, k, v, ids, out, True),
            "unpack (one op)": lambda: kvmem.unpack_pages(out, pool, ids),
            "unpack (per layer)": lambda: P._torch_copy_per_layer(plan, k, v, ids, out, False),
            "copy_": lambda: out.copy_(src),
        }
        yield ps, out.numel(), fns
        del pool, out, src


def _time(fn, rounds: int) -> tuple[float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), max(ts)


def _phase(name: str, tokens: int, rounds: int) -> dict:
    load = os.getloadavg()
    print(f"-- {name}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    res = {}
    for ps, nbytes, fns in _cases(tokens):
        for op, fn in fns.items():
            med, worst = _time(fn, rounds)
            res[(ps, op)] = (med, worst, nbytes)
            print(f"   P{ps:<3} {op:<20} median {med * 1e3:8.1f} ms  max {worst * 1e3:8.1f} ms"
                  f"  {nbytes / med / 1e9:6.2f} GB/s", flush=True)
    return dict(load=load, res=res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--md", help="write the table as markdown to this file")
    a = ap.parse_args()
    quiet = _phase("quiet (nothing started by this script)", a.tokens, a.rounds)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        loaded = _phase("one core kept busy by a `while True: pass` subprocess", a.tokens,
                        a.rounds)
    finally:
        busy.kill()
        busy.wait()
    lines = [
        f"quiet phase load average {quiet['load'][0]:.2f} (1 min) / {quiet['load'][1]:.2f} "
        f"(5 min); loaded phase {loaded['load'][0]:.2f} / {loaded['load'][1]:.2f}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} "
        f"CPUs; chunk {a.tokens} tokens, median (max) of {a.rounds} rounds",
        "",
        "| page_size | op | quiet ms | loaded ms | loaded / quiet |",
        "|---|---|---|---|---|",
    ]
    for key, (qm, qw, _) in quiet["res"].items():
        lm, lw, _ = loaded["res"][key]
        lines.append(f"| {key[0]} | {key[1]} | {qm * 1e3:.1f} ({qw * 1e3:.0f}) | "
                     f"{lm * 1e3:.1f} ({lw * 1e3:.0f}) | {lm / qm:.2f} |")
    print("\n".join(lines))
    if a.md:
        with open(a.md, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
