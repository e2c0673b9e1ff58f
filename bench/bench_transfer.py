"""NIXL write bandwidth through kvmem.transfer.NixlEngine, against raw NIXL calls and a plain
copy of the same bytes, so later issues can put the demo's throughput next to raw NIXL.

Both agents live in ONE process (UCX still moves the bytes through its transports: RMA by
``cma``/process_vm_writev, notifications over ``tcp``, as between two processes; the
cross-process figures measured earlier on this machine were of the same order).  UCX transports are UCX's
defaults: on this CPU machine they beat ``UCX_TLS=tcp,self`` by about 2x (1.4-1.9 vs
0.5-1.0 GB/s in one run) and ``sm,self`` / ``posix,cma,self`` fail at agent creation.

Each group runs in two modes (one pair of agents alive at a time: a NIXL progress thread
spins a core and would slow the other rows):
  * ``thread``: NIXL's progress thread on (its default);
  * ``polled``: no progress thread; the loop polls the write and the target's notifs,
    as the demo's worker loops do.

Groups:
  * ``nixl write 256 MiB``: one registered buffer to another; the kvmem row's name (and
    ``first_s`` in the JSON) gives the first write after ``add_peer``, connection set-up
    included.
  * ``chunk -> pool pages``: a packed 32-layer chunk (bf16, 8 heads, 128 dim, page 16,
    64 pages = 128 MiB) written into every other page of a pool, 4096 page ranges, vs the
    same bytes as one contiguous write: the cost of page-granular descriptors and of
    kvmem's range checks.

The smoke mode (``KVMEM_BENCH_SMOKE=1``) writes 4 MiB buffers and a 4-page chunk.

On CUDA (``bench_device()``) the buffers are VRAM and NIXL needs its CUDA 13 build there
(``nixl-cu13``); GPU-CHECK: not run yet.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import kvmem
from bench.conftest import bench_device, pick, rounds, sync, warmups
from kvmem.transfer import NixlEngine

DEV = bench_device()
NBYTES = pick(int(os.environ.get("KVMEM_BENCH_XFER_MIB", "256")), 4) << 20
ROUNDS = rounds("KVMEM_BENCH_ROUNDS", 7)
CHUNK_PAGES = pick(64, 4)
MODES = {"thread": True, "polled": False}


def _pattern(nbytes: int, start: int = 0) -> torch.Tensor:
    """Bytes whose every 8-byte word differs (a misplaced word shows), cheap to make."""
    return torch.arange(start, start + nbytes // 8, dtype=torch.int64).view(torch.uint8)


def _write(a: NixlEngine, b: NixlEngine, local, remote, rranges) -> None:
    """One write, polled to its end; the target engine is driven too (it needs that when
    it has no progress thread)."""
    h = a.post_write(local, remote, rranges, b"")
    end = time.monotonic() + 60.0
    while a.poll(h) == "PROC":
        b.get_notifs()
        if time.monotonic() > end:
            raise RuntimeError("NIXL write did not finish in 60 s")
    state = h.state
    a.release(h)
    if state != "DONE":
        raise RuntimeError(f"NIXL write ended {state}: {h.error}")


def _run(benchmark, fn) -> None:
    done = sync(DEV)

    def call():
        fn()
        done()

    call()
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=warmups(1))


def _engines(role: str, mode: str) -> tuple[NixlEngine, NixlEngine]:
    tag = f"{os.getpid()}-{time.time_ns()}"
    pt = MODES[mode]
    return (
        NixlEngine(f"bench-{role}-src-{tag}", progress_thread=pt),
        NixlEngine(f"bench-{role}-dst-{tag}", progress_thread=pt),
    )


# --- one large buffer -------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(MODES))
def pair(request):
    mode = request.param
    a, b = _engines("buf", mode)
    src = _pattern(NBYTES).to(DEV)
    dst = torch.zeros(NBYTES, dtype=torch.uint8, device=DEV)
    a.register("src", [(src.data_ptr(), NBYTES)], 0, DEV)
    b.register("dst", [(dst.data_ptr(), NBYTES)], 0, DEV)
    remote = a.add_peer(b.local_metadata())["dst"]
    local, rranges = [(src.data_ptr(), NBYTES)], [(dst.data_ptr(), NBYTES)]
    t = time.perf_counter()
    _write(a, b, local, remote, rranges)  # the first write: connection set-up included
    sync(DEV)()
    first_s = time.perf_counter() - t
    assert torch.equal(dst, src)
    yield dict(
        mode=mode,
        a=a,
        b=b,
        src=src,
        dst=dst,
        remote=remote,
        local=local,
        rranges=rranges,
        first_s=first_s,
        group=f"nixl write {NBYTES >> 20} MiB, 1 process, {mode}",
    )
    a.close()
    b.close()


def test_nixl_write_kvmem(benchmark, pair, report):
    p = pair
    p["dst"].zero_()
    _run(benchmark, lambda: _write(p["a"], p["b"], p["local"], p["remote"], p["rranges"]))
    assert torch.equal(p["dst"], p["src"])
    first = p["first_s"]
    report.add(
        p["group"],
        f"kvmem NixlEngine.post_write (first: {first * 1e3:.0f} ms)",
        benchmark,
        NBYTES,
        first_s=first,
        first_gb_per_s=NBYTES / first / 1e9,
        figure="transfer",
        role="kvmem",
    )


def test_nixl_write_raw(benchmark, pair, report):
    p = pair
    ag, target = p["a"].agent, p["b"].agent
    mem, dev = p["remote"].mem, p["remote"].device_id

    def raw():
        local = ag.get_xfer_descs([(p["src"].data_ptr(), NBYTES, dev)], mem)
        remote = ag.get_xfer_descs([(p["dst"].data_ptr(), NBYTES, dev)], mem)
        h = ag.initialize_xfer("WRITE", local, remote, p["b"].name, b"")
        state = ag.transfer(h)
        while state == "PROC":
            target.get_new_notifs()
            state = ag.check_xfer_state(h)
        h.release()
        assert state == "DONE"

    _run(benchmark, raw)
    report.add(
        p["group"],
        "raw nixl initialize_xfer+transfer+poll",
        benchmark,
        NBYTES,
        figure="transfer",
        role="baseline",
    )


def test_plain_copy(benchmark, pair, report):
    p = pair
    _run(benchmark, lambda: p["dst"].copy_(p["src"]))
    report.add(
        p["group"],
        "plain copy_ of the same bytes (memcpy)",
        benchmark,
        NBYTES,
        figure="transfer",
        role="ceiling",
    )


# --- a packed chunk into pool pages ---------------------------------------------------------


@pytest.fixture(scope="module")
def pools():
    """Polled mode.  pytest groups the tests by ``pair``'s params and tears the
    ``thread`` pair down when it sets up the ``polled`` one, so no spinning progress
    thread is alive while these run (``-v`` shows the order)."""
    spec = kvmem.KVSpec(
        num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
    )
    a, b = _engines("chunk", "polled")
    src = kvmem.KVPool(spec, CHUNK_PAGES + 1, device=DEV)
    dst = kvmem.KVPool(spec, 2 * CHUNK_PAGES + 1, device=DEV)
    for i, buf in enumerate(src.k_buffer + src.v_buffer):
        u8 = buf.view(torch.uint8).view(-1)
        u8.copy_(_pattern(u8.numel(), i * u8.numel()).to(DEV))
    staging = kvmem.pack_pages(src, torch.arange(1, CHUNK_PAGES + 1, device=DEV))
    flat = torch.empty_like(staging)
    a.register("staging", [(staging.data_ptr(), staging.numel())], 0, DEV)
    b.register_pool(dst)
    b.register("flat", [(flat.data_ptr(), flat.numel())], 0, DEV)
    mems = a.add_peer(b.local_metadata())
    # every other page of the destination: no two pages merge into one descriptor
    dst_ids = list(range(2, 2 * CHUNK_PAGES + 1, 2))
    page_ranges = [
        (buf[p].data_ptr(), buf[p].nbytes) for buf in dst.k_buffer + dst.v_buffer for p in dst_ids
    ]
    _write(a, b, [(staging.data_ptr(), staging.numel())], mems["kv"], page_ranges)
    assert torch.equal(kvmem.pack_pages(dst, torch.tensor(dst_ids, device=DEV)), staging)
    yield dict(a=a, b=b, staging=staging, flat=flat, mems=mems, page_ranges=page_ranges)
    a.close()
    b.close()


def test_chunk_to_pages_kvmem(benchmark, pools, report):
    p = pools
    local = [(p["staging"].data_ptr(), p["staging"].numel())]
    _run(benchmark, lambda: _write(p["a"], p["b"], local, p["mems"]["kv"], p["page_ranges"]))
    n = len(p["page_ranges"])
    report.add(
        "chunk -> pool pages, polled",
        f"kvmem post_write into {n} page ranges",
        benchmark,
        p["staging"].numel(),
        figure="transfer",
        role="kvmem",
    )


def test_chunk_contiguous(benchmark, pools, report):
    p = pools
    n = p["staging"].numel()
    local, remote = [(p["staging"].data_ptr(), n)], [(p["flat"].data_ptr(), n)]
    _run(benchmark, lambda: _write(p["a"], p["b"], local, p["mems"]["flat"], remote))
    assert torch.equal(p["flat"], p["staging"])
    report.add(
        "chunk -> pool pages, polled",
        "kvmem post_write, same bytes contiguous",
        benchmark,
        n,
        figure="transfer",
        role="ceiling",
    )
