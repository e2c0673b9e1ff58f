"""Pools of several physical chunks over real NIXL (UCX, DRAM): the CPU twin of a CUDA
pool's regions.  A descriptor across two chunks is refused by NIXL itself
(NIXL_ERR_NOT_FOUND), also when both chunks are registered and adjacent; kvmem refuses it
before NIXL sees it; every prepared descriptor of a pool lies inside one chunk, so every
page of every plane moves in direct (post_blocks WRITE), pull (READ) and packed
(pack + write + unpack) modes, for 576- and 1152-byte MLA tokens at page_size 1 and 64
and for both layouts.  The engines borrow session-long NIXL agents (tests/nixl_agents.py);
the rules they share with the loopback engine are tests/transfer/test_engine_contract.py."""

from __future__ import annotations

import itertools
import mmap
import os
import ctypes

import numpy as np
import pytest
import torch

import kvmem
from kvmem.memory import make_backend
from kvmem.transfer import NixlEngine, TransferError
from kvmem.transfer.layout import MAX_TABLE_BLOCKS, BlockLayout

_ids = itertools.count()

SPECS = {
    "MLA576-fp8-P1": (
        kvmem.KVSpec(
            num_layers=3,
            num_kv_heads=1,
            head_dim=576,
            page_size=1,
            dtype=torch.float8_e4m3fn,
            v_head_dim=0,
        ),
        1500,
    ),
    "MLA1152-bf16-P64": (
        kvmem.KVSpec(
            num_layers=3,
            num_kv_heads=1,
            head_dim=576,
            page_size=64,
            dtype=torch.bfloat16,
            v_head_dim=0,
        ),
        9,
    ),
    "MLA576-fp8-P64": (
        kvmem.KVSpec(
            num_layers=2,
            num_kv_heads=1,
            head_dim=576,
            page_size=64,
            dtype=torch.float8_e4m3fn,
            v_head_dim=0,
        ),
        13,
    ),
    "MHA1152-bf16-P1": (
        kvmem.KVSpec(
            num_layers=3,
            num_kv_heads=3,
            head_dim=96,
            page_size=1,
            dtype=torch.bfloat16,
            v_head_dim=96,
        ),
        600,
    ),
}
TARGET = 300_000  # several planes a chunk for some shapes, one for others

pytestmark = pytest.mark.nixl


@pytest.fixture
def engines(nixl_agents):
    """``engines(role)``: a new NixlEngine (no progress thread) over a session-long agent,
    given back after the test."""
    made = []

    def make(role: str) -> NixlEngine:
        e = nixl_agents.engine()
        made.append(e)
        return e

    yield make
    nixl_agents.give_back(*made)


def _wait(a: NixlEngine, b: NixlEngine, h) -> None:
    while a.poll(h) == "PROC":
        b.get_notifs()
    assert h.state == "DONE", h.error
    a.release(h)


def _fill(pool: kvmem.KVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in pool.k_buffer + pool.v_buffer:
        u8 = b.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=gen))


def _inside_one(regions, a: int, n: int) -> bool:
    return sum(r <= a and a + n <= r + m for r, m in regions) == 1


def _split(local: tuple[int, int], regions) -> list[tuple[int, int]]:
    """One byte stream ``local`` as ranges cut at the registered regions it crosses."""
    a, n = local
    out = []
    for r, m in sorted(regions):
        lo, hi = max(a, r), min(a + n, r + m)
        if lo < hi:
            out.append((lo, hi - lo))
    assert sum(x for _, x in out) == n, "the stream is not covered by the regions"
    return out


def _page_ranges(pool, pages):
    return [(b[p].data_ptr(), b[p].nbytes) for b in pool.k_buffer + pool.v_buffer for p in pages]


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
@pytest.mark.parametrize("name", SPECS)
def test_every_page_moves_in_every_mode_across_chunks(engines, name, layout):
    spec, pages = SPECS[name]
    pa = kvmem.KVPool(spec, pages, layout=layout, chunk_bytes=TARGET)
    pb = kvmem.KVPool(spec, pages, layout=layout, chunk_bytes=TARGET)
    assert len(pa.regions()) >= 2, "the pool must span several chunks"
    a, b = engines("prefill"), engines("decode")
    a.register_pool(pa)
    b.register_pool(pb)
    assert a.open_registrations() == len(pa.regions())
    remote = a.add_peer(b.local_metadata())["kv"]
    b.add_peer(a.local_metadata())
    lt, rt = a.prep_local("kv"), a.prep_remote(remote)
    # every prepared descriptor (block) lies inside one chunk: each plane's whole span
    # inside one region, on both sides (NIXL checked the same when it prepared them)
    for lay, regions in ((lt.layout, pa.regions()), (rt.layout, pb.regions())):
        assert all(_inside_one(regions, s, n) for s, n in lay.spans())
        assert {
            next(i for i, (r, m) in enumerate(regions) if r <= s < r + m) for s, _ in lay.spans()
        } == set(range(len(regions)))  # and all chunks used
    ids = np.arange(1, pages, dtype=np.int64)
    dst = ids[::-1].copy()  # reversed: no two pages merge into one descriptor
    planes = np.arange(len(lt.layout.planes), dtype=np.int64)[:, None]

    def blocks(pool, p):
        return (planes * pool.num_pages + p).reshape(-1)

    # direct: every page of every plane, pool pages to pool pages
    _fill(pa, 1)
    _wait(a, b, a.post_blocks(lt, blocks(pa, ids), rt, blocks(pb, dst)))
    assert torch.equal(
        kvmem.pack_pages(pb, torch.from_numpy(dst)), kvmem.pack_pages(pa, torch.from_numpy(ids))
    )
    # pull: the same pages read back from b into a
    _fill(pb, 2)
    _wait(a, b, a.post_blocks(lt, blocks(pa, ids), rt, blocks(pb, dst), op="READ"))
    assert torch.equal(
        kvmem.pack_pages(pa, torch.from_numpy(ids)), kvmem.pack_pages(pb, torch.from_numpy(dst))
    )
    # packed: pack into a slot of a staging buffer that straddles its two chunks
    # (registered per chunk, the stream cut at them), write into b's page ranges, which
    # lie inside b's chunks
    _fill(pa, 3)
    nbytes = kvmem.packed_nbytes(spec, len(ids))
    assert nbytes <= 4 << 20
    staging = make_backend(4 << 20, torch.device("cpu"), chunk_bytes=2 << 20)
    a.register("staging", staging.regions(), 0)
    try:
        off = (2 << 20) - nbytes // 2
        slot = staging.tensor[off : off + nbytes]
        kvmem.pack_pages(pa, torch.from_numpy(ids), out=slot)
        local = _split((slot.data_ptr(), nbytes), staging.regions())
        assert len(local) == len(staging.regions()) == 2
        _wait(a, b, a.post_write(local, remote, _page_ranges(pb, dst)))
        assert torch.equal(kvmem.pack_pages(pb, torch.from_numpy(dst)), slot)
    finally:
        a.deregister("staging")
        staging.close()


def _adjacent_pair(engines):
    """Pools whose chunks are exactly full (1 MiB planes, two a 2 MiB chunk): consecutive
    regions are adjacent, both registered."""
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    pa = kvmem.KVPool(spec, 256, chunk_bytes=2 << 20)
    pb = kvmem.KVPool(spec, 256, chunk_bytes=2 << 20)
    (r0, n0), (r1, _) = pb.regions()
    assert r0 + n0 == r1  # adjacent
    a, b = engines("prefill"), engines("decode")
    a.register_pool(pa)
    b.register_pool(pb)
    remote = a.add_peer(b.local_metadata())["kv"]
    b.add_peer(a.local_metadata())
    return pa, pb, a, b, remote, r1


def test_a_write_across_two_adjacent_registered_chunks_is_refused(engines):
    """What a GPU pool's chunks do: NIXL refuses one descriptor over two registrations,
    adjacent or not; kvmem refuses it before NIXL; the same bytes as two ranges, one a
    chunk, land."""
    pa, pb, a, b, remote, cut = _adjacent_pair(engines)
    _fill(pa, 4)
    src = pa.k_buffer[0].data_ptr()
    with pytest.raises(ValueError, match=r"range 0 .* is not inside one registered region"):
        a.post_write([(src, 4096)], remote, [(cut - 2048, 4096)])
    a.prep_local("kv")  # NIXL accepts both tables: every block inside one chunk
    rt = a.prep_remote(remote)
    assert all(_inside_one(pb.regions(), s, n) for s, n in rt.layout.spans())
    # raw NIXL, no kvmem check in between: NIXL_ERR_NOT_FOUND
    ag = a.agent
    local = ag.get_xfer_descs(np.array([[src, 4096, 0]], dtype=np.uint64), "DRAM")
    across = ag.get_xfer_descs(np.array([[cut - 2048, 4096, 0]], dtype=np.uint64), "DRAM")
    for op in ("WRITE", "READ"):
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            ag.initialize_xfer(op, local, across, b.name, b"")
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # a strided row too
        ag.prep_xfer_dlist(
            b.name, np.array([[cut - 2048, 1024, 0, 1024, 4]], dtype=np.uint64), "DRAM"
        )
    _wait(a, b, a.post_write([(src, 4096)], remote, [(cut - 2048, 2048), (cut, 2048)]))
    got = torch.frombuffer((ctypes.c_ubyte * 4096).from_address(cut - 2048), dtype=torch.uint8)
    assert torch.equal(got, pa.k_buffer[0].view(torch.uint8).flatten()[:4096])


def test_registration_and_tables_of_the_issue_pool_of_ten_gb(engines):
    """A 10,000,000,000-byte CPU pool with 2 GiB chunks could not be
    registered ("layout plane ... is not inside one of its regions"); it registers, and
    its tables prepare, at once, with nothing touched."""
    spec = kvmem.KVSpec(
        num_layers=61,
        num_kv_heads=1,
        head_dim=576,
        page_size=64,
        dtype=torch.float8_e4m3fn,
        v_head_dim=0,
    )
    pages = 10_000_000_000 // spec.page_bytes
    pool = kvmem.KVPool(spec, pages, chunk_bytes=2 << 30)
    try:
        a = engines("prefill")
        reg = a.register_pool(pool)
        assert len(reg.regions) == len(pool.regions()) > 4
        lay = reg.layout
        assert all(_inside_one(reg.regions, s, n) for s, n in lay.spans())
        t = a.prep_local("kv")
        assert t.layout.blocks == 61 * pages
        assert pool.resident_bytes() == 0
        a.deregister("kv")
    finally:
        pool.close()


def test_a_table_past_int32_indices_is_refused_with_the_reason(engines):
    """2**31 blocks (one 2 GiB K plane of 1-byte pages): NIXL's indices are int32, so
    the table is refused before NIXL is asked, and direct_refusal says why (the PD layer
    then packs)."""
    spec = kvmem.KVSpec(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        page_size=1,
        dtype=torch.float8_e4m3fn,
        v_head_dim=0,
    )
    pool = kvmem.KVPool(spec, MAX_TABLE_BLOCKS + 1)
    try:
        a, b = engines("prefill"), engines("decode")
        reg = a.register_pool(pool)
        assert reg.layout.blocks == MAX_TABLE_BLOCKS + 1
        why = a.direct_refusal(reg.layout)
        assert why is not None and "more than the 2147483647 a prepared table" in why
        with pytest.raises(
            TransferError, match="cannot prepare a block table: .*int32.*only packed transfers"
        ):
            a.prep_local("kv")
        b.add_peer(a.local_metadata())
        with pytest.raises(TransferError, match="int32"):
            b.prep_remote(b.remote(a.name, "kv"))
        small = BlockLayout(reg.layout.planes, MAX_TABLE_BLOCKS)
        assert a.direct_refusal(small) is None and a.direct_refusal(None) is not None
    finally:
        pool.close()


def test_nixl_reads_block_indices_as_int32():
    """Why MAX_TABLE_BLOCKS exists: with nixl-cu12 1.5.1, index 2**32 + 5 of a strided
    table moves block 5 (int64 indices are accepted and wrapped).  Should a NIXL read them
    as int64, this fails and the limit can go."""
    import nixl_cu12 as nixl

    conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    tag = f"{os.getpid()}-{next(_ids)}"
    a, b = nixl.nixl_agent(f"wrap-a-{tag}", conf), nixl.nixl_agent(f"wrap-b-{tag}", conf)
    size = (1 << 32) + (1 << 20)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    ma, mb = mmap.mmap(-1, size, flags=flags), mmap.mmap(-1, size, flags=flags)
    pa = ctypes.addressof(ctypes.c_char.from_buffer(ma))
    pb = ctypes.addressof(ctypes.c_char.from_buffer(mb))
    a.register_memory([(pa, size, 0, "")], "DRAM")
    b.register_memory([(pb, size, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    lt = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.array([[pa, 1, 0, 1, size]], dtype=np.uint64), "DRAM"
    )
    rt = a.prep_xfer_dlist(b.name, np.array([[pb, 1, 0, 1, size]], dtype=np.uint64), "DRAM")
    big = (1 << 32) + 5
    ma[5], ma[big] = 0x11, 0x22
    idx = np.array([big], dtype=np.int64)
    h = a.make_prepped_xfer("WRITE", lt, idx, rt, idx, b"")
    a.transfer(h)
    while a.check_xfer_state(h) == "PROC":
        b.get_new_notifs()
    assert a.check_xfer_state(h) == "DONE"
    assert (mb[5], mb[big]) == (0x11, 0x00), "NIXL now reads int64 indices"
    h.release()
    del lt, rt, a, b


def test_a_nixl_without_strided_lists_gets_one_row_per_block_up_to_a_bound(engines, monkeypatch):
    """An older NIXL refuses the Nx5 form with TypeError (its get_xfer_descs returns
    None for it; sglang 0.5.23 falls back the same way): kvmem then prepares one row per
    block, and refuses (with the reason, before NIXL) a table past EXPANDED_MAX_BLOCKS."""
    from kvmem.transfer import nixl as nixl_engine

    spec, pages = SPECS["MLA576-fp8-P1"]
    pa = kvmem.KVPool(spec, pages, chunk_bytes=TARGET)
    pb = kvmem.KVPool(spec, pages, chunk_bytes=TARGET)
    a, b = engines("prefill"), engines("decode")
    a.register_pool(pa)
    b.register_pool(pb)
    remote = a.add_peer(b.local_metadata())["kv"]
    b.add_peer(a.local_metadata())
    real = a.agent.prep_xfer_dlist
    rows = []

    def old_nixl(name, descs, mem=None, backends=[]):
        if isinstance(descs, np.ndarray) and descs.shape[1] == 5:
            raise TypeError("prepXferDlist(): incompatible function arguments")
        rows.append(descs.shape[0])
        return real(name, descs, mem)

    monkeypatch.setattr(a.agent, "prep_xfer_dlist", old_nixl)
    lt, rt = a.prep_local("kv"), a.prep_remote(remote)
    assert rows == [lt.layout.blocks, rt.layout.blocks] and a._strided is False
    _fill(pa, 5)
    ids = np.arange(1, pages, dtype=np.int64)
    planes = np.arange(len(lt.layout.planes), dtype=np.int64)[:, None]
    blocks = (planes * pages + ids).reshape(-1)
    _wait(a, b, a.post_blocks(lt, blocks, rt, blocks))
    assert torch.equal(
        kvmem.pack_pages(pb, torch.from_numpy(ids)), kvmem.pack_pages(pa, torch.from_numpy(ids))
    )
    monkeypatch.setattr(nixl_engine, "EXPANDED_MAX_BLOCKS", lt.layout.blocks - 1)
    why = a.direct_refusal(lt.layout)
    assert why is not None and "no strided descriptor lists" in why
    with pytest.raises(TransferError, match="no strided descriptor lists"):
        a.prep_remote(remote)
    assert len(rows) == 2  # NIXL was not asked again
