"""The prefill's staging buffer follows its physical chunks.  The CUDA VMM
backend maps a buffer as one physical allocation per chunk and NIXL refuses a descriptor
that spans two registrations, so the staging buffer is registered one region per chunk
and no write posts one local range across a chunk boundary.  Here the chunks are
separate host mappings side by side (tests/disagg/harness.py SideBySideMappings) and
both sides run over real NIXL (session-long agents, tests/nixl_agents.py): what NIXL
refuses at a chunk boundary is the premise, so these tests stay on it."""

from __future__ import annotations

import pytest

import kvmem
from tests.disagg.harness import SPEC, Pair

CHUNK_BYTES = kvmem.packed_nbytes(SPEC, 4)  # one 64-token chunk of SPEC: 64 KiB
SPLIT = CHUNK_BYTES + CHUNK_BYTES // 2  # mappings of 96 KiB: the second slot straddles one


def record_local_ranges(pair: Pair) -> list:
    """Wrap the prefill engine's post_write (the real call): the local ranges of every
    write posted."""
    posts, real = [], pair.pe.post_write

    def post_write(local, remote, remote_ranges, notif=b""):
        posts.append([tuple(r) for r in local])
        return real(local, remote, remote_ranges, notif)

    pair.pe.post_write = post_write
    return posts


def inside_one(ranges, regions) -> bool:
    return all(any(a <= x and x + n <= a + m for a, m in regions) for x, n in ranges)


PAIR = dict(
    staging_chunk=SPLIT, engine="nixl"
)  # the shared pair fixture (tests/disagg/conftest.py)


@pytest.mark.nixl
def test_nixl_refuses_a_descriptor_across_two_mappings(pair):
    """The premise: two registrations side by side are two to NIXL.  A write whose local
    descriptor crosses from one into the other is refused (NIXL_ERR_NOT_FOUND), as a
    descriptor across two physical chunks is on a GPU."""
    regions = pair.prefill.staging.mem.regions()
    assert len(regions) >= 2 and regions[0][0] + regions[0][1] == regions[1][0]
    ag = pair.pe.agent
    # register each mapping on its own (the prefill registered them: its own regions)
    assert list(pair.pe.registrations()["staging"].regions) == regions
    landing = pair.pe.remote(pair.de.name, "landing")
    dst = (landing.regions[0][0], 8192)
    across = (regions[0][0] + regions[0][1] - 4096, 8192)
    within = (regions[0][0], 8192)
    remote = ag.get_xfer_descs([(*dst, 0)], "DRAM")
    h = ag.initialize_xfer(
        "WRITE", ag.get_xfer_descs([(*within, 0)], "DRAM"), remote, pair.de.name, b""
    )
    h.release()
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        ag.initialize_xfer(
            "WRITE", ag.get_xfer_descs([(*across, 0)], "DRAM"), remote, pair.de.name, b""
        )


@pytest.mark.nixl
def test_staging_registered_per_chunk_and_no_write_crosses_one(pair):
    regions = pair.prefill.staging.mem.regions()
    assert list(pair.pe.registrations()["staging"].regions) == regions
    posts = record_local_ranges(pair)
    # two requests in one batch: two staging slots at once, the second across a boundary
    for rid, n in ((1, 200), (2, 130), (3, 64), (4, 17)):
        pair.prefill.add_request(rid, n)
    pair.run_idle()
    assert all(pair.finished[r].status == 200 for r in (1, 2, 3, 4)), pair.finished
    assert posts and all(inside_one(p, regions) for p in posts), posts
    assert any(len(p) > 1 for p in posts), "no staged write met a chunk boundary"
    m = pair.decode.metrics
    total = sum(kvmem.packed_nbytes(SPEC, -(-n // 16)) + 64 for n in (200, 130, 64, 17))
    assert m.bytes_verified == m.bytes_landed == total
    pair.assert_clean()


def test_a_staging_buffer_whose_regions_do_not_tile_it_is_refused():
    """Staging offsets are offsets into its regions laid end to end: regions that leave a
    hole, or start past the buffer's first byte, are refused at construction."""
    import torch

    from kvmem.disagg.peers import buffer_map

    t = torch.zeros(8192, dtype=torch.uint8)
    base = t.data_ptr()
    assert buffer_map(t, [(base, 4096), (base + 4096, 4096)]).size == 8192
    for bad in (
        [(base, 4096), (base + 8192, 4096)],
        [(base + 4096, 4096)],
        [(base, 4096), (base + 4096, 2048)],
    ):
        with pytest.raises(ValueError, match="do not tile"):
            buffer_map(t, bad)


@pytest.mark.nixl
def test_calibration_writes_cut_at_both_sides_chunks():
    """calibrate_direct's packed moves go through the same cut: its staging chunk spans
    two 32 KiB mappings and the landing buffer is registered in 40000-byte regions."""
    import threading

    from kvmem.disagg.calibrate import calibrate_direct

    p = Pair(staging_chunk=32768, landing_chunk=40000, engine="nixl")
    stop = threading.Event()

    def drive_decode():  # the decode's engine must progress (no NIXL progress thread)
        while not stop.is_set():
            p.de.get_notifs()

    posts = record_local_ranges(p)
    t = threading.Thread(target=drive_decode)
    t.start()
    try:
        rec = calibrate_direct(p.prefill, chunk_pages=4, rounds=1, runs=[1, 4])
    finally:
        stop.set()
        t.join()
    try:
        regions = p.prefill.staging.mem.regions()
        assert posts and all(len(x) == 2 and inside_one(x, regions) for x in posts), posts
        assert len(rec["rows"]) == 2 and all(r["packed_s"] > 0 for r in rec["rows"])
        assert p.pe.open_handles() == 0
    finally:
        p.close()
